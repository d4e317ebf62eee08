"""Each sample of a collated batch alone, with exactly its own inputs: what the parity probe
(`probe.parity_probe`) runs beside the pack.

Every input the packers take (docs/batch_format.md) is split, none dropped:
- token rows ([B, S]: ids, labels, loss mask, 2D mask, 1D positions, `mm_token_type_ids`, declared
  `extra_keys` [B, S, ...]) cut to the sample's n real tokens; a 4D mask to [1, 1, n, n]; `seq_lens` to
  [n]; [3, B, S] / [B, 3, S] mRoPE positions to the sample's own [3, 1, n];
- pre-packed rows (`document_lengths`): every document a sample of its own
  (`packing.documents.split_documents`, the packers' own split);
- images, videos (with `second_per_grid_ts`) and audio clips (with `feature_attention_mask` and
  `audio_seqlens`), grids or raw lengths given for the mRoPE index alone included: each sample gets the
  items its placeholders take, by the packer's per-sample counts (a `MicroBatch`'s
  `vision.images_per_sample` / `videos_per_sample`, `audio.audios_per_sample`), else counted by the
  packers' rule (`packing.media.items_per_row` over each sample's placeholder tokens);
- `use_audio_in_video` (one flag for the batch) goes to every sample.
Any other key is a ValueError naming it.

Shape legend: B = rows, S = row length, n = one sample's real tokens, P = patches, I = items of a kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.packing.documents import DOCUMENT_KEY, split_documents
from megatron_vlm_packing.packing.lengths import real_lengths
from megatron_vlm_packing.packing.media import MediaTokens, grid_tokens, items_per_row, row_label
from megatron_vlm_packing.packing.positions import normalize_positions

_TOKEN_ROWS = ("input_ids", "tokens", "labels", "loss_mask", "mm_token_type_ids")
_SAMPLE_KEYS = ("attention_mask", "seq_lens", "position_ids", DOCUMENT_KEY)
_BATCH_FLAGS = ("use_audio_in_video",)


@dataclass(frozen=True)
class MediaKind:
    """One kind of media item and the batch keys that describe its items.

    Attributes:
        name: "image", "video" or "audio" (its placeholder id is `<name>_token_id`).
        items: the key of the items themselves ([P, C] patches with a grid, else one entry per item).
        grid: the [I, 3] grid key, or None (audio).
        per_item: keys with one entry per item (tensors or lists).
    """

    name: str
    items: str
    grid: str | None
    per_item: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.items,) + ((self.grid,) if self.grid else ()) + self.per_item


KINDS = (MediaKind("image", "pixel_values", "image_grid_thw"),
         MediaKind("video", "pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",)),
         MediaKind("audio", "input_features", None, ("feature_attention_mask", "audio_seqlens")))


@dataclass(frozen=True)
class SampleMedia:
    """How a batch's media items are given to its samples.

    Attributes:
        tokens: placeholder ids, merge size and audio window, to count items where no count is given.
        counts: kind name -> items of each sample (in sample order), as the packer counted them.
    """

    tokens: MediaTokens = MediaTokens(require_counts=False)
    counts: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @classmethod
    def of(cls, micro_batch, tokens: MediaTokens | None = None) -> "SampleMedia":
        """The counts `micro_batch` (a `MicroBatch` packed from the batch) carries; ids from `tokens`, else
        from its mRoPE config, else the placeholders its packer checked."""
        vision, audio = getattr(micro_batch, "vision", None), getattr(micro_batch, "audio", None)
        counts = (("image", getattr(vision, "images_per_sample", None)),
                  ("video", getattr(vision, "videos_per_sample", None)),
                  ("audio", getattr(audio, "audios_per_sample", None)))
        return cls(_known_tokens(micro_batch, tokens or MediaTokens(require_counts=False)),
                   tuple((kind, tuple(n)) for kind, n in counts if n is not None))

    def count(self, kind: str) -> tuple[int, ...] | None:
        return dict(self.counts).get(kind)


def _known_tokens(micro_batch, tokens: MediaTokens) -> MediaTokens:
    """`tokens` with each unknown id (and the merge size / audio window) filled from the micro-batch."""
    config = getattr(micro_batch, "mrope_config", None)
    checked = dict(getattr(micro_batch, "placeholders_checked", ()) or ())
    ids = {}
    for kind in ("image", "video", "audio"):
        name = f"{kind}_token_id"
        ids[name] = next((v for v in (getattr(tokens, name), getattr(config, name, None), checked.get(kind))
                          if v is not None), None)
    merge = getattr(getattr(micro_batch, "vision", None), "spatial_merge_size", None)
    merge = merge or getattr(config, "spatial_merge_size", None) or tokens.spatial_merge_size
    window = getattr(config, "audio_n_window", None) or tokens.audio_n_window
    return MediaTokens(**ids, spatial_merge_size=merge, audio_n_window=window, require_counts=False)


def split_rows(batch: dict, *, media: SampleMedia | None = None, extra_keys: tuple[str, ...] = (),
               position_layout: str | None = None, image_token_id: int | None = None,
               spatial_merge_size: int | None = None, images_per_row=None) -> list[tuple[int, dict]]:
    """Every non-empty sample alone: (its row in `batch`, a batch of one row cut to its n real tokens, with
    exactly its own media, per-row fields and mRoPE inputs). A row of `document_lengths` gives one per document.

    Args:
        media: how items go to samples (`SampleMedia.of(pack(batch))`); `image_token_id`, `spatial_merge_size`
            and `images_per_row` (a `MicroBatch`'s `vision.images_per_sample`) are the older spelling.
        extra_keys: the declared per-token keys ([B, S, ...]) the pack carries in `extras`.
        position_layout: "3BS" / "B3S", for 3D `position_ids` of a batch of 3 rows (as `pack_batch`).

    Raises:
        ValueError: a key the probe cannot split per sample (naming it), or items of a kind without
        per-sample counts and no placeholder id to count them with (naming the key and the id).
    """
    media = _with_legacy(media or SampleMedia(), image_token_id, spatial_merge_size, images_per_row)
    unknown = sorted(k for k, v in batch.items() if v is not None and not _splittable(k, extra_keys))
    if unknown:
        raise ValueError(f"the parity probe cannot split {unknown} per sample (it splits token rows, pre-packed "
                         f"documents, mRoPE inputs, images, videos and audio clips, and the declared extra_keys "
                         f"{list(extra_keys)}): give it a batch the packers take")
    batch, lengths, sources, row_name = _sample_rows(batch, extra_keys, position_layout)
    ids = batch["input_ids"] if batch.get("input_ids") is not None else batch["tokens"]
    ranges = {kind.name: _item_ranges(kind, batch, ids, lengths, media, row_name) for kind in KINDS}
    samples = []
    for b, n in enumerate(lengths):
        one = _row_fields(batch, b, n, extra_keys)
        for kind in KINDS:
            if ranges[kind.name] is not None:
                one.update(_items_of(kind, batch, *ranges[kind.name][b]))
        if n:
            samples.append((sources[b], one))
    return samples


def _splittable(key: str, extra_keys: tuple[str, ...]) -> bool:
    return key in _TOKEN_ROWS + _SAMPLE_KEYS + _BATCH_FLAGS or key in extra_keys \
        or any(key in kind.keys for kind in KINDS)


def _with_legacy(media: SampleMedia, image_token_id, spatial_merge_size, images_per_row) -> SampleMedia:
    """`media` with the older keywords folded in (they win: they are the caller's own)."""
    tokens = media.tokens
    if image_token_id is not None or spatial_merge_size is not None:
        tokens = MediaTokens(image_token_id=tokens.image_token_id if image_token_id is None else image_token_id,
                             video_token_id=tokens.video_token_id, audio_token_id=tokens.audio_token_id,
                             spatial_merge_size=spatial_merge_size or tokens.spatial_merge_size,
                             audio_n_window=tokens.audio_n_window, require_counts=False)
    counts = dict(media.counts)
    if images_per_row is not None:
        counts["image"] = tuple(int(n) for n in images_per_row)
    return SampleMedia(tokens, tuple(counts.items()))


def _sample_rows(batch: dict, extra_keys: tuple[str, ...], position_layout: str | None):
    """(batch of one row per sample, real lengths, each sample's source row, how errors name a sample):
    3D positions as [3, B, S], pre-packed rows split into their documents as the packers split them."""
    key = "input_ids" if batch.get("input_ids") is not None else "tokens"
    batch = normalize_positions(batch, tuple(batch[key].shape), position_layout)
    sources, row_name = list(range(batch[key].shape[0])), row_label
    if batch.get(DOCUMENT_KEY) is not None:
        batch, places = split_documents(batch, key, extra_keys)
        sources, row_name = list(places.rows), places.row_name
    ids = batch[key]
    lengths = real_lengths(batch_size=ids.shape[0], row_length=ids.shape[1], attention_mask=batch.get("attention_mask"),
                           seq_lens=batch.get("seq_lens"))
    return batch, lengths, sources, row_name


def _row_fields(batch: dict, b: int, n: int, extra_keys: tuple[str, ...]) -> dict:
    """Sample `b`'s token rows, mask, lengths, positions and batch flags, cut to its n real tokens."""
    one = {k: batch[k][b:b + 1, :n] for k in _TOKEN_ROWS + tuple(extra_keys) if batch.get(k) is not None}
    mask = batch.get("attention_mask")
    if mask is not None:
        one["attention_mask"] = mask[b:b + 1, :, :n, :n] if mask.dim() == 4 else mask[b:b + 1, :n]
    seq_lens = batch.get("seq_lens")
    if seq_lens is not None:
        one["seq_lens"] = torch.tensor([n], dtype=seq_lens.dtype, device=seq_lens.device) \
            if isinstance(seq_lens, torch.Tensor) else [n]
    positions = batch.get("position_ids")
    if positions is not None:
        one["position_ids"] = positions[b:b + 1, :n] if positions.dim() == 2 else positions[:, b:b + 1, :n]
    one.update({k: batch[k] for k in _BATCH_FLAGS if batch.get(k) is not None})
    return one


def _entries(value) -> int:
    """Items a per-item key describes: rows of a tensor, entries of a list."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else 1
    return len(value)


def _item_count(kind: MediaKind, batch: dict) -> int:
    """Items of `kind` in the batch: grid rows, else per-item entries, else items (none: 0)."""
    for key in ((kind.grid,) if kind.grid else ()) + kind.per_item + (kind.items,):
        if batch.get(key) is not None:
            return _entries(batch[key])
    return 0


def _item_ranges(kind: MediaKind, batch: dict, ids: torch.Tensor, lengths: list[int], media: SampleMedia,
                 row_name) -> list[tuple[int, int]] | None:
    """[start, stop) of each sample's items of `kind`; None when the batch has none."""
    total = _item_count(kind, batch)
    if not total:
        return None
    counts = media.count(kind.name)
    if counts is None:
        counts = _counted(kind, batch, ids, lengths, media.tokens, row_name)
    if len(counts) != len(lengths) or sum(counts) != total:
        raise ValueError(f"the per-sample {kind.name} counts {list(counts)} do not give {len(lengths)} samples the "
                         f"{total} {kind.name}(s) of {kind.grid or kind.items}")
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def _counted(kind: MediaKind, batch: dict, ids: torch.Tensor, lengths: list[int], tokens: MediaTokens,
             row_name) -> tuple[int, ...]:
    """Items of `kind` per sample by the packers' rule: each sample's placeholders take the next items."""
    token_id = getattr(tokens, f"{kind.name}_token_id")
    field = kind.grid if batch.get(kind.grid or "") is not None else next(
        k for k in kind.per_item + (kind.items,) if batch.get(k) is not None)
    if token_id is None:
        raise ValueError(f"the parity probe cannot give {field}'s {kind.name}s to their samples: no per-sample "
                         f"counts and no {kind.name}_token_id to count them (give {kind.name}_token_id=, or an "
                         f"MRopeConfig as mrope=)")
    rows = [int((ids[b, :n] == token_id).sum()) for b, n in enumerate(lengths)]
    return items_per_row(rows, _item_tokens(kind, batch, field, tokens), kind=kind.name, field=field,
                         row_name=row_name)


def _item_tokens(kind: MediaKind, batch: dict, field: str, tokens: MediaTokens) -> list[int]:
    """Placeholder tokens of each item: a grid's t*h*w / merge**2, a clip's encoder output length, else one."""
    if kind.grid is not None and field == kind.grid:
        return grid_tokens(batch[kind.grid].long().tolist(), tokens.spatial_merge_size, kind.grid)
    if kind.name == "audio":
        from megatron_vlm_packing.rope.omni import audio_tokens_per_clip

        mask = batch.get("feature_attention_mask")
        raw = mask.long().sum(dim=-1).tolist() if mask is not None else [int(n) for n in batch["audio_seqlens"]]
        clips = audio_tokens_per_clip(raw, tokens.audio_n_window)
        if clips.empty:
            raise ValueError(f"{field} gives audio clip {clips.empty[0]} no real frames")
        return clips.tokens
    return [1] * _entries(batch[field])  # whole images without a grid: one placeholder each


def _items_of(kind: MediaKind, batch: dict, start: int, stop: int) -> dict:
    """The keys of `kind` holding items [start, stop) only; {} for a sample without any."""
    if stop == start:
        return {}
    one = {key: batch[key][start:stop] for key in kind.per_item if batch.get(key) is not None}
    grid, items = batch.get(kind.grid or ""), batch.get(kind.items)
    if grid is not None:
        one[kind.grid] = grid[start:stop]
    if items is not None and grid is not None and items.dim() == 2:  # [P, C] patches: t*h*w rows per item
        patches = grid.long().prod(dim=1)
        first = int(patches[:start].sum())
        one[kind.items] = items[first:first + int(patches[start:stop].sum())]
    elif items is not None:
        one[kind.items] = items[start:stop]
    return one
