"""Pads never count in the MoE router's load-balancing loss when the plan's padding mask is passed."""

from megatron_vlm_packing.runtime import run_distributed
from megatron_vlm_packing.testing.moe_parity import run_moe_aux_loss, run_packed_vlm_moe_aux_loss, run_standalone_moe_sp


def test_router_aux_loss_ignores_pad_slots_given_the_padding_mask():
    r = run_distributed(run_moe_aux_loss, 1)
    assert r["pad_slots"] > 0
    assert abs(r["padded_with_mask"] - r["no_padding"]) <= 1e-5 * abs(r["no_padding"]), r
    # Without the mask the same real tokens give a different aux loss: the path the mask fixes.
    assert abs(r["padded_without_mask"] - r["no_padding"]) > 1e-2 * abs(r["no_padding"]), r


def test_packed_vlm_router_aux_loss_ignores_pad_slots():
    """PackedVLM embeds itself and hands its language model `decoder_input` and the plan's padding mask."""
    r = run_distributed(run_packed_vlm_moe_aux_loss, 1)
    assert r["pad_slots"] > 0
    assert abs(r["padded_with_mask"] - r["no_padding"]) <= 1e-5 * abs(r["no_padding"]), r


def test_standalone_moe_under_tp_sp_routes_with_a_scattered_mask_given_the_embedding_patch_alone():
    """A language model built with scatter_embedding_sequence_parallel=False, called standalone at TP=2 + SP with
    only apply_sp_embedding_scatter() on (what the GPTModel adapter asks for): the patch embeds and scatters, so it
    must scatter the padding mask too, as megatron-core does when it embeds for itself. On megatron-core 0.16.1 it
    did not: the router got a [1, T] mask for T/2 tokens ('size of tensor a (18) must match ... (36)')."""
    r = run_distributed(run_standalone_moe_sp, 2)
    assert r["pad_slots"] > 0
    for name in ("no_padding", "padded", "padded_with_both_patches"):
        outcome = r[name]
        assert "error" not in outcome and outcome["mask"] == outcome["tokens"], r
        assert abs(outcome["loss"] - r["reference_loss"]) <= 1e-4 * abs(r["reference_loss"]), r
    # Pads never count: the same real tokens give the same aux loss over the TP group, padded or not.
    for name in ("padded", "padded_with_both_patches"):
        assert abs(r[name]["aux"] - r["no_padding"]["aux"]) <= 1e-5 * abs(r["no_padding"]["aux"]), r
