"""Vision inputs of a collated batch, typed and counted per sample.

Every image and video belongs to the row whose placeholder tokens it fills, in token order; the
per-row counts come from the shared walk of `media_counts.items_per_row` over the values read in the
rows' one host sync (`media_counts.queue_media_reads`), so a placeholder moved to another sample or a
grid that does not match is a ValueError naming the row and the numbers, never a silent
re-assignment. Placeholder ids come from `media_tokens.MediaTokens` (built from an `MRopeConfig`, or
from explicit `image_token_id=` / `video_token_id=` keywords of `pack_batch` / `pad_batch`).

Tokens per item:
- image / video with a grid (Qwen-VL style, [P, C] patches): t * h * w / spatial_merge_size**2;
- image without a grid (LLaVA style, [I, C, H, W] pixels): one placeholder per image (the model
  expands it).
Audio clips (Qwen3-Omni) are counted in `media_audio.py`.

Shape legend: B = rows, S = row length, P = patches, I = images, V = videos.
"""

from __future__ import annotations

import math

import torch

from megatron_vlm_packing.packing.media_counts import MediaHost, items_per_row, row_counts
from megatron_vlm_packing.packing.media_counts import (  # noqa: F401 (importable from media, as before the split)
    checked_placeholders, never_fails, position_input, queue_media_reads, row_label,
)
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.media_tokens import given_or_config  # noqa: F401 (as above)
from megatron_vlm_packing.packing.micro_batch import VisionInputs

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def _grid_rows(batch: dict, name: str, host: MediaHost) -> tuple[torch.Tensor | None, list[list[int]]]:
    """(the [N, 3] grid or None, its rows as host ints read in the one sync); entries must be >= 1."""
    from megatron_vlm_packing.rope.index_checks import check_grid_shape  # the one type/shape check of a grid

    grid = check_grid_shape(batch.get(name), name)
    if grid is None:
        return None, []
    flat = host.values.get(name, [])
    rows = [flat[i:i + 3] for i in range(0, len(flat), 3)]
    bad = next((i for i, row in enumerate(rows) if min(row) < 1), None)
    if bad is not None:
        raise ValueError(f"{name} row {bad} is {rows[bad]}: every grid entry must be >= 1")
    return grid, rows


def media_tensor(batch: dict, name: str, dims: tuple[int, ...], what: str, *,
                 floating: str | None = None) -> torch.Tensor | None:
    """`batch[name]` (None when absent), a tensor of one of `dims` dimensions (`what` it must be, for the error);
    `floating`: the values a tower encodes (`check_floating_media`), when it must hold floating-point ones."""
    value = batch.get(name)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() not in dims:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be {what}, got {got}")
    if floating is not None:
        check_floating_media(value, name, floating)
    return value


def check_floating_media(values: torch.Tensor, name: str, what: str = "pixel values") -> None:
    """Media that a tower encodes (pixel values, mel features) are floating point: an integer, bool or complex
    tensor was cast by the tower (`.to(weight.dtype)`) without the processor's normalisation (uint8 pixels as
    0..255, True as 1.0) or without its imaginary part. Refused wherever media enter: the packers, the model
    adapters for micro-batches no packer made. Reads no values.

    Raises:
        ValueError: naming `name` (`what` it holds) and the dtype.
    """
    if not values.is_floating_point():
        raise ValueError(f"{name} must hold floating-point {what}, got dtype {values.dtype}: convert and "
                         f"normalise them as the tower expects before packing")


