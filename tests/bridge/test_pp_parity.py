"""Megatron-Bridge's Qwen3-VL (dense, MoE), Qwen2.5-VL and Qwen3-Omni thinker, as Bridge's providers
build them per pipeline stage, trained packed through the shipped make_forward_step and
Megatron-Core's pipeline schedule (PP=2, 3 micro-batches in 1F1B, fixed packed length): loss and every
parameter gradient on every stage (vision and audio towers included) equal each sample alone on the
TP = PP = 1 model. One 4-process launch."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

CASES = [
    ("qwen3_vl", 2, 2, True),
    ("qwen3_vl_moe", 1, 2, False),
    ("qwen25_vl", 2, 2, True),
    ("qwen3_omni", 2, 2, True),
]


@pytest.fixture(scope="module")
def results():
    from megatron_vlm_packing.bridge.parity_pp import run_bridge_pp_parity

    return {r["case"]: r for r in run_distributed(run_bridge_pp_parity, 4, CASES, timeout_s=900)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-pp{c[2]}-tp{c[1]}-sp{int(c[3])}")
def test_packed_through_the_pipeline_equals_each_sample_alone(results, case):
    r = results[case]
    assert r["missing"] == [] and r["micro_batches"] == 3, r  # every parameter compared on some stage
    assert r["tower_params"] >= 30 and r["tokens"] == r["ref_tokens"] > 50, r
    # loss sums are ~400 nats: 1e-4 absolute is 2.5e-7 relative
    assert r["abs_dloss"] < 1e-4 and r["max_rel_grad_err"] < 1e-5, r
