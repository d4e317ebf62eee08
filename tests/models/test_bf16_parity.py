"""Packed vs each sample alone in bf16, each built-in adapter's model wrapped in real Megatron-Core
`DistributedDataParallel(Float16Module(model))` (what Megatron's `get_model` does with `--bf16`),
through the shipped `make_forward_step`.

`Float16Module` calls `module.bfloat16()` on the whole model (towers included) and casts float32
tensors passed positionally to bf16. Per adapter this checks that a packed step runs, that the
float inputs reach the place they are used with the intended dtype and values (positions integer or
float32, never bf16; our towers get the loader's float32 media and compute in their own dtype; LLaVA's
images are cast to bf16 by the wrapper, as Megatron's own LLaVA training does), and that the packed
per-token losses equal those of each sample alone within TOLERANCE.

The bf16 runs are checked to be bf16 (every parameter bf16) and the comparisons to be non-trivial
(losses of a few nats over every target). The positions here are integers, which the wrapper never
casts; fractional (Qwen3-Omni) positions under the wrapper: tests/models/test_float16_inputs.py.
Without the towers' own casts of their float32 inputs, the PackedVLM case fails (dtype mismatch).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

# Measured on CPU (reference attention; megatron-core 0.19 and 0.16.1, 1 and 2 threads): packed - alone
# is exactly 0.0 for every adapter in bf16 (the fp32 runs: 4.8e-7). The whole bf16 effect (bf16 vs fp32
# losses of the same weights, PackedVLM with Qwen3-Omni media) is 6.0e-3 per token; the bound stays
# below it, so an input that only one side rounds to bf16 shows, while one flipped bf16 rounding passes.
TOLERANCE = 4e-3


def _wrapped(model, config):
    """DDP(Float16Module(model)), as Megatron's `get_model` wraps it for bf16 training (fp32 grad reduce)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    assert config.bf16 and config.params_dtype == torch.bfloat16
    wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                      Float16Module(config, model))
    dtypes = {p.dtype for p in wrapped.parameters()}
    assert dtypes == {torch.bfloat16}, dtypes
    return wrapped


def _losses(model, batch: dict, *, pack: bool, label_style: str = "hf", mrope=None) -> torch.Tensor:
    """[targets] per-token losses of one micro-batch through the shipped step (float32 out of the wrapper)."""
    from megatron_vlm_packing.step import make_forward_step

    seen = []
    step = make_forward_step(pack=pack, label_style=label_style, mrope=mrope,
                             transform=lambda mb: seen.append(mb) or mb)
    output, _ = step(iter([batch]), model)
    losses, mask = output if isinstance(output, tuple) else (output, seen[0].loss_mask)
    assert losses.dtype == torch.float32
    return losses.detach()[mask.bool()]


def _compare(model, batch: dict, alone: list[dict], **kwargs) -> float:
    packed = _losses(model, batch, pack=True, **kwargs)
    single = torch.cat([_losses(model, one, pack=False, **kwargs) for one in alone])
    assert packed.shape == single.shape and packed.numel() >= 8
    assert 1.0 < float(packed.mean()) < 10.0  # untrained: about log(vocab) nats
    return float((packed - single).abs().max())


def _text_rows(batch: dict) -> list[dict]:
    """Each row of a right-padded text batch alone, unpadded."""
    rows = []
    for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        rows.append({k: batch[k][i:i + 1, :n] for k in ("input_ids", "labels", "attention_mask")})
    return rows


class _Inputs:
    """What `module.forward` is called with (a forward pre-hook: positional and keyword arguments)."""

    def __init__(self, module):
        self.calls = []
        module.register_forward_pre_hook(lambda m, args, kwargs: self.calls.append((args, kwargs)),
                                         with_kwargs=True)


