"""Packs made wrong on purpose, so a parity probe that passes on the correct pack is shown to look: each is a
`transform` for `make_forward_step` (MicroBatch -> MicroBatch) that breaks one sample's isolation in a way the
step's own checks cannot see (boundaries declared, media values and seconds no check reads).

Shape legend: T = packed slots, P = patches, C = patch features, A = clips, F = mel bins, L = frames.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_vlm_packing.packing.micro_batch import MicroBatch, declare_boundaries


def moved_boundary(micro_batch: MicroBatch, shift: int = 3) -> MicroBatch:
    """The boundary between the first two documents moved `shift` slots later (declared, so the step trains it):
    the second document's first tokens attend to the first document, as one merged by mistake."""
    params = micro_batch.packed_seq_params
    moved = {}
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        cu = getattr(params, name)
        if cu is not None:
            cu = cu.clone()
            cu[1] += shift
            moved[name] = cu
    widest = int(moved.get("cu_seqlens_q_padded", moved["cu_seqlens_q"]).diff().max())
    params = replace(params, **moved, max_seqlen_q=max(params.max_seqlen_q, widest),
                     max_seqlen_kv=max(params.max_seqlen_kv, widest))
    return declare_boundaries(micro_batch, params)


def _owners(per_sample: tuple[int, ...]) -> list[int]:
    """The sample of each item, in order (`per_sample`: items of each sample)."""
    return [sample for sample, count in enumerate(per_sample) for _ in range(count)]


def _patch_slices(grid: torch.Tensor) -> list[slice]:
    """Rows of a [P, C] patch tensor each grid row ([I, 3]) takes, in order."""
    stops = grid.long().prod(dim=1).cumsum(0).tolist()
    return [slice(start, stop) for start, stop in zip([0] + stops[:-1], stops)]


def foreign_media(kind: str):
    """A transform giving every item of `kind` ("image", "video" or "audio") the values of an item of another
    sample (the patches of a vision item for images and videos, as many rows as fit; a clip's mel features for
    audio): media crossing from one sample into another, shapes and counts unchanged. Every item, not one: an
    item no trained token follows (a clip closing its sample) changes no loss."""
    def corrupt(micro_batch: MicroBatch) -> MicroBatch:
        if kind == "audio":
            audio = micro_batch.audio
            owners = _owners(audio.audios_per_sample)
            features = audio.input_features.clone()
            for k, owner in enumerate(owners):
                features[k] = audio.input_features[_donor(owners, owner)]
            return replace(micro_batch, audio=replace(audio, input_features=features))
        vision = micro_batch.vision
        items = {"image": (vision.pixel_values, vision.image_grid_thw, vision.images_per_sample),
                 "video": (vision.pixel_values_videos, vision.video_grid_thw, vision.videos_per_sample)}
        pool = [(values[rows], who) for values, grid, counts in items.values() if values is not None
                for rows, who in zip(_patch_slices(grid), _owners(counts))]
        pixels, grid, per_sample = items[kind]
        changed = pixels.clone()
        for target, owner in zip(_patch_slices(grid), _owners(per_sample)):
            taken = pool[_donor([who for _, who in pool], owner)][0][:target.stop - target.start]
            changed[target.start:target.start + taken.shape[0]] = taken
        field = "pixel_values" if kind == "image" else "pixel_values_videos"
        return replace(micro_batch, vision=replace(vision, **{field: changed}))

    return corrupt


def _donor(owners: list[int], owner: int) -> int:
    """The first item of `owners` that belongs to another sample than `owner`."""
    return next(k for k, who in enumerate(owners) if who != owner)


def swapped_seconds(micro_batch: MicroBatch) -> MicroBatch:
    """The pack's seconds per video grid step reversed (videos of different samples swap their timing): read
    by a model that computes its own temporal positions from them (Bridge's Qwen2.5-VL)."""
    vision = micro_batch.vision
    return replace(micro_batch, vision=replace(vision, second_per_grid_ts=vision.second_per_grid_ts.flip(0)))


def shifted_positions(token_id: int, shift: int = 1):
    """A transform moving the positions of every slot holding `token_id` (an audio or image placeholder) `shift`
    steps later on every channel (mRoPE [3, 1, T] or [1, T]): the items keep their values and their documents,
    but sit elsewhere against their own sample's text, as an index that miscounts an item's positions would put
    them. A whole document shifted would change nothing (rotary attention reads position differences only)."""
    def corrupt(micro_batch: MicroBatch) -> MicroBatch:
        slots = micro_batch.input_ids[0] == token_id  # [T]
        positions = micro_batch.position_ids.clone()
        positions[..., slots] += shift
        return replace(micro_batch, position_ids=positions)

    return corrupt
