"""Vision and audio inputs of a collated batch, typed and counted per sample.

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
- audio clip (Qwen3-Omni): the audio encoder's output length for the clip's real frames.

Shape legend: B = rows, S = row length, P = patches, I = images, V = videos, A = clips, F = mel
bins, L = frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.packing.micro_batch import AudioInputs, VisionInputs

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
AUDIO_KEYS = ("input_features", "feature_attention_mask")


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
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {value!r}")
        for name in ("spatial_merge_size", "audio_n_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @classmethod
    def resolve(cls, mrope=None, *, image_token_id=None, video_token_id=None, audio_token_id=None,
                spatial_merge_size=None, audio_n_window=None, require_counts: bool = True) -> "MediaTokens":
        """Explicit keywords, else the values of an `MRopeConfig` given as `mrope`.

        Raises:
            ValueError: a keyword that contradicts the `MRopeConfig`.
        """
        explicit = dict(image_token_id=image_token_id, video_token_id=video_token_id, audio_token_id=audio_token_id,
                        spatial_merge_size=spatial_merge_size, audio_n_window=audio_n_window)
        from_config = {}
        if mrope is not None and not callable(mrope) and hasattr(mrope, "spatial_merge_size"):
            from_config = {name: getattr(mrope, name) for name in explicit}
        values = {}
        for name, value in explicit.items():
            known = from_config.get(name)
            if value is not None and known is not None and value != known:
                raise ValueError(f"{name}={value} contradicts the mrope config's {name}={known}")
            chosen = value if value is not None else known
            if chosen is not None:
                values[name] = int(chosen) if isinstance(chosen, (int, float)) and not isinstance(chosen, bool) \
                    else chosen
        return cls(**values, require_counts=bool(require_counts))


def _long_grid(batch: dict, name: str) -> torch.Tensor | None:
    grid = batch.get(name)
    if grid is None:
        return None
    if not isinstance(grid, torch.Tensor):
        raise ValueError(f"{name} must be a [N, 3] integer tensor, got {type(grid).__name__}")
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() or grid.dtype == torch.bool:
        raise ValueError(f"{name} must be a [N, 3] integer tensor, got shape {tuple(grid.shape)} {grid.dtype}")
    if grid.numel() and bool((grid < 1).any()):
        bad = int(torch.nonzero((grid < 1).any(dim=1))[0])
        raise ValueError(f"{name} row {bad} is {grid[bad].tolist()}: every grid entry must be >= 1")
    return grid


def _tensor(batch: dict, name: str, dims: tuple[int, ...], what: str) -> torch.Tensor | None:
    value = batch.get(name)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dim() not in dims:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be {what}, got {got}")
    return value


def grid_tokens(grid: torch.Tensor, merge: int, name: str) -> list[int]:
    """Placeholder tokens of every grid row: t * h * w / merge**2 (h and w must divide by merge)."""
    rows = grid.tolist()
    for i, (t, h, w) in enumerate(rows):
        if h % merge or w % merge:
            raise ValueError(f"{name} row {i} is {[t, h, w]}: h and w must be multiples of spatial_merge_size={merge}")
    return [t * h * w // merge ** 2 for t, h, w in rows]


def items_per_row(row_tokens: list[int] | None, item_tokens: list[int], *, kind: str,
                  field: str) -> tuple[int, ...] | None:
    """How many items (in order) each row's placeholder tokens hold.

    Args:
        row_tokens: B placeholder-token counts (real tokens of each row).
        item_tokens: N placeholder tokens of each item, in token order across rows.
        kind: "image", "video" or "audio" (for the message); field: the batch key of the items.

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
                f"row {row} has {need} {kind} placeholder tokens, but the {kind}s of {field} in order give it "
                f"{have} ({len(used)} {kind}(s) {first}..{item - 1} with {used} tokens; {len(item_tokens)} in "
                f"all): a placeholder was moved to another sample, or a grid does not match its block"
            )
        counts.append(item - first)
    if item != len(item_tokens):
        raise ValueError(f"{field} has {len(item_tokens)} {kind}(s) but the rows' {kind} placeholders use only "
                         f"{item} ({sum(row_tokens)} placeholder tokens)")
    return tuple(counts)


def _row_counts(input_ids: torch.Tensor, keep: torch.Tensor, token_id: int | None, kind: str,
                field: str, require: bool) -> list[int] | None:
    """Placeholder tokens per row; None only when the id is not known and counts are not required.

    Raises:
        ValueError: media present, no placeholder id known and `require` (the default).
    """
    if token_id is None:
        if require:
            raise ValueError(f"the batch has {field} but no {kind}_token_id is known to count the {kind}s of each "
                             f"sample: pass {kind}_token_id= (or mrope=MRopeConfig(...)), or "
                             f"require_media_counts=False when a model adapter checks the media itself")
        return None
    return ((input_ids == token_id) & keep).sum(dim=1).tolist()