@pytest.mark.parametrize("rotary", ["rope", "mrope"])
def test_gpt_adapter_bf16_packed_equals_alone(single_process_megatron, rotary):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.rope import use_packed_mrope
    from megatron_vlm_packing.testing.parity import variable_batch
    from megatron_vlm_packing.testing.vlm_parity import ROPE

    torch.manual_seed(0)
    lm = build_tiny_gpt(TinyGPTConfig(position_embedding_type=rotary, params_dtype=torch.bfloat16),
                        scatter_embedding_sequence_parallel=False)
    if rotary == "mrope":
        use_packed_mrope(lm)
    rotary_inputs = _Inputs(lm.rotary_pos_emb)
    model = _wrapped(lm, lm.config)
    batch = variable_batch([13, 5, 21, 9], 21, vocab_size=120, seed=1)  # ids < ROPE's media ids: text only
    error = _compare(model, batch, _text_rows(batch), label_style="megatron", mrope=ROPE if rotary == "mrope" else None)
    assert error <= TOLERANCE, error
    if rotary == "mrope":  # our packed rotary gets the [3, 1, T] positions themselves, never bf16
        positions = [args[0] for args, _ in rotary_inputs.calls]
        assert positions and all(p.dtype in (torch.long, torch.float32) for p in positions)


def test_packed_vlm_bf16_images_videos_audio(single_process_megatron):
    from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
    from megatron_vlm_packing.testing.vlm_parity import LM, MEDIA, build_vlm

    vlm = build_vlm(replace(LM, params_dtype=torch.bfloat16), 0, media=True, mrope=True)
    vision, audio = _Inputs(vlm.vision), _Inputs(vlm.audio)
    rotary_inputs = _Inputs(vlm.language_model.rotary_pos_emb)
    model = _wrapped(vlm, vlm.config)
    samples = synthetic_samples(4, seed=1, cfg=MEDIA)
    batch = collate(samples)
    assert "pixel_values_videos" in batch and "input_features" in batch and batch["pixel_values"].shape[0]
    error = _compare(model, batch, [collate([s]) for s in samples])
    assert error <= TOLERANCE, error
    # The packed call (the first): the towers got the loader's float32 values, unchanged, and the
    # rotary integer / float32 positions.
    pixels = {args[0].shape[0]: args[0] for args, _ in vision.calls[:2]}
    assert torch.equal(pixels[batch["pixel_values"].shape[0]], batch["pixel_values"])
    assert torch.equal(pixels[batch["pixel_values_videos"].shape[0]], batch["pixel_values_videos"])
    assert torch.equal(audio.calls[0][0][0], batch["input_features"])
    assert all(args[0].dtype in (torch.long, torch.float32) for args, _ in rotary_inputs.calls)


def _llava_rows(batch: dict) -> list[dict]:
    """Each row of a collated LLaVA batch alone, with its own image tiles."""
    from megatron_vlm_packing.testing.llava_parity import IMAGE_TOKEN

    rows, image, tile = [], 0, 0
    for i, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        tiles = batch["num_image_tiles"][image:image + int((batch["input_ids"][i, :n] == IMAGE_TOKEN).sum())]
        count = int(tiles.sum())
        rows.append({k: batch[k][i:i + 1, :n] for k in ("input_ids", "labels", "attention_mask")}
                    | {"images": batch["images"][tile:tile + count], "num_image_tiles": tiles})
        image, tile = image + tiles.numel(), tile + count
    return rows


def test_llava_bf16_packed_equals_alone(single_process_megatron):
    from megatron_vlm_packing.patches import apply_llava_packed_boundaries
    from megatron_vlm_packing.testing.llava_parity import MICRO_BATCHES, build_tiny_llava, collated

    apply_llava_packed_boundaries()
    llava = build_tiny_llava(11, params_dtype=torch.bfloat16)
    inputs = _Inputs(llava)
    model = _wrapped(llava, llava.language_model.config)
    batch = collated(MICRO_BATCHES[0], label_style="hf", seed=3)
    error = _compare(model, batch, _llava_rows(batch))
    assert error <= TOLERANCE, error
    (images, input_ids, positions, _), kwargs = inputs.calls[0]
    assert images.dtype == torch.bfloat16 and torch.equal(images, batch["images"].bfloat16())  # Megatron's cast
    assert positions.dtype == torch.long and kwargs["loss_mask"].dtype == torch.float32
