"""Qwen3-Omni's mRoPE index on the caller's one read: what it queues and how it finishes from the host values.

`queue_omni_index` queues the index's value checks and, with grids or audio lengths, the kept ids and every
grid, seconds and audio length on the caller's `DeferredChecks` (e.g. packing's), reading nothing;
`finish_omni_index` raises the failed checks in their order and runs the block loop of `rope.omni` (the
positions rule, identical to transformers' `Qwen3OmniMoe...get_rope_index`) on those host values, reading
nothing more. `rope.index.queue_rope_index` / `finish_rope_index` hand the qwen3_omni family here.

Shape legend: B = rows, S = row length, N = B*S slots.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_vlm_packing.packing.checks import token_place
from megatron_vlm_packing.rope.config import MRopeConfig
from megatron_vlm_packing.rope.index_checks import (
    any_bad_grid, check_grid, check_grid_shape, check_seconds, checked_audio_in_video, seconds_and_bad,
)
from megatron_vlm_packing.rope.omni import row_positions


@dataclass(frozen=True)
class QueuedOmniIndex:
    """The Qwen3-Omni index's inputs and the entries of its values on the caller's checks (`queue_omni_index`):
    "flags" (grid entries bad: image, video; seconds bad), and with grids or audio lengths "ids" ([N = B*S]: the kept
    ids, row by row, then fills), "lengths" ([B] kept tokens per row), "image_grid_thw" /
    "video_grid_thw" (flat), "seconds" (float64), "audio_seqlens". `slots`: [N] flat slot of each
    kept token, then N (None without grids). `where`: (row, position) -> how an error names a token."""

    config: MRopeConfig
    input_ids: torch.Tensor
    keep: torch.Tensor
    inputs: dict
    entries: dict
    slots: torch.Tensor | None = None
    where: Callable[[int, int], str] = token_place


def _flat(value, dtype) -> torch.Tensor | None:
    """A tensor's values as a 1-D tensor of `dtype` (None for None, a list, or no values)."""
    return value.reshape(-1).to(dtype) if isinstance(value, torch.Tensor) and value.numel() else None


def queue_omni_index(input_ids, config: MRopeConfig, checks, *, image_grid_thw=None, video_grid_thw=None,
                     attention_mask=None, audio_seqlens=None, second_per_grids=None, use_audio_in_video=None,
                     where: Callable[[int, int], str] = token_place) -> QueuedOmniIndex:
    """Queue on `checks` (a `packing.checks.DeferredChecks`) what the Qwen3-Omni index reads: its value
    checks and, with grids or audio lengths, the kept ids and every grid, seconds and audio length (the block loop runs
    on the host). Reads and raises nothing; `finish_omni_index` does. Types checked by the caller."""
    device, merge = input_ids.device, config.spatial_merge_size
    image_grid_thw = check_grid_shape(image_grid_thw, "image_grid_thw")  # uint16 / uint32 as int64
    video_grid_thw = check_grid_shape(video_grid_thw, "video_grid_thw")
    # Exactly the tokens whose mask is 1, as the thinker keeps them (`attention_mask[i] == 1`); the Qwen-VL models
    # keep any nonzero, and so does their rule in `rope.index`.
    keep = attention_mask == 1 if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    seconds = seconds_and_bad(second_per_grids)
    flags = (any_bad_grid(image_grid_thw, merge, device), any_bad_grid(video_grid_thw, merge, device),
             seconds[1].any().to(device=device, dtype=torch.long) if seconds is not None
             else torch.zeros((), dtype=torch.long, device=device))
    entries, slots = {"flags": checks.add(flags, lambda host: False, None)}, None
    # Audio lengths alone walk the blocks too: their counts are checked against the audio placeholders
    # (the reference's text positions there are the same; it checks nothing).
    if image_grid_thw is not None or video_grid_thw is not None or _flat(audio_seqlens, torch.long) is not None:
        n = input_ids.numel()
        slots = torch.nonzero_static(keep.reshape(-1), size=n, fill_value=n).flatten()  # row-major
        values = {"ids": input_ids.reshape(-1).index_select(0, slots.clamp(max=n - 1)), "lengths": keep.sum(1),
                  "image_grid_thw": _flat(image_grid_thw, torch.long),
                  "video_grid_thw": _flat(video_grid_thw, torch.long),
                  "seconds": _flat(seconds[0], torch.float64) if seconds is not None else None,
                  "audio_seqlens": _flat(audio_seqlens, torch.long)}
        entries |= {name: checks.add(v.to(device), lambda host: False, None) for name, v in values.items()
                    if v is not None}
    inputs = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, audio_seqlens=audio_seqlens,
                  second_per_grids=second_per_grids, attention_mask=attention_mask,
                  use_audio_in_video=checked_audio_in_video(use_audio_in_video))
    return QueuedOmniIndex(config, input_ids, keep, inputs, entries, slots, where)