def vision_inputs(batch: dict, input_ids: torch.Tensor, keep: torch.Tensor, tokens: MediaTokens) -> VisionInputs | None:
    """The batch's images and videos with per-row counts; None when it has neither.

    Args:
        batch: the collated batch. input_ids: [B, S]; keep: [B, S] bool, True at real tokens.
    """
    pixels = _tensor(batch, "pixel_values", (2, 4), "[P, C] patches or [I, C, H, W] images")
    image_grid = _long_grid(batch, "image_grid_thw")
    videos = _tensor(batch, "pixel_values_videos", (2,), "[Pv, C] patches")
    video_grid = _long_grid(batch, "video_grid_thw")
    seconds = _tensor(batch, "second_per_grid_ts", (1,), "a [V] float tensor")
    if pixels is None and image_grid is not None and image_grid.shape[0]:
        raise ValueError(f"image_grid_thw has {image_grid.shape[0]} rows but the batch has no pixel_values")
    if videos is None and video_grid is not None and video_grid.shape[0]:
        raise ValueError(f"video_grid_thw has {video_grid.shape[0]} rows but the batch has no pixel_values_videos")
    if pixels is not None and pixels.shape[0] == 0:
        pixels = image_grid = None  # an empty image list (a batch without images) carries nothing
    if videos is not None and videos.shape[0] == 0:
        videos = video_grid = seconds = None
    if pixels is None and videos is None:
        if seconds is not None and seconds.numel():
            raise ValueError(f"second_per_grid_ts has {seconds.numel()} entries but the batch has no videos")
        return None
    images_per_row = videos_per_row = None
    if pixels is not None:
        images_per_row = _image_counts(pixels, image_grid, input_ids, keep, tokens)
    if videos is not None:
        videos_per_row = _video_counts(videos, video_grid, seconds, input_ids, keep, tokens)
    return VisionInputs(pixel_values=pixels, image_grid_thw=image_grid, images_per_sample=images_per_row,
                        pixel_values_videos=videos, video_grid_thw=video_grid if videos is not None else None,
                        second_per_grid_ts=seconds, videos_per_sample=videos_per_row)


def _image_counts(pixels, grid, input_ids, keep, tokens: MediaTokens) -> tuple[int, ...]:
    rows = _row_counts(input_ids, keep, tokens.image_token_id, "image", "pixel_values", tokens.require_counts)
    if pixels.dim() == 4:
        if grid is not None:
            raise ValueError(f"pixel_values is [I, C, H, W] = {tuple(pixels.shape)} (whole images) but "
                             f"image_grid_thw is given: grids go with [P, C] patches")
        return items_per_row(rows, [1] * pixels.shape[0], kind="image", field="pixel_values")
    if grid is None:
        raise ValueError(f"pixel_values is [P, C] = {tuple(pixels.shape)} patches but the batch has no "
                         f"image_grid_thw to say which patches form which image")
    patches = int(grid.prod(dim=1).sum())
    if patches != pixels.shape[0]:
        raise ValueError(f"image_grid_thw covers {patches} patches but pixel_values has {pixels.shape[0]}")
    return items_per_row(rows, grid_tokens(grid, tokens.spatial_merge_size, "image_grid_thw"),
                         kind="image", field="image_grid_thw")


def _video_counts(videos, grid, seconds, input_ids, keep, tokens: MediaTokens) -> tuple[int, ...]:
    rows = _row_counts(input_ids, keep, tokens.video_token_id, "video", "pixel_values_videos", tokens.require_counts)
    if grid is None:
        raise ValueError(f"pixel_values_videos is {tuple(videos.shape)} patches but the batch has no video_grid_thw")
    patches = int(grid.prod(dim=1).sum())
    if patches != videos.shape[0]:
        raise ValueError(f"video_grid_thw covers {patches} patches but pixel_values_videos has {videos.shape[0]}")
    if seconds is not None:
        if seconds.numel() != grid.shape[0]:
            raise ValueError(f"second_per_grid_ts has {seconds.numel()} entries but video_grid_thw has "
                             f"{grid.shape[0]} videos")
        if not bool(torch.isfinite(seconds.float()).all()) or bool((seconds < 0).any()):
            raise ValueError(f"second_per_grid_ts must be finite and >= 0, got {seconds.tolist()}")
    return items_per_row(rows, grid_tokens(grid, tokens.spatial_merge_size, "video_grid_thw"),
                         kind="video", field="video_grid_thw")


def audio_inputs(batch: dict, input_ids: torch.Tensor, keep: torch.Tensor, tokens: MediaTokens) -> AudioInputs | None:
    """The batch's audio clips with real frame counts and per-row counts; None without audio."""
    features = _tensor(batch, "input_features", (3,), "[A, F, L] mel features")
    mask = _tensor(batch, "feature_attention_mask", (2,), "an [A, L] 0/1 mask")
    if features is None and mask is None:
        return None
    if features is None or mask is None:
        missing = "feature_attention_mask" if features is not None else "input_features"
        raise ValueError(f"audio needs both input_features and feature_attention_mask; {missing} is missing")
    if tuple(mask.shape) != (features.shape[0], features.shape[2]):
        raise ValueError(f"feature_attention_mask is {tuple(mask.shape)} but input_features {tuple(features.shape)} "
                         f"needs [A, L] = [{features.shape[0]}, {features.shape[2]}]")
    if features.shape[0] == 0:
        return None
    from megatron_vlm_packing.packing.lengths import lengths_from_keep_mask
    from megatron_vlm_packing.rope.omni import audio_output_length

    frames = lengths_from_keep_mask(mask, field="feature_attention_mask")
    if min(frames) < 1:
        raise ValueError(f"feature_attention_mask gives clip {frames.index(min(frames))} no real frames")
    clip_tokens = audio_output_length(torch.tensor(frames), tokens.audio_n_window).tolist()
    rows = _row_counts(input_ids, keep, tokens.audio_token_id, "audio", "input_features", tokens.require_counts)
    per_row = items_per_row(rows, clip_tokens, kind="audio", field="feature_attention_mask")
    return AudioInputs(input_features=features, feature_attention_mask=mask, audio_lengths=tuple(frames),
                       audios_per_sample=per_row)
