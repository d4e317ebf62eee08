"""Forwards of one real mRoPE GPTModel in a row, ours vs Megatron-Core's own rotary (one process, gloo).

`run_forwards_in_a_row(rank, world_size)` is a `run_distributed` target. It builds a tiny mRoPE
GPTModel, copies it, and runs the same sequence of calls through Megatron-Core's own rotary (the
reference: at CP=1 its THD path takes each packed token's row of the full table, which is right)
and then through `use_packed_mrope`: packed micro-batches of different T and documents, a dense
forward, a packed call whose positions differ from an earlier one of the same T (a shape check
alone would not see a stale table there), the first micro-batch again, and fractional (float)
positions packed and dense (Qwen3-Omni's). Returns, per call,
the worst |dlogit| between the two, and how much that call's logits move when its positions are
swapped for another call's of the same shape (so the comparison has power).
"""

from __future__ import annotations

import copy
import torch

from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.runtime.launcher import initialize_parallel

LM = TinyGPTConfig(vocab_size=64, position_embedding_type="mrope", mrope_section=(1, 1, 2), max_sequence_length=128)


def _params(lengths: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def _calls(generator: torch.Generator) -> list[tuple[str, dict]]:
    def packed(lengths):
        total = sum(lengths)
        return dict(input_ids=torch.randint(1, LM.vocab_size, (1, total), generator=generator),
                    position_ids=torch.randint(0, 60, (3, 1, total), generator=generator),
                    packed_seq_params=_params(lengths))

    first = packed([6, 10])
    same_t = packed([6, 10]) | {"input_ids": first["input_ids"]}  # only the positions differ from `first`
    dense = dict(input_ids=torch.randint(1, LM.vocab_size, (2, 12), generator=generator),
                 position_ids=torch.randint(0, 60, (3, 2, 12), generator=generator))
    # Qwen3-Omni's temporal positions are fractional: float positions rotate as given, packed and dense.
    fractional = first | {"position_ids": first["position_ids"].float() / 2}
    fractional_dense = dense | {"position_ids": dense["position_ids"].float() / 2}
    return [("packed T=16", first), ("packed T=24", packed([8, 4, 12])), ("dense B=2 S=12", dense),
            ("packed T=16, other positions", same_t), ("dense again", dense), ("packed T=16 again", first),
            ("packed T=16, fractional positions", fractional), ("dense, fractional positions", fractional_dense)]


def _logits(model, call: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(call["input_ids"], call["position_ids"], None,
                     packed_seq_params=call.get("packed_seq_params"))


def run_forwards_in_a_row(rank: int, world_size: int) -> dict:
    from megatron_vlm_packing.patches.thd_rotary import thd_rotary_applied
    from megatron_vlm_packing.rope import use_packed_mrope

    initialize_parallel(seed=5)
    megatron, ours = build_tiny_gpt(LM), build_tiny_gpt(LM)
    ours.load_state_dict(megatron.state_dict())
    calls = _calls(torch.Generator().manual_seed(5))
    assert not thd_rotary_applied()  # the reference runs Megatron-Core's own THD rope
    expected = [_logits(megatron, call) for _, call in calls]
    use_packed_mrope(ours)
    got = [_logits(ours, call) for _, call in calls]
    swapped = _logits(ours, replace_positions(calls[0][1], calls[3][1]))
    return {"dlogit": {name: (g - e).abs().max().item() for (name, _), g, e in zip(calls, got, expected)},
            "positions_matter": (swapped - got[0]).abs().max().item()}


def replace_positions(call: dict, other: dict) -> dict:
    return call | {"position_ids": other["position_ids"]}
