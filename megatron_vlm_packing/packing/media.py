"""Vision inputs of a collated batch, typed and counted per sample, and what every media kind shares.

Every image, video and audio clip belongs to the row whose placeholder tokens it fills, in token
order. The per-row counts are found by walking the items in order and giving each row exactly the
items whose placeholder tokens its real tokens hold: a row whose placeholders do not end exactly on
an item boundary (a placeholder moved to another sample, a grid that does not match) is a
ValueError naming the row and the numbers, never a silent re-assignment.

Placeholder ids come from `MediaTokens` (built from an `MRopeConfig`, or from explicit
`image_token_id=` / `video_token_id=` / `audio_token_id=` keywords of `pack_batch` / `pad_batch`).

Tokens per item:
- image / video with a grid (Qwen-VL style, [P, C] patches): t * h * w / spatial_merge_size**2;
- image without a grid (LLaVA style, [I, C, H, W] pixels): one placeholder per image (the model
  expands it);
- audio clip (Qwen3-Omni): the audio encoder's output length for the clip's real frames
  (`media_audio.py`, which builds on the shared pieces here: `MediaTokens`, `MediaHost`,
  `items_per_row`, `row_counts`, and the placeholder checks of `queue_media_reads`).

Shape legend: B = rows, S = row length, P = patches, I = images, V = videos.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_vlm_packing.packing.bounds import INT64_MAX, is_int
from megatron_vlm_packing.packing.micro_batch import VisionInputs

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class MediaTokens:
    """Placeholder ids and token arithmetic needed to count media per sample.

    Attributes:
        image_token_id, video_token_id, audio_token_id: placeholder ids (None = not known).
        spatial_merge_size: grid patches per side merged into one placeholder (2 in every Qwen-VL).
        audio_n_window: Qwen3-Omni audio encoder window (sets each clip's token count).
        require_counts: media whose placeholder id is not known are a ValueError (default); False
            leaves their per-sample counts None (for a caller whose model adapter checks media).
    """

    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None
    spatial_merge_size: int = 2
    audio_n_window: int = 50
    require_counts: bool = True

    def __post_init__(self) -> None:
        for name in ("image_token_id", "video_token_id", "audio_token_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= INT64_MAX):
                raise ValueError(f"{name} must be a non-negative int (at most 2**63 - 1: ids are int64) or None, "
                                 f"got {value!r}")
            object.__setattr__(self, name, None if value is None else int(value))  # a numpy int as its int
        for name in ("spatial_merge_size", "audio_n_window"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.require_counts, bool):  # "no" read as True
            raise ValueError(f"require_media_counts must be a bool, got {self.require_counts!r}")

    @classmethod
    def resolve(cls, mrope=None, *, image_token_id=None, video_token_id=None, audio_token_id=None,
                spatial_merge_size=None, audio_n_window=None, require_counts: bool = True) -> "MediaTokens":
        """Explicit keywords, else the values of an `MRopeConfig` given as `mrope`.

        Raises:
            ValueError: a keyword that contradicts the `MRopeConfig`.
        """
        explicit = (image_token_id, video_token_id, audio_token_id, spatial_merge_size, audio_n_window)
        if mrope is None and type(require_counts) is bool and all(v is None or type(v) is int for v in explicit):
            return _resolved(*explicit, require_counts)  # the same keywords every micro-batch: built once
        return cls._resolve(mrope, *explicit, require_counts)

    @classmethod
    def _resolve(cls, mrope, image_token_id, video_token_id, audio_token_id, spatial_merge_size, audio_n_window,
                 require_counts) -> "MediaTokens":
        explicit = dict(image_token_id=image_token_id, video_token_id=video_token_id, audio_token_id=audio_token_id,
                        spatial_merge_size=spatial_merge_size, audio_n_window=audio_n_window)
        from_config = {}
        if mrope is not None and not callable(mrope) and hasattr(mrope, "spatial_merge_size"):
            from_config = {name: getattr(mrope, name) for name in explicit}
        values = {}
        for name, chosen in given_or_config(explicit, from_config).items():
            # An integral float (8.0) is read as its int; 3.7, inf and nan are left for __post_init__ to name.
            integral = isinstance(chosen, int) or isinstance(chosen, float) and chosen.is_integer()
            values[name] = int(chosen) if integral and not isinstance(chosen, bool) else chosen
        return cls(**values, require_counts=require_counts)


def given_or_config(given: dict, from_config: dict, *, read: Callable | None = None, show: Callable = format,
                    why: str = "") -> dict:
    """Each name of `given`: its value when not None (the given value wins), else the mRoPE config's
    (`from_config`); names with neither are left out. `read(name, value)`: the given value as compared with the
    config's (e.g. checked to be an int first); `show`: how the error writes both values (`format`: as an
    f-string does); `why`: what a contradiction would break, for the error.

    Raises:
        ValueError: a given value that contradicts the config's (both not None and unequal).
    """
    chosen = {}
    for name, value in given.items():
        known = from_config.get(name)
        if value is not None and known is not None and (value if read is None else read(name, value)) != known:
            raise ValueError(f"{name}={show(value)} contradicts the mrope config's {name}={show(known)}{why}")
        if value is not None or known is not None:
            chosen[name] = value if value is not None else known
    return chosen


@functools.lru_cache(maxsize=64)
def _resolved(*keywords) -> MediaTokens:
    """`MediaTokens.resolve` of plain keywords (ints or None) without an mRoPE config, kept: a loader
    passes the same ones for every micro-batch. A bad value raises here and is not cached."""
    return MediaTokens._resolve(None, *keywords)


def _grid_rows(batch: dict, name: str, host: "MediaHost") -> tuple[torch.Tensor | None, list[list[int]]]:
    """(the [N, 3] grid or None, its rows as host ints read in the one sync); entries must be >= 1."""
    from megatron_vlm_packing.rope.index import check_grid_shape  # the one type/shape check of a grid

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
        from megatron_vlm_packing.rope.index import check_seconds_dtype  # the one dtype check of seconds

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
    from megatron_vlm_packing.rope.index import entry_count

    entries = entry_count(seconds)
    if entries:
        raise ValueError(f"second_per_grid_ts has {entries} entries but the batch has no videos")


def check_seconds_count(seconds: torch.Tensor, video_grid: torch.Tensor) -> None:
    """One `second_per_grid_ts` entry per `video_grid_thw` row ([V] and [V, 3]), whoever reads them."""
    if seconds.numel() != video_grid.shape[0]:
        raise ValueError(f"second_per_grid_ts has {seconds.numel()} entries but video_grid_thw has "
                         f"{video_grid.shape[0]} videos")
