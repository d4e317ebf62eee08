"""Per-row media counting every kind shares, and the placeholder reads that ride the rows' one host sync.

Every image, video and audio clip belongs to the row whose placeholder tokens it fills, in token
order. `queue_media_reads` queues the device values the counts need (placeholder tokens per row,
the exact count of a placeholder whose items are absent, grid entries, seconds per grid) on the
rows' `DeferredChecks`, so they come back in its one read as a `MediaHost`; `items_per_row` then
walks the items in order, giving each row exactly the items its placeholder tokens hold: a row whose
placeholders do not end on an item boundary is a ValueError naming the row and the numbers, never a
silent re-assignment. A module of its own because the vision inputs (`media.py`) and the audio clips
(`media_audio.py`) both count this way.

Shape legend: B = rows, S = row length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_vlm_packing.packing.media_tokens import MediaTokens


def row_label(row: int) -> str:
    """How an error names a row of the batch as given (`documents.DocumentPlaces.row_name` names a
    document split from a pre-packed row)."""
    return f"row {row}"


def items_per_row(row_tokens: list[int] | None, item_tokens: list[int], *, kind: str,
                  field: str, row_name: Callable[[int], str] = row_label) -> tuple[int, ...] | None:
    """How many items (in order) each row's placeholder tokens hold.

    Args:
        row_tokens: B placeholder-token counts (real tokens of each row).
        item_tokens: N placeholder tokens of each item, in token order across rows.
        kind: "image", "video" or "audio" (for the message); field: the batch key of the items.
        row_name: names a row in the message.

    Raises:
        ValueError: a row whose placeholders do not end on an item boundary, or items left over.

    Returns:
        B counts, or None when `row_tokens` is None (the placeholder id is not known).
    """
    if row_tokens is None:
        return None
    counts, item = [], 0
    for row, need in enumerate(row_tokens):
        have, first = 0, item
        while have < need and item < len(item_tokens):
            have += item_tokens[item]
            item += 1
        if have != need:
            used = item_tokens[first:item]
            raise ValueError(
                f"{row_name(row)} has {need} {kind} placeholder tokens, but the {kind}s of {field} in order give it "
                f"{have} ({len(used)} {kind}(s) {first}..{item - 1} with {used} tokens; {len(item_tokens)} in "
                f"all): a placeholder was moved to another sample, or a grid does not match its block"
            )
        counts.append(item - first)
    if item != len(item_tokens):
        raise ValueError(f"{field} has {len(item_tokens)} {kind}(s) but the rows' {kind} placeholders use only "
                         f"{item} ({sum(row_tokens)} placeholder tokens)")
    return tuple(counts)


@dataclass(frozen=True)
class MediaHost:
    """The media values read back in the rows' one host sync (`queue_media_reads`,
    `media_audio.queue_audio_reads`), by name: per-row placeholder counts ("image", "video", "audio"),
    grid entries (flattened), seconds per grid, "audio_seqlens", and "audio_frames" (clip frame counts,
    minima and first minima of the feature mask). `row_name`
    names a row in errors (a document of a pre-packed row, `documents.DocumentPlaces.row_name`)."""

    values: dict
    row_name: Callable[[int], str] = row_label


_PLACEHOLDERS = (("image", "pixel_values", "image_token_id"), ("video", "pixel_values_videos", "video_token_id"),
                 ("audio", "input_features", "audio_token_id"))
# Inputs that make a kind's placeholders legitimate without its items: position inputs of an mRoPE
# text model (grids; audio_seqlens), which the positions' own checks read.
_POSITION_ONLY = {"image": ("image_grid_thw",), "video": ("video_grid_thw",), "audio": ("audio_seqlens",)}


def _given(value) -> bool:
    """A tensor with at least one item (an empty media list carries nothing)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] > 0


