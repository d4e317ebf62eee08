"""Bridge's MoE models packed (Qwen3-VL MoE, an MoE Qwen3-Omni thinker): the router's load-balancing loss is the
same with many pad slots as with only the layout's alignment, and as dense right-padded rows
(`patches.bridge_qwen3_vl_moe_pads` hands Bridge's block the plan's padding mask), at TP=1, TP2 + SP and CP2;
without the patch the adapters refuse a micro-batch with pad slots. Bridge's block took no padding_mask: for the
same real tokens the aux loss is 258.2 without pad slots and 861.8 with 173 (Qwen3-VL MoE), 139.1 and 929.7 with
212 (Omni), silently (the tiny models' 3 language layers)."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

SINGLE = [("qwen3_vl_moe", 1, 1, False), ("qwen3_omni", 1, 1, False)]
PARALLEL = [("qwen3_vl_moe", 2, 1, True), ("qwen3_vl_moe", 1, 2, False), ("qwen3_omni", 2, 1, True),
            ("qwen3_omni", 1, 2, False)]
IDS = {case: f"{case[0]}-tp{case[1]}-cp{case[2]}{'-sp' if case[3] else ''}" for case in SINGLE + PARALLEL}


@pytest.fixture(scope="module")
def results():
    from megatron_vlm_packing.bridge.moe_aux import run_bridge_moe_aux_loss

    runs = run_distributed(run_bridge_moe_aux_loss, 1, SINGLE, timeout_s=900) + \
        run_distributed(run_bridge_moe_aux_loss, 2, PARALLEL, timeout_s=900)
    return {r["case"]: r for r in runs}


@pytest.mark.parametrize("case", SINGLE + PARALLEL, ids=IDS.get)
def test_router_aux_loss_ignores_pad_slots(results, case):
    r = results[case]
    assert abs(r["padded"] - r["aligned"]) <= 1e-5 * abs(r["aligned"]), r
    if "dense" in r:  # the rows' pads are left out too
        assert abs(r["dense"] - r["aligned"]) <= 1e-5 * abs(r["aligned"]), r
    # Bridge's dense Omni path encodes both rows' clips in one call: refused where they would read each other
    # (transformers 5.8's audio attention under eager; its dense aux loss was 139.0797 for 139.0758 packed)
    assert ("dense_refused" in r) == r.get("clips_read_each_other", False), r
    if "dense_refused" in r:
        assert "2 audio clips in one call" in r["dense_refused"] and "attend to each other" in r["dense_refused"], r


@pytest.mark.parametrize("case", PARALLEL, ids=IDS.get)
def test_parallel_aux_loss_is_the_single_process_one(results, case):
    """Each of the 2 ranks attaches the aux loss of the whole micro-batch (Megatron-Core reduces the router's
    counts over the TP x CP group): their sum is twice the single process's, CP's alignment pads and SP's
    chunks of the mask included."""
    r, truth = results[case], results[(case[0], 1, 1, False)]["aligned"]
    assert abs(r["aligned"] - 2 * truth) <= 1e-5 * truth, (r, truth)


@pytest.mark.parametrize("case", SINGLE + PARALLEL, ids=IDS.get)
def test_adapter_refuses_pads_without_the_patch(results, case):
    message = results[case]["refused_without_patch"]
    assert message is not None and "apply_bridge_qwen3_vl_moe_pads()" in message and "pad slots" in message


def test_full_recompute_is_refused_with_pads():
    from types import SimpleNamespace

    from megatron_vlm_packing.patches.bridge_qwen3_vl_moe_pads import refuse_full_recompute

    refuse_full_recompute(SimpleNamespace(recompute_granularity="selective"), 5)
    refuse_full_recompute(SimpleNamespace(recompute_granularity=None), 5)
    with pytest.raises(ValueError, match=r"recompute_granularity='full'.*5 pad slots"):
        refuse_full_recompute(SimpleNamespace(recompute_granularity="full"), 5)
