"""Megatron-Bridge's Qwen3-VL (dense, MoE), Qwen2.5-VL and Qwen3-Omni thinker, as Bridge's providers
build them per pipeline stage, trained packed through the shipped make_forward_step and
Megatron-Core's pipeline schedule (PP=2, 3 micro-batches in 1F1B): loss and every parameter gradient
on every stage (vision and audio towers included) equal each sample alone on the TP = PP = 1 model,
with a fixed packed length (pad_to) and at real lengths (variable_seq_lengths), with tied word
embeddings through Megatron's DDP and finalize_model_grads; a control where later
stages ignore the boundaries fails the comparison; Qwen3-Omni with fewer first-stage layers than
deepstack levels is a ValueError on the first stage. One 4-process launch."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

PARITY = [  # one case per family and a tied-embedding one: 5 truths, 7 packed runs in the launch
    ("qwen3_vl", 2, 2, True),
    ("qwen3_vl_moe", 1, 2, False, "variable"),
    ("qwen25_vl", 1, 2, False, "cp2"),
    ("qwen3_omni", 2, 2, True),
    ("qwen25_vl", 1, 2, False, "tied"),  # tied word embeddings: DDP + finalize_model_grads sum both stages
]
CONTROL = ("qwen3_vl", 1, 2, False, "control")
REFUSED = ("qwen3_omni", 1, 2, False, "refused")


@pytest.fixture(scope="module")
def results():
    from megatron_vlm_packing.bridge.parity_pp import run_bridge_pp_parity

    cases = PARITY + [CONTROL, REFUSED]
    results = run_distributed(run_bridge_pp_parity, 4, cases, timeout_s=900)
    for r in results:
        print({k: v for k, v in r.items() if k != "worst_params"})
    return {r["case"]: r for r in results}


@pytest.mark.parametrize("case", PARITY, ids=lambda c: "-".join(map(str, c)))
def test_packed_through_the_pipeline_equals_each_sample_alone(results, case):
    r = results[case]
    assert r["missing"] == [] and r["micro_batches"] == 3, r  # every parameter compared on some stage
    assert r["tower_params"] >= 30 and r["tokens"] == r["ref_tokens"] > 50, r
    # loss sums are ~400 nats: 1e-4 absolute is 2.5e-7 relative
    assert r["abs_dloss"] < 1e-4 and r["max_rel_grad_err"] < 1e-5, r


def test_later_stages_ignoring_the_boundaries_fail_the_comparison(results):
    r = results[CONTROL]
    # measured: |dloss| 0.12, grads off by 1.3 relative (parity is < 1e-4 and < 1e-5)
    assert r["abs_dloss"] > 1e-3 and r["max_rel_grad_err"] > 0.1, r


def test_omni_first_stage_with_fewer_layers_than_deepstack_levels_is_refused(results):
    said = results[REFUSED]["refused"]  # pipeline rank -> ValueError message (None: accepted)
    assert said[1] is None, said  # later stages hold no deepstack layer
    assert "2 deepstack levels" in said[0] and "holds 1 language layer" in said[0], said
    assert "num_layers_in_first_pipeline_stage" in said[0], said
