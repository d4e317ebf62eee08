"""HF-identical mRoPE position ids: the public entry points and the one read.

`get_rope_index` (or `queue_rope_index` on a caller's read, then `finish_rope_index`) checks types and
shapes without a read (`rope.index_checks`), queues the value checks and the video block count, raises the
failed checks in their documented order, then computes the positions with the vectorised rule of the Qwen-VL
families in `rope.index_rules` (Qwen3-Omni: `rope.omni_index`, its rule `rope.omni`). Shape legend: B = rows,
S = row length, K = runs (text runs and vision blocks) over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from megatron_vlm_packing.packing.checks import token_place
from megatron_vlm_packing.packing.lengths import widened_unsigned
from megatron_vlm_packing.rope.config import MRopeConfig
from megatron_vlm_packing.rope.index_checks import (
    any_bad_grid, check_grid, check_grid_shape, check_rope_types, check_seconds, seconds_and_bad,
)
from megatron_vlm_packing.rope.index_rules import grid_per_run, run_positions, token_runs


class RopeIndex(NamedTuple):
    """position_ids: [3, B, S] long; deltas: [B, 1] long (max position + 1 - real length)."""

    position_ids: torch.Tensor
    deltas: torch.Tensor


def token_types(input_ids: torch.Tensor, config: MRopeConfig) -> torch.Tensor:
    """[B, S] int: 0 text, 1 image placeholder, 2 video placeholder (transformers' mm_token_type_ids)."""
    return placeholder_types(input_ids, config.image_token_id, config.video_token_id)


def placeholder_types(input_ids: torch.Tensor, image_token_id: int | None, video_token_id: int | None) -> torch.Tensor:
    """input_ids: [..., S] -> [..., S] int32 transformers' `mm_token_type_ids`: 1 at `image_token_id`, 2 at
    `video_token_id`, 0 elsewhere (an id of None marks nothing)."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for token, kind in ((image_token_id, 1), (video_token_id, 2)):
        if token is not None:
            types += kind * (input_ids == token).int()
    return types


@dataclass(frozen=True)
class QueuedRopeIndex:
    """The part of `get_rope_index` computed before its one read (`queue_rope_index`), finished by
    `finish_rope_index` with that read's values. Shapes: B, S of the ids; K = N = B*S runs (padded).

    Attributes:
        config, input_ids ([B, S]), keep ([B, S] bool), image_grid_thw, video_grid_thw (as given),
            second_per_grid_ts: the index's inputs.
        runs: `token_runs`' tensors (flat, kind, run_of_token, run_first, run_len, run_type, run_row).
        grid: [K, 3] grid of each run; expected: [K] tokens each run's grid needs.
        entry: the index of the queued values on the caller's checks: grid entries bad (image,
            video), seconds bad, image blocks, video blocks, video grid rows, a block of wrong size.
        where: (row, position) -> how an error names that token (`packing.checks.token_place`; a
            pre-packed batch names the document of the row as given).
    """

    config: MRopeConfig
    input_ids: torch.Tensor
    keep: torch.Tensor
    image_grid_thw: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    second_per_grid_ts: object
    runs: tuple
    grid: torch.Tensor
    expected: torch.Tensor
    entry: int
    where: Callable[[int, int], str] = token_place
    mm_token_type_ids: torch.Tensor | None = None  # as given (None: derived from the ids), to name a bad type


def queue_rope_index(input_ids, config: MRopeConfig, checks, *, image_grid_thw=None, video_grid_thw=None,
                     attention_mask=None, second_per_grid_ts=None, mm_token_type_ids=None, audio_seqlens=None,
                     use_audio_in_video=None, where: Callable[[int, int], str] = token_place):
    """Queue on `checks` (a `packing.checks.DeferredChecks`, or anything with its `add`) the values the
    index must read: its value checks and the video block count (Qwen3-Omni: `omni_index.queue_omni_index`).
    Reads nothing and raises nothing for bad values (`finish_rope_index` does, from the read). The
    caller has run `check_rope_types`. Arguments: those of `get_rope_index`, and `where` (row,
    position) -> how an error names a token (default "row r position p")."""
    if config.family == "qwen3_omni":
        from megatron_vlm_packing.rope.omni_index import queue_omni_index

        return queue_omni_index(input_ids, config, checks, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                attention_mask=attention_mask, audio_seqlens=audio_seqlens,
                                second_per_grids=second_per_grid_ts, use_audio_in_video=use_audio_in_video,
                                where=where)
    device = input_ids.device
    batch, seq = input_ids.shape
    merge = config.spatial_merge_size
    image_grid_thw = check_grid_shape(image_grid_thw, "image_grid_thw")  # uint16 / uint32 as int64 (checked by
    video_grid_thw = check_grid_shape(video_grid_thw, "video_grid_thw")  # the caller: reads and raises nothing)
    types = mm_token_type_ids if mm_token_type_ids is not None else token_types(input_ids, config)
    keep = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    runs = token_runs(keep, types, batch, seq)
    run_len, run_type = runs[4], runs[5]
    per_frame = config.family == "qwen3_vl" and video_grid_thw is not None  # one block per frame
    grid, (images, videos) = grid_per_run(run_type, image_grid_thw, video_grid_thw, device, video_frames=per_frame)
    expected = torch.where(run_type > 0, grid[:, 0] * (grid[:, 1] // merge) * (grid[:, 2] // merge), run_len)
    video_rows = torch.full((), 0 if video_grid_thw is None else video_grid_thw.shape[0], dtype=torch.long,
                            device=device)
    if per_frame and video_grid_thw.shape[0]:
        video_rows = video_grid_thw[:, 0].sum().to(device=device, dtype=torch.long)
    seconds_bad = seconds_and_bad(second_per_grid_ts)
    values = (any_bad_grid(image_grid_thw, merge, device), any_bad_grid(video_grid_thw, merge, device),
              seconds_bad[1].any().to(device=device, dtype=torch.long) if seconds_bad is not None
              else torch.zeros((), dtype=torch.long, device=device),
              images, videos, video_rows, (expected != run_len).any().long(),
              # given types other than 0, 1, 2 on kept tokens: -1 was silently text, 3 a "video block"
              # with grid [0, 0, 0] (the HF model fails with a KeyError on both)
              torch.zeros((), dtype=torch.long, device=device) if mm_token_type_ids is None
              else (keep & (types != 0) & (types != 1) & (types != 2)).any().long())
    entry = checks.add(values, lambda host: False, None)  # raised in order by finish_rope_index
    return QueuedRopeIndex(config, input_ids, keep, image_grid_thw, video_grid_thw, second_per_grid_ts, runs, grid,
                           expected, entry, where, mm_token_type_ids)


def _raise_failed_checks(queued: QueuedRopeIndex, host: list) -> None:
    """The index's value checks from the read's `host` values, raised in their documented order: grid
    entries, seconds, blocks vs grid rows, tokens per block vs grid (details recomputed on this error path)."""
    merge = queued.config.spatial_merge_size
    image_bad, video_bad, seconds_bad, images, videos, video_rows, wrong, types_bad = host
    if types_bad:  # first: the block counts below are made from these types
        types = queued.mm_token_type_ids
        row, position = torch.nonzero(queued.keep & (types != 0) & (types != 1) & (types != 2))[0].tolist()
        raise ValueError(f"mm_token_type_ids {queued.where(row, position)} is {types[row, position].item()}: "
                         f"token types must be 0 (text), 1 (image) or 2 (video)")
    if image_bad or video_bad:
        check_grid(queued.image_grid_thw, "image_grid_thw", merge)
        check_grid(queued.video_grid_thw, "video_grid_thw", merge)
    if seconds_bad:
        check_seconds(queued.second_per_grid_ts)
    image_rows = 0 if queued.image_grid_thw is None else queued.image_grid_thw.shape[0]
    for kind, (name, count, n_grids) in enumerate((("image", images, image_rows), ("video", videos, video_rows)), 1):
        if count != n_grids:
            starts = _block_places(queued, torch.nonzero(queued.runs[5] == kind).flatten())
            shown = ", ".join(starts[:4]) + (f" and {len(starts) - 4} more" if len(starts) > 4 else "")
            raise ValueError(f"{count} {name} placeholder blocks in input_ids but {n_grids} rows in {name}_grid_thw"
                             + (f" (blocks at {shown})" if starts else ""))
    if wrong:
        run_len, run_type = queued.runs[4], queued.runs[5]
        grid, expected = queued.grid, queued.expected
        k = int(torch.nonzero(expected != run_len)[0])
        name = "image" if int(run_type[k]) == 1 else "video"
        place = _block_places(queued, k)[0]
        raise ValueError(f"the {name} block at input_ids {place} has {int(run_len[k])} placeholder "
                         f"tokens but its grid {grid[k].tolist()} with merge {merge} needs {int(expected[k])}")


def _block_places(queued: QueuedRopeIndex, runs) -> list[str]:
    """Where each of `runs` (run numbers: an int or a [k] tensor) starts, named as the caller's batch
    has it; one read (error path only)."""
    flat, run_first = queued.runs[0], queued.runs[3]
    starts = flat.index_select(0, run_first.index_select(0, torch.as_tensor(runs, device=flat.device).reshape(-1)))
    return [queued.where(*divmod(start, queued.input_ids.shape[1])) for start in starts.tolist()]


def finish_rope_index(queued, host: list, *, audio_seqlens=None) -> RopeIndex:
    """`get_rope_index`'s result from `queue_rope_index`'s state and the caller's read (`host`: what
    `checks.read()` returned). Raises the index's ValueErrors; reads nothing more on the clean path.
    `audio_seqlens` (Qwen3-Omni): host raw audio lengths known only after the read."""
    if not isinstance(queued, QueuedRopeIndex):
        from megatron_vlm_packing.rope.omni_index import finish_omni_index

        return RopeIndex(*finish_omni_index(queued, host, audio_seqlens=audio_seqlens))
    _raise_failed_checks(queued, host[queued.entry])
    return RopeIndex(*run_positions(queued, n_videos=host[queued.entry][4]))


def get_rope_index(
    input_ids: torch.Tensor,
    config: MRopeConfig,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    use_audio_in_video: bool | None = None,
    audio_seqlens: torch.Tensor | None = None,
) -> RopeIndex:
    """3D rotary positions identical to the Hugging Face model of `config.family`.

    Args:
        input_ids: [B, S] long.
        config: `MRopeConfig` of the family.
        image_grid_thw / video_grid_thw: [I, 3] / [V, 3] long, patch grids in token order.
        attention_mask: [B, S], 1 = real token (any pattern; HF semantics).
        second_per_grid_ts: [V] seconds per temporal grid step (Qwen2.5-VL videos): a tensor (any float
            dtype; the t positions are truncated in that dtype, like transformers) or a list of numbers.
        mm_token_type_ids: [B, S] 0/1/2; derived from the placeholder ids when None.
        use_audio_in_video, audio_seqlens: Qwen3-Omni audio inputs (raw audio feature lengths; an
            audio-in-video block is told by its tokens, as in the reference's positions; a flag given as
            True or False must agree with every video block's tokens, None leaves them to decide).

    Returns:
        RopeIndex(position_ids [3, B, S] long, deltas [B, 1] long).

    Raises:
        ValueError: placeholder blocks vs grid rows, or tokens per block vs grid, disagree; a grid
        entry < 1 (or h, w not multiples of the merge size, or t * h * w beyond int64); seconds NaN,
        infinite or negative; non-integer ids or grids.

    Qwen3-Omni follows its own rule (rope/omni.py) and returns float positions, as its reference does.
    """
    check_rope_types(input_ids, config, image_grid_thw, video_grid_thw, attention_mask, mm_token_type_ids,
                     second_per_grid_ts, audio_seqlens, use_audio_in_video)
    # uint16 / uint32 as int64 (uint64 refused), as pack_batch reads them: torch cannot index-copy or promote them.
    input_ids = widened_unsigned(input_ids, "input_ids")
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = widened_unsigned(attention_mask, "attention_mask")
    if isinstance(mm_token_type_ids, torch.Tensor):
        mm_token_type_ids = widened_unsigned(mm_token_type_ids, "mm_token_type_ids")
    from megatron_vlm_packing.packing.checks import DeferredChecks

    checks = DeferredChecks()
    queued = queue_rope_index(input_ids, config, checks, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                              attention_mask=attention_mask, second_per_grid_ts=second_per_grid_ts,
                              mm_token_type_ids=mm_token_type_ids, audio_seqlens=audio_seqlens,
                              use_audio_in_video=use_audio_in_video)
    return finish_rope_index(queued, checks.read())  # the one host sync
