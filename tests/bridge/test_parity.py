"""Megatron-Bridge's Qwen-VL models, as Bridge's providers build them, packed with images and videos
through their adapters: loss and every parameter gradient (vision tower included) equal each
sample alone, under TP2 + SP, CP2 and TP2 x CP2 x SP, through the shipped make_forward_step; the
deepstack patch is necessary (unpatched TP2 + SP fails) and sufficient; Qwen2.5-VL under CP is
refused without its patch. One 4-process launch."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

CASES = [
    ("qwen3_vl", 2, 1, True),
    ("qwen3_vl", 2, 1, True, "unpatched"),
    ("qwen3_vl", 1, 2, False),
    ("qwen3_vl", 2, 2, True),
    ("qwen3_vl_moe", 2, 2, True),
    ("qwen25_vl", 2, 2, True),
    ("qwen25_vl", 1, 2, False, "refused"),
]


@pytest.fixture(scope="module")
def results():
    from megatron_vlm_packing.bridge.parity import run_bridge_parity

    return {r["case"]: r for r in run_distributed(run_bridge_parity, 4, CASES, timeout_s=900)}


def test_models_are_bridges_own_built_without_te(results):
    for case, r in results.items():
        assert not r["transformer_engine_imported"] and not r["bridge_package_imported"], r
        if "model" in r:
            expected = "Qwen25VLModel" if case[0] == "qwen25_vl" else "Qwen3VLModel"
            assert r["model"].startswith("megatron.bridge.models.qwen_vl.") and r["model"].endswith(expected), r


@pytest.mark.parametrize("case", [c for c in CASES if len(c) == 4], ids=lambda c: f"{c[0]}-tp{c[1]}-cp{c[2]}-sp{int(c[3])}")
def test_packed_equals_each_sample_alone(results, case):
    r = results[case]
    assert r["missing"] == [] and r["vision_params"] >= 30, r
    # loss sums are ~250 nats: 1e-4 absolute is 4e-7 relative
    assert r["abs_dloss"] < 1e-4 and r["max_rel_grad_err"] < 1e-5, r


def test_deepstack_patch_is_necessary(results):
    r = results[("qwen3_vl", 2, 1, True, "unpatched")]
    assert r["abs_dloss"] < 1e-4, r  # the forward is right; only the vision gradients are wrong
    assert r["max_rel_vision_grad_err"] > 1e-2 and r["vision_params_off"] > 0, r


def test_qwen25_vl_context_parallel_is_refused_without_its_patch(results):
    message = results[("qwen25_vl", 1, 2, False, "refused")]["refused"]
    assert message is not None and "context_parallel_size=2" in message and "apply_bridge_qwen25_vl_cp" in message