def grid_tokens(rows: list[list[int]], merge: int, name: str) -> list[int]:
    """Placeholder tokens of every grid row (host ints): t * h * w / merge**2 (h and w must divide by merge)."""
    for i, (t, h, w) in enumerate(rows):
        if h % merge or w % merge:
            raise ValueError(f"{name} row {i} is {[t, h, w]}: h and w must be multiples of spatial_merge_size={merge}")
    return [t * h * w // merge ** 2 for t, h, w in rows]



def vision_inputs(batch: dict, host: MediaHost, tokens: MediaTokens, *,
                  grids_for_rope: bool = False, count_grids: bool = False) -> VisionInputs | None:
    """The batch's images and videos with per-row counts; None when it has neither.

    Args:
        batch: the collated batch. host: its media values, read with the rows (`queue_media_reads`).
        grids_for_rope: an mRoPE index reads the grids (`mrope=`): grids without pixels are then
            position inputs only (a text model with mRoPE), checked block by block by the index.
        count_grids: the grids are read by a position callable, which may check nothing (the HF model's
            takes the grid of each block in order): grids without pixels are counted per row like items
            (`items_per_row`), where their placeholder id is known (`queue_media_reads(count_grids=True)`).
    """
    if batch.keys().isdisjoint(VISION_KEYS):
        return None
    pixels = media_tensor(batch, "pixel_values", (2, 4), "[P, C] patches or [I, C, H, W] images",
                          floating="pixel values")
    image_grid, image_rows = _grid_rows(batch, "image_grid_thw", host)
    videos = media_tensor(batch, "pixel_values_videos", (2,), "[Pv, C] patches", floating="pixel values")
    video_grid, video_rows = _grid_rows(batch, "video_grid_thw", host)
    seconds = media_tensor(batch, "second_per_grid_ts", (1,), "a [V] float tensor")
    if pixels is None and image_grid is not None and image_grid.shape[0] and not grids_for_rope:
        raise ValueError(f"image_grid_thw has {image_grid.shape[0]} rows but the batch has no pixel_values "
                         f"(grids alone are read only by an mRoPE index: pass mrope=)")
    if videos is None and video_grid is not None and video_grid.shape[0] and not grids_for_rope:
        raise ValueError(f"video_grid_thw has {video_grid.shape[0]} rows but the batch has no pixel_values_videos "
                         f"(grids alone are read only by an mRoPE index: pass mrope=)")
    if seconds is not None:
        from megatron_vlm_packing.rope.index_checks import check_seconds_dtype  # the one dtype check of seconds

        check_seconds_dtype(seconds)
        # Checked whatever reads them (the videos' tower, an MRopeConfig's index, or a position callable, which
        # checks nothing: only beside video pixels, a grids-only batch handed NaN or negative seconds to it).
        values = host.values.get("second_per_grid_ts", [])
        if not all(math.isfinite(x) and x >= 0 for x in values):
            raise ValueError(f"second_per_grid_ts must be finite and >= 0, got {values}")
    if pixels is not None and pixels.shape[0] == 0:
        pixels = image_grid = None  # an empty image list (a batch without images) carries nothing
    if videos is not None and videos.shape[0] == 0:
        videos = video_grid = seconds = None
    # Seconds beside no video at all (no pixels, no grid rows an mRoPE index reads) are read by nothing: with
    # images they travelled to the model beside no video, with mrope= they were dropped without a word.
    if videos is None and (video_grid is None or not video_grid.shape[0]):
        refuse_seconds_without_videos(seconds)
    # One entry per video whoever reads them: beside pixels `_video_counts` counts them; grids alone went to the
    # mRoPE index or position callable uncounted (a callable checks nothing).
    if seconds is not None and videos is None and video_grid is not None and video_grid.shape[0]:
        check_seconds_count(seconds, video_grid)
    if count_grids:
        _count_position_grids(host, tokens, image_rows if pixels is None else [], video_rows if videos is None else [])
    if pixels is None and videos is None:
        return None
    images_per_row = videos_per_row = None
    if pixels is not None:
        images_per_row = _image_counts(pixels, image_grid, image_rows, host, tokens)
    if videos is not None:
        videos_per_row = _video_counts(videos, video_grid, video_rows, seconds, host, tokens)
    return VisionInputs(pixel_values=pixels, image_grid_thw=image_grid, images_per_sample=images_per_row,
                        pixel_values_videos=videos, video_grid_thw=video_grid if videos is not None else None,
                        second_per_grid_ts=seconds, videos_per_sample=videos_per_row,
                        spatial_merge_size=tokens.spatial_merge_size)


def _count_position_grids(host: MediaHost, tokens: MediaTokens, image_rows: list[list[int]],
                          video_rows: list[list[int]]) -> None:
    """Grid rows read only by a position callable (no pixels) must fill each row's placeholders in order, as
    items do (`items_per_row`): a grid in the wrong row or a block cut by the mask reached the callable, whose
    error (a shape mismatch) or positions (of the wrong grids) came back. Kinds whose id is not known are left
    to the callable."""
    for kind, rows, field in (("image", image_rows, "image_grid_thw"), ("video", video_rows, "video_grid_thw")):
        if rows and kind in host.values:
            items_per_row(host.values[kind], grid_tokens(rows, tokens.spatial_merge_size, field), kind=kind,
                          field=field, row_name=host.row_name)


def _image_counts(pixels, grid, grid_rows, host: MediaHost, tokens: MediaTokens) -> tuple[int, ...]:
    rows = row_counts(host, tokens.image_token_id, "image", "pixel_values", tokens.require_counts)
    if pixels.dim() == 4:
        if grid is not None:
            raise ValueError(f"pixel_values is [I, C, H, W] = {tuple(pixels.shape)} (whole images) but "
                             f"image_grid_thw is given: grids go with [P, C] patches")
        return items_per_row(rows, [1] * pixels.shape[0], kind="image", field="pixel_values", row_name=host.row_name)
    if grid is None:
        raise ValueError(f"pixel_values is [P, C] = {tuple(pixels.shape)} patches but the batch has no "
                         f"image_grid_thw to say which patches form which image")
    patches = sum(t * h * w for t, h, w in grid_rows)
    if patches != pixels.shape[0]:
        raise ValueError(f"image_grid_thw covers {patches} patches but pixel_values has {pixels.shape[0]}")
    return items_per_row(rows, grid_tokens(grid_rows, tokens.spatial_merge_size, "image_grid_thw"),
                         kind="image", field="image_grid_thw", row_name=host.row_name)


def _video_counts(videos, grid, grid_rows, seconds, host: MediaHost, tokens: MediaTokens) -> tuple[int, ...]:
    rows = row_counts(host, tokens.video_token_id, "video", "pixel_values_videos", tokens.require_counts)
    if grid is None:
        raise ValueError(f"pixel_values_videos is {tuple(videos.shape)} patches but the batch has no video_grid_thw")
    patches = sum(t * h * w for t, h, w in grid_rows)
    if patches != videos.shape[0]:
        raise ValueError(f"video_grid_thw covers {patches} patches but pixel_values_videos has {videos.shape[0]}")
    if seconds is not None:
        check_seconds_count(seconds, grid)
    return items_per_row(rows, grid_tokens(grid_rows, tokens.spatial_merge_size, "video_grid_thw"),
                         kind="video", field="video_grid_thw", row_name=host.row_name)


def refuse_seconds_without_videos(seconds) -> None:
    """Seconds per grid step, with entries, where the batch has no video (no pixels, no grid rows an mRoPE index
    reads) are read by nothing: the one rule of packing and of the adapters' checks of micro-batches no packer
    checked (`bridge.adapters`). Reads no values.

    Raises:
        ValueError: naming the field and its entries.
    """
    from megatron_vlm_packing.rope.index_checks import entry_count

    entries = entry_count(seconds)
    if entries:
        raise ValueError(f"second_per_grid_ts has {entries} entries but the batch has no videos")


def check_seconds_count(seconds: torch.Tensor, video_grid: torch.Tensor) -> None:
    """One `second_per_grid_ts` entry per `video_grid_thw` row ([V] and [V, 3]), whoever reads them."""
    if seconds.numel() != video_grid.shape[0]:
        raise ValueError(f"second_per_grid_ts has {seconds.numel()} entries but video_grid_thw has "
                         f"{video_grid.shape[0]} videos")
