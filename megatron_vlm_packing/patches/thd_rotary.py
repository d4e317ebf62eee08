"""Patch of `megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd`: THD
rotary with no host sync and no per-document loop.

Upstream (megatron-core 0.16.1 and 0.19.2, unfused rope) reads the boundaries back to the host
(`.tolist()`, then one `.item()` per document when the table holds every packed token) and builds
each document's CP rows in a Python loop, in every layer, for queries and keys (bug class 14):
with per-token mRoPE frequencies a packed step became slower than padding. The replacement:

- a `CpLocalFreqs` table (rows already this CP rank's tokens, from the packed mRoPE rotary) is
  applied as one elementwise rotation (upstream's own `_apply_rotary_pos_emb_bshd`);
- any other table (1D rope's `[max_seqlen]` table, or a whole-pack table) is gathered with
  `rope.megatron_thd.thd_rope_rows`, upstream's row rule computed on the device, then rotated the
  same way. Results equal upstream's bit for bit (the same rows, the same rotation).

Feature check, not a version string: the patch applies only while the installed function syncs
(`megatron_thd.thd_rope_host_syncs`, run with the sync counter); a function that raises on that
probe is a RuntimeError, not a count. Delete it once upstream's THD rope
is loop-free (no issue filed upstream yet; the loop is `_apply_rotary_pos_emb_thd`'s `for` over
`sequence_splits`). Fused rope (`apply_rope_fusion=True`) never reaches this function.

A replacement, not a wrapper: it never calls what it replaces. Applied over a wrapper another plugin put
on `rope_utils._apply_rotary_pos_emb_thd` (one that syncs: a sync-free one stands for the fix), it would drop
that wrapper silently, so apply refuses (RuntimeError naming it) unless Megatron's own function is there; a
wrapper put on after ours wraps ours and keeps running. Only holders still holding the function that
`rope_utils` held are replaced.
"""

from __future__ import annotations

import functools
import sys

import torch

from megatron_vlm_packing.patches.owned import (
    OwnedAttributes, patch_target, probe_failure, signature_naming, upstream_own,
)
from megatron_vlm_packing.rope.megatron_thd import CpLocalFreqs, thd_rope_host_syncs, thd_rope_rows

_OWNED = OwnedAttributes(__name__)  # the holders' _apply_rotary_pos_emb_thd; .original(): the unpatched one
# Modules that hold the function by name (rotary_pos_embedding imports it from rope_utils).
_HOLDERS = ("megatron.core.models.common.embeddings.rope_utils",
            "megatron.core.models.common.embeddings.rotary_pos_embedding")


def _rope_utils():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


def upstream_thd_rope_syncs() -> int:
    """Host syncs of one call of the installed (unpatched) THD rope on 3 documents at CP 2.

    Raises:
        RuntimeError: the function is gone, or it raised on the probe (named, with the exception).
    """
    return _host_syncs(_OWNED.original("_apply_rotary_pos_emb_thd") or _installed_thd_rope())


def _host_syncs(apply_thd) -> int:
    """`thd_rope_host_syncs(apply_thd)`; a failure is no count (0 would read as fixed): a RuntimeError."""
    try:
        return thd_rope_host_syncs(apply_thd)
    except Exception as err:
        raise probe_failure(apply_thd, err, __name__) from err


def _installed_thd_rope():
    return patch_target(_rope_utils(), "_apply_rotary_pos_emb_thd", __name__)


def _loop_free(original, apply_bshd):
    """A drop-in for `original` (same signature, every keyword passed on to `apply_bshd`)."""
    signature = signature_naming(original, ("t", "cu_seqlens", "freqs"), __name__)

    @functools.wraps(original)
    def apply_rotary_pos_emb_thd(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments
        t, cu_seqlens, freqs = call.pop("t"), call.pop("cu_seqlens"), call.pop("freqs")
        cp_group = call.pop("cp_group", None)
        if cp_group is None:
            raise ValueError("cp_group must be provided for THD format RoPE")
        if isinstance(freqs, CpLocalFreqs):
            freqs = freqs.as_subclass(torch.Tensor)
            if freqs.shape[0] != t.shape[0]:
                raise ValueError(f"a CP-local rotary table has {freqs.shape[0]} rows but this rank rotates "
                                 f"{t.shape[0]} tokens: the packed rotary needs full-length position_ids")
        else:
            rows = thd_rope_rows(cu_seqlens, cp_group.size(), cp_group.rank(), local_tokens=t.shape[0],
                                 table_rows=freqs.shape[0])
            freqs = freqs.index_select(0, rows)  # [Tl, 1, 1, D]
        return apply_bshd(t.unsqueeze(1), freqs, **call).squeeze(1)  # [Tl, H, D]

    apply_rotary_pos_emb_thd.loop_free_thd_rope = True
    return apply_rotary_pos_emb_thd


def thd_rotary_applied() -> bool:
    return _OWNED.active()


def apply_thd_rotary() -> bool:
    """Install the loop-free THD rope. Idempotent; returns whether it is active (False where the
    installed function already runs without host syncs).

    Raises:
        RuntimeError: the function is gone, raised on the sync probe, hides its arguments, or is not Megatron's
            own (another plugin's wrapper, which replacing would drop); nothing is applied.
    """
    if _OWNED.active():
        return True
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    rope_utils = _rope_utils()
    original = _installed_thd_rope()
    if _host_syncs(original) == 0:
        return False
    replacement = _loop_free(original, rope_utils._apply_rotary_pos_emb_bshd)
    upstream_own(rope_utils, "_apply_rotary_pos_emb_thd", "megatron.core", __name__)  # never drop a wrapper
    for name in _HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_apply_rotary_pos_emb_thd", None) is original:
            _OWNED.set(module, "_apply_rotary_pos_emb_thd", replacement)
    return True


def undo_thd_rotary() -> None:
    """Restore the original in every holder module. A no-op when not applied.

    Raises:
        RuntimeError: a later patch wraps one of the holders' functions; nothing is restored.
    """
    _OWNED.restore()
