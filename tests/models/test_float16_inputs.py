"""Inputs reach the model as the micro-batch holds them under Megatron's `Float16Module` (bf16 / fp16).

`Float16Module.forward` casts every float32 tensor passed positionally to the model's half dtype.
Qwen3-Omni's temporal mRoPE positions are fractional float32: passed positionally they were rounded
(300.25 -> 300, 325.25 -> 326 in bf16) before the rotary saw them. The built-in adapters pass them by
keyword; this holds it for the GPT adapter and `PackedVLM`'s, through a real `Float16Module`.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing import pack_batch

B, S = 2, 8


def _positions() -> torch.Tensor:
    """[3, B, S] float32 positions with quarter fractions (none of which bf16 holds exactly here)."""
    return (torch.arange(S, dtype=torch.float32) * 12.5 + 300.25).expand(3, B, S).clone()


def _micro_batch():
    ids = torch.arange(1, 1 + B * S).reshape(B, S)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones(B, S, dtype=torch.long),
             "position_ids": _positions()}
    return pack_batch(batch, label_style="hf")


def _language_model(dtype):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt

    torch.manual_seed(0)
    flags = {"bf16": True} if dtype == torch.bfloat16 else {"fp16": True}
    return build_tiny_gpt(TinyGPTConfig(position_embedding_type="mrope", mrope_section=(1, 1, 2), params_dtype=dtype,
                                        extra=flags), scatter_embedding_sequence_parallel=False)


def _positions_seen(model: torch.nn.Module) -> list:
    """The position_ids each call of `model.forward` receives (a pre-hook, positional or keyword)."""
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[1] if len(args) > 1 else kwargs["position_ids"]),
        with_kwargs=True)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("adapter_of", ["gpt", "packed_vlm"])
def test_fractional_positions_reach_the_model_unrounded_under_float16_module(single_process_megatron, adapter_of,
                                                                              dtype):
    from megatron.core.transformer.module import Float16Module

    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.rope import MRopeConfig, use_packed_mrope

    language_model = _language_model(dtype)
    if adapter_of == "gpt":
        use_packed_mrope(language_model)
        inner = language_model
    else:
        from megatron_vlm_packing.models.packed_vlm import PackedVLM

        inner = PackedVLM(language_model, mrope=MRopeConfig(family="qwen2_vl", image_token_id=900, video_token_id=901))
    seen = _positions_seen(language_model)
    wrapped = Float16Module(language_model.config, inner)
    micro_batch = _micro_batch()
    adapter_for(wrapped).forward(wrapped, micro_batch)
    assert seen and seen[-1].dtype == torch.float32
    assert torch.equal(seen[-1], micro_batch.position_ids)  # 300.25, 312.75, ...: not rounded to the half dtype