def _host_inputs(queued: QueuedOmniIndex, host: list, audio_seqlens) -> dict:
    """Grids as [t, h, w] rows, seconds and audio lengths as host numbers (None where not given)."""
    out = {}
    for name in ("image_grid_thw", "video_grid_thw"):
        given = queued.inputs[name]
        rows = host[queued.entries[name]] if name in queued.entries else []
        out[name] = None if given is None else [rows[i:i + 3] for i in range(0, len(rows), 3)]
    seconds, audio = queued.inputs["second_per_grids"], queued.inputs["audio_seqlens"]
    out["seconds"] = None if seconds is None else host[queued.entries["seconds"]] if "seconds" in queued.entries else []
    if audio_seqlens is not None:
        audio = list(audio_seqlens)
    elif isinstance(audio, torch.Tensor):
        audio = host[queued.entries["audio_seqlens"]] if "audio_seqlens" in queued.entries else []
    out["audio_seqlens"] = audio
    out["use_audio_in_video"] = queued.inputs.get("use_audio_in_video")
    return out


def finish_omni_index(queued: QueuedOmniIndex, host: list, *, audio_seqlens=None):
    """[3, B, S] float positions and [B, 1] deltas from the read's `host` values (the caller's whole
    read), as Qwen3-Omni's reference computes them; raises the index's ValueErrors in their order
    (grid entries, seconds, then block by block). `audio_seqlens`: host raw audio lengths given
    after the read (they then replace the queued ones). Reads nothing."""
    config, input_ids, keep = queued.config, queued.input_ids, queued.keep
    image_bad, video_bad, seconds_bad = host[queued.entries["flags"]]
    if image_bad or video_bad:
        check_grid(queued.inputs["image_grid_thw"], "image_grid_thw", config.spatial_merge_size)
        check_grid(queued.inputs["video_grid_thw"], "video_grid_thw", config.spatial_merge_size)
    if seconds_bad:
        check_seconds(queued.inputs["second_per_grids"])
    if "ids" not in queued.entries:  # no grids: text positions over the kept tokens
        if not input_ids.numel():  # no rows or no columns: the max below was an IndexError (other families: empty)
            return torch.zeros(3, *input_ids.shape, device=input_ids.device), keep.sum(-1, keepdim=True).float()
        # The thinker counts the mask as given here (a cumulative sum; 1 where it is 0), not its kept tokens (== 1).
        mask = queued.inputs.get("attention_mask")
        counted = keep if mask is None else mask
        positions = counted.float().cumsum(-1) - 1
        positions = positions.masked_fill(counted == 0, 1).unsqueeze(0).expand(3, -1, -1)
        deltas = positions.max(0)[0].max(-1, keepdim=True)[0] + 1 - counted.sum(-1, keepdim=True)
        return positions, deltas
    ids, inputs = host[queued.entries["ids"]], _host_inputs(queued, host, audio_seqlens)
    pieces, deltas, used, first = [], [], [0, 0, 0], 0
    for row, length in enumerate(host[queued.entries["lengths"]]):
        if not length:  # a row with no kept token (pack_batch keeps empty rows): torch.cat of no pieces raised
            deltas.append(torch.zeros(()))  # its next token would take position 0
            continue
        positions = row_positions(ids[first:first + length], config, inputs, used,
                                   functools.partial(_kept_token_place, queued, row, first))
        pieces.append(positions)
        deltas.append(positions.max() + 1 - length)
        first += length
    for name, count in zip(("image_grid_thw", "video_grid_thw", "audio_seqlens"), used):
        given = inputs[name]
        if given is not None and count != len(given):
            raise ValueError(f"{count} blocks in input_ids use {name}, which has {len(given)} entries")
    if inputs["seconds"] is not None and len(inputs["seconds"]) > used[1]:  # too few: the block that lacks one says so
        # Entries no video block reads would be dropped without a word (the other families raise too).
        raise ValueError(f"{len(inputs['seconds'])} entries in second_per_grid_ts but {used[1]} video blocks in "
                         f"input_ids")
    n, device = input_ids.numel(), input_ids.device
    pieces.append(torch.zeros(3, n - first))  # the fill slots (all go to column N)
    out = torch.zeros(3, n + 1, device=device).index_copy_(1, queued.slots, torch.cat(pieces, dim=1).to(device))
    deltas = torch.stack(deltas) if deltas else torch.zeros(0)  # no rows: torch.stack([]) was a RuntimeError
    return out[:, :n].reshape(3, *input_ids.shape), deltas.to(device).unsqueeze(1)


def _kept_token_place(queued: QueuedOmniIndex, row: int, first: int, token: int) -> str:
    """Kept token `token` of `row` (the row's kept tokens start at `first` of the read ids), named as
    the caller's batch has it (error path only)."""
    return queued.where(row, int(queued.slots[first + token]) % queued.input_ids.shape[1])
