"""Pads never count in the MoE router's load-balancing loss when the plan's padding mask is passed."""

from megatron_vlm_packing.runtime import run_distributed
from megatron_vlm_packing.testing.moe_parity import run_moe_aux_loss


def test_router_aux_loss_ignores_pad_slots_given_the_padding_mask():
    r = run_distributed(run_moe_aux_loss, 1)
    assert r["pad_slots"] > 0
    assert abs(r["padded_with_mask"] - r["no_padding"]) <= 1e-5 * abs(r["no_padding"]), r
    # Without the mask the same real tokens give a different aux loss: the path the mask fixes.
    assert abs(r["padded_without_mask"] - r["no_padding"]) > 1e-2 * abs(r["no_padding"]), r
