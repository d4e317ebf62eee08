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


def test_padding_mask_patch_detects_the_defect_not_a_version(monkeypatch):
    """The installed megatron-core leaves padding_mask alone when decoder_input is given (the SP test
    above sees it full length), so the patch applies; a GPTModel whose decoder_input branch handles the
    mask itself makes it stand down, and so does not install."""
    from megatron_vlm_packing.patches import gpt_model_forward as patch

    assert patch.upstream_scatters_mask_with_decoder_input() is False

    class FixedUpstream:
        def _preprocess(self, input_ids, decoder_input=None, padding_mask=None):
            if decoder_input is not None:
                if padding_mask is not None and self.config.sequence_parallel:
                    padding_mask = scatter(padding_mask)  # noqa: F821 (read as source, never run)
            return decoder_input, padding_mask

        def forward(self, *args, **kwargs):
            return self._preprocess(*args, **kwargs)

    class UntouchedUpstream(FixedUpstream):
        def _preprocess(self, input_ids, decoder_input=None, padding_mask=None):
            if decoder_input is not None:
                pass
            elif padding_mask is not None:
                padding_mask = padding_mask[:, :1]
            return decoder_input, padding_mask

    monkeypatch.setattr(patch, "_gpt_model", lambda: FixedUpstream)
    assert patch.upstream_scatters_mask_with_decoder_input() is True
    assert patch.apply_sp_padding_mask_scatter() is False
    assert "padding_mask" not in patch._APPLIED and FixedUpstream.forward.__name__ == "forward" \
        and not hasattr(FixedUpstream.forward, "__wrapped__")
    monkeypatch.setattr(patch, "_gpt_model", lambda: UntouchedUpstream)
    assert patch.upstream_scatters_mask_with_decoder_input() is False  # a mask read only on the other branch