def position_input(value) -> bool:
    """A position-only input with entries (a tensor or a list: the positions' checks read it)."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    return value is not None and (not hasattr(value, "__len__") or len(value) > 0)


def checked_placeholders(batch, tokens: MediaTokens) -> tuple[tuple[str, int], ...]:
    """(kind, placeholder id) of every kind whose placeholders `queue_media_reads` checks in the one
    read: a kind with items is counted per row against them, a kind without items or position-only
    inputs must have no placeholder among the real tokens. Kinds whose id is not known are left out."""
    if tokens.image_token_id is None and tokens.video_token_id is None and tokens.audio_token_id is None:
        return ()
    checked = []
    for kind, key, id_name in _PLACEHOLDERS:
        token_id = getattr(tokens, id_name)
        if token_id is not None and (_given(batch.get(key))
                                     or not any(position_input(batch.get(k)) for k in _POSITION_ONLY[kind])):
            checked.append((kind, token_id))
    return tuple(checked)


def _queue_orphan_check(input_ids, keep, kind: str, field: str, token_id: int, checks,
                        row_name: Callable[[int], str]) -> None:
    """Queue the exact count of `token_id` among the real tokens ([B, S] `keep()`); nonzero raises."""
    def refuse():
        per_row = ((input_ids == token_id) & keep()).sum(dim=1).tolist()  # the error path: a read is fine
        rows = [row for row, count in enumerate(per_row) if count]
        where = f"rows {rows}" if row_name is row_label else ", ".join(row_name(row) for row in rows)
        raise ValueError(f"input_ids hold {sum(per_row)} {kind} placeholder tokens (id {token_id}) in {where} "
                         f"but the batch has no {field}")

    checks.add(((input_ids == token_id) & keep()).sum(), lambda values: values[0] != 0, refuse)


def queue_media_reads(batch: dict, input_ids: torch.Tensor, keep, tokens: MediaTokens, checks,
                      row_name: Callable[[int], str] = row_label, *, count_grids: bool = False) -> dict:
    """Queue on `checks` (a `rows.DeferredChecks`) the device values the media need, so that they ride
    the rows' one host read: placeholder tokens per row of each kind present whose id is known
    (`keep()`: the [B, S] keep-mask), the exact count of a known placeholder among the real tokens
    of each kind absent (`checked_placeholders`; nonzero is a ValueError), grid entries and seconds
    per grid. The audio values are queued by `media_audio.queue_audio_reads`. Returns name -> entry.

    `count_grids` (a position callable's batch, `vision_inputs`): the placeholder tokens per row of an image or
    video kind with grid rows but no pixels are queued too, to count the grids per row.
    """
    placeholders = checked_placeholders(batch, tokens)
    if not placeholders and batch.keys().isdisjoint(_READ_KEYS):
        return {}
    entries = {}
    for kind, token_id in placeholders:
        key = next(key for name, key, _ in _PLACEHOLDERS if name == kind)
        if _given(batch.get(key)):
            entries[kind] = checks.add(((input_ids == token_id) & keep()).sum(dim=1), never_fails, None)
        else:
            _queue_orphan_check(input_ids, keep, kind, key, token_id, checks, row_name)
    if count_grids:
        for kind, grid_key in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
            token_id = getattr(tokens, f"{kind}_token_id")
            if kind not in entries and token_id is not None and _given(batch.get(grid_key)):
                entries[kind] = checks.add(((input_ids == token_id) & keep()).sum(dim=1), never_fails, None)
    for name in ("image_grid_thw", "video_grid_thw"):
        grid = batch.get(name)
        if isinstance(grid, torch.Tensor) and grid.dim() == 2 and grid.numel() and not grid.is_floating_point():
            entries[name] = checks.add(grid.to(input_ids.device, torch.long).reshape(-1), never_fails, None)
    seconds = batch.get("second_per_grid_ts")
    if isinstance(seconds, torch.Tensor) and seconds.numel() and not seconds.is_complex():
        entries["second_per_grid_ts"] = checks.add(seconds.to(input_ids.device, torch.float64).reshape(-1),
                                                   never_fails, None)
    return entries


# The batch keys `queue_media_reads` reads values of (besides placeholder counts).
_READ_KEYS = frozenset({"image_grid_thw", "video_grid_thw", "second_per_grid_ts"})


def never_fails(values: list) -> bool:
    """The host test of a value queued only to be read (no check of its own)."""
    return False


def row_counts(host: MediaHost, token_id: int | None, kind: str, field: str, require: bool) -> list[int] | None:
    """Placeholder tokens per row (read in the one sync); None only when the id is not known and
    counts are not required.

    Raises:
        ValueError: media present, no placeholder id known and `require` (the default).
    """
    if token_id is None:
        if require:
            raise ValueError(f"the batch has {field} but no {kind}_token_id is known to count the {kind}s of each "
                             f"sample: pass {kind}_token_id= (or mrope=MRopeConfig(...)), or "
                             f"require_media_counts=False when a model adapter checks the media itself")
        return None
    return host.values[kind]
