"""Given [3, B, S] mRoPE positions that are 1D positions copied into the three channels (bug class 1).

A vision block with merged grid (t, h, w) gets, in every family's index (`rope.index_rules`, transformers'
`get_rope_index`, Qwen3-VL's one block per video frame, Qwen3-Omni's vision tokens alike): h = start + row,
w = start + column on each frame, from the block's start. So a block with more than one merged token in w has
a token (row 0, column 1) whose w position is one above its h position, and one with more than one in h a token
(row 1, column 0) whose h position is one above its w position. Correct positions of a sample holding such a
block can never be equal on all three channels at every real token; copied 1D positions always are. Only that is
refused: a 1x1-merged image (and a video of 1x1-merged frames, whose t steps depend on the family and its
seconds) has correct positions equal on all channels, as text and audio do.

The device half (`queue_flat_rows`) is one [B] reduction queued on the rows' one read; the host half
(`refuse_flat_rows`) walks each row's items with the grids and per-row counts that read brought back.

Shape legend: B = rows (samples: documents of a pre-packed row are rows here), S = row length.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_vlm_packing.packing.checks import DeferredChecks

_KINDS = (("image", "image_grid_thw", "images_per_sample"), ("video", "video_grid_thw", "videos_per_sample"))


def queue_flat_rows(positions: torch.Tensor, keep: torch.Tensor, checks: DeferredChecks) -> int:
    """Queue, per row, whether `positions` ([3, B, S]) hold t == h == w at every real token (`keep`, [B, S] bool)
    of it: [B] long, 1 = flat. Checked after the read by `refuse_flat_rows`. Returns the entry's index."""
    same = (positions[0] == positions[1]) & (positions[1] == positions[2])  # [B, S]
    return checks.add((same | ~keep).all(dim=1).long(), lambda _: False, None)


def multi_token_items(grid_rows: list[list[int]], merge: int) -> list[bool]:
    """For each [t, h, w] grid row: does its merged grid span more than one token in h or in w."""
    return [h // merge > 1 or w // merge > 1 for _, h, w in grid_rows]


def refuse_flat_rows(flat: list[int], vision, grid_values: dict, merge: int,
                     row_name: Callable[[int], str]) -> None:
    """Raise when a flat row (`flat[b]` 1, from `queue_flat_rows`) holds an image or video whose merged grid
    spans more than one token in h or w. Items are given to rows in order by the per-row counts of `vision`
    (`VisionInputs`); a kind whose counts are not known (no placeholder id) places none, and is refused only
    when every row is flat (the row holding the item is then flat too).

    Args:
        flat: B host ints. vision: the rows' `VisionInputs`, or None. grid_values: grid key -> its entries
            read in the one sync, flattened. merge: the spatial merge size. row_name: names a row.
    """
    if vision is None or not any(flat):
        return
    for kind, key, counts_name in _KINDS:
        if getattr(vision, key) is None:
            continue
        values = grid_values.get(key, [])
        rows = [values[i:i + 3] for i in range(0, len(values), 3)]
        multi = multi_token_items(rows, merge)
        counts = getattr(vision, counts_name)
        if counts is None:
            if all(flat) and any(multi):
                _raise(None, kind, key, multi.index(True), rows, merge, row_name)
            continue
        first = 0
        for row, count in enumerate(counts):
            hit = next((i for i in range(first, first + count) if multi[i]), None)
            if flat[row] and hit is not None:
                _raise(row, kind, key, hit, rows, merge, row_name)
            first += count


def _raise(row: int | None, kind: str, key: str, item: int, rows: list[list[int]], merge: int,
           row_name: Callable[[int], str]) -> None:
    t, h, w = rows[item]
    article = "an" if kind == "image" else "a"
    owner = "of every row are" if row is None else f"of {row_name(row)} are"
    where = "one of them holds" if row is None else "it holds"
    raise ValueError(
        f"position_ids {owner} equal on their three mRoPE channels (t, h, w) at every real token, but {where} "
        f"{kind} {item} of {key} [{t}, {h}, {w}] ({h // merge} x {w // merge} merged tokens per frame): these are "
        f"1D positions copied into three channels, and the {kind} would train without its positions. Correct "
        f"mRoPE positions of {article} {kind} token are the block's start on t (plus its frame's step) and "
        f"start + its row / column on h / w, so they differ inside every block wider or taller than one token. "
        f"Fix: drop position_ids from the batch and let the packer compute each sample's positions from the model's "
        f"config (the step does, from its MRopeConfig; pack_batch(mrope=MRopeConfig...)), or give each "
        f"sample's get_rope_index output")
