"""benchmarks/bridge_step_vs_bridge.py cannot rot: its smallest config runs one step per arm (ours,
ours loader-packed, Bridge's qwen3_vl_step, Bridge's vlm_step) on Bridge's Qwen3-VL, and every arm
matches each sample alone; its CPU attention equals the project's reference attention."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")


def _benchmark():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import bridge_step_vs_bridge

    return bridge_step_vs_bridge


def _tiny_run(rank, world_size):
    _, raw = _benchmark().run("tiny", warmup=0, repeats=1)
    return raw


def test_tiny_config_one_step_per_arm_and_every_arm_equals_alone():
    raw = run_distributed(_tiny_run, 1, timeout_s=300)
    arms = _benchmark().ARMS
    assert {arm: len(raw["times"][arm]) for arm in arms} == {arm: 1 for arm in arms}
    for arm in arms:
        _, relative_dloss, grad_err = raw["checks"][arm]
        assert relative_dloss < 1e-5 and grad_err < 1e-4, (arm, raw["checks"][arm])
    (real, ours, _, _), = raw["shapes"]["ours"]
    (_, bridge_padded, _, _), = raw["shapes"]["qwen3_vl_step"]
    (_, bridge_packed, _, _), = raw["shapes"]["vlm_step"]
    assert ours == bridge_packed == real  # TP = CP = 1: both pack at real lengths
    assert bridge_padded % 128 == 0 and bridge_padded >= 3 * 128 > real  # every row padded (bug class 4)


def test_segment_attention_equals_reference_attention_with_gaps():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_vlm_packing.attention.reference import ReferenceCoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0)
    # real lengths 5, 3, 5 in physical 6, 4, 6: a gap after every document ([0, 5, 8, 15] claimed 7 real
    # tokens in the last document's 6 slots, which the reference attention now refuses)
    cu = torch.tensor([0, 5, 8, 13], dtype=torch.int32)
    padded = torch.tensor([0, 6, 10, 16], dtype=torch.int32)  # a gap after every document
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=6, max_seqlen_kv=6)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, heads, 4, generator=g) for heads in (4, 2, 2))
    for mask_type in (AttnMaskType.causal, AttnMaskType.no_mask):
        ours = _benchmark().SegmentAttention(config, 1, mask_type, None)(q, k, v, None, packed_seq_params=params)
        ref = ReferenceCoreAttention(config, 1, mask_type, None)(q, k, v, None, packed_seq_params=params)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert ours[5].abs().max() == 0  # a pad slot gives 0
