"""SP patches of GPTModel.forward on a real TP=2 + SP model (CPU, gloo), on whichever megatron-core
this environment has: 0.16.1 needs the embedding-scatter patch, 0.19 has the fix upstream."""

from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.testing.patch_checks import run_sp_patch_checks


def test_sp_patches():
    r = run_distributed(run_sp_patch_checks, 2)
    local = r["decoder_local_tokens_expected"]
    # Standalone LM forward under SP: T/tp local tokens and the TP=1 loss, patched or fixed upstream.
    assert r["patched"]["decoder_tokens"] == local
    assert abs(r["patched"]["loss"] - r["patched"]["ref_loss"]) < 1e-4 * abs(r["patched"]["ref_loss"])
    assert r["patched"]["active"] is (not r["upstream_has_fix"])  # detects the feature, not a version
    if not r["upstream_has_fix"]:
        # Without the patch the bug shows: full-length sequences per TP rank (a crash or a wrong size).
        unpatched = r["unpatched"]
        assert "error" in unpatched or unpatched["decoder_tokens"] != local, unpatched
    # padding_mask with a caller-supplied decoder_input: scattered once, never twice.
    assert r["mask_unpatched"] == (1, 2 * local)
    assert r["mask_patched"] == (1, local) and r["mask_already_local"] == (1, local)
    assert r["was_wrapped"] and r["restored"]
