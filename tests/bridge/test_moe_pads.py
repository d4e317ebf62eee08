"""Bridge's Qwen3-VL MoE, packed: the router's load-balancing loss is the same with many pad slots as with
only the layout's alignment (`patches.bridge_qwen3_vl_moe_pads` hands Bridge's block the plan's padding mask),
at TP=1, TP2 + SP and CP2; without the patch the adapter refuses a micro-batch with pad slots. Bridge's block
took no padding_mask: on this model the aux loss for the same 83 real tokens was 174.7 without pad slots and
561.6 with 173, silently."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

LAYOUTS = [(1, 1, False), (2, 1, True), (1, 2, False)]


@pytest.fixture(scope="module")
def results():
    from megatron_vlm_packing.bridge.moe_aux import run_bridge_moe_aux_loss

    return {r["layout"]: r for r in run_distributed(run_bridge_moe_aux_loss, 2, LAYOUTS[1:], timeout_s=900)} | \
        {r["layout"]: r for r in run_distributed(run_bridge_moe_aux_loss, 1, LAYOUTS[:1], timeout_s=900)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp1", "tp2-sp", "cp2"])
def test_router_aux_loss_ignores_pad_slots(results, layout):
    r = results[layout]
    assert abs(r["padded"] - r["aligned"]) <= 1e-5 * abs(r["aligned"]), r
    assert abs(r["dense"] - r["aligned"]) <= 1e-5 * abs(r["aligned"]), r  # rows' pads left out too


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=["tp2-sp", "cp2"])
def test_parallel_aux_loss_is_the_single_process_one(results, layout):
    """Each of the 2 ranks attaches the aux loss of the whole micro-batch (Megatron-Core reduces the router's
    counts over the TP x CP group): their sum is twice the single process's, CP's alignment pads and SP's
    chunks of the mask included."""
    r, truth = results[layout], results[LAYOUTS[0]]["aligned"]
    assert abs(r["aligned"] - 2 * truth) <= 1e-5 * truth, (r, truth)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp1", "tp2-sp", "cp2"])
def test_adapter_refuses_pads_without_the_patch(results, layout):
    message = results[layout]["refused_without_patch"]
    assert message is not None and "apply_bridge_qwen3_vl_moe_pads()" in message and "pad slots" in message


def test_full_recompute_is_refused_with_pads():
    from types import SimpleNamespace

    from megatron_vlm_packing.patches.bridge_qwen3_vl_moe_pads import refuse_full_recompute

    refuse_full_recompute(SimpleNamespace(recompute_granularity="selective"), 5)
    refuse_full_recompute(SimpleNamespace(recompute_granularity=None), 5)
    with pytest.raises(ValueError, match=r"recompute_granularity='full'.*5 pad slots"):
        refuse_full_recompute(SimpleNamespace(recompute_granularity="full"), 5)
