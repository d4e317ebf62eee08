"""Qwen3-Omni mRoPE positions, identical to transformers' `Qwen3OmniMoe...get_rope_index`.

The rule differs from the Qwen-VL families: every block (image, video, audio, or a video with its
audio interleaved) is wrapped in start/end tokens that take text positions; text and wrapper tokens
resume at 1 + the largest position of the previous piece; image t positions step by
`position_id_per_seconds`, video t positions by `second_per_grids * position_id_per_seconds`
(fractional: positions are float, as in the reference); audio runs are 1D with the audio
encoder's output length; with `use_audio_in_video` the video and audio positions are merged by
their t value (video first on ties). The loop over a sample's blocks runs on the host, on the ids,
grids, seconds and audio lengths read back once (`queue_omni_index`: queued on the caller's read,
e.g. packing's; `finish_omni_index` then reads nothing).

Shape legend: B = rows, S = row length, L = one block's tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from megatron_vlm_packing.packing.checks import token_place
from megatron_vlm_packing.rope.config import MRopeConfig


def audio_output_length(input_lengths: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio encoder output length for raw feature lengths (the reference's conv + chunk arithmetic)."""
    chunk = n_window * 2
    leave = input_lengths % chunk
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (input_lengths // chunk) * 13


class ClipTokens(NamedTuple):
    """Placeholder tokens of audio clips from their raw lengths (`audio_tokens_per_clip`).

    Attributes:
        tokens: each clip's placeholder tokens (host ints); empty when any clip is in `empty`.
        empty: the clips whose raw length is < 1, in order: their encoder output has no tokens (0 for 0,
            negative below), so each caller names the first ones in its own terms.
    """

    tokens: list[int]
    empty: list[int]


def audio_tokens_per_clip(raw_lengths: Sequence[int], n_window: int) -> ClipTokens:
    """The one rule for an audio clip's placeholder tokens: `audio_output_length` of its raw length (host
    ints: exact for any window or length, where an int64 tensor overflowed at 2 * window >= 2**63), for
    clips of raw length >= 1 only; e.g. [100, 30], n_window 50 -> tokens [13, 4]; [100, 0] -> empty [1]."""
    empty = [i for i, n in enumerate(raw_lengths) if n < 1]
    if empty:
        return ClipTokens([], empty)
    return ClipTokens([int(audio_output_length(n, n_window)) for n in raw_lengths], [])


def _text(length: int, start) -> torch.Tensor:
    return torch.arange(length).float().view(1, -1).expand(3, -1) + start  # [3, L]


def _vision(start, t_index: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """[3, t*h*w] positions of a merged vision grid, t-major, offset by `start`."""
    h = torch.arange(grid_h).view(1, -1, 1).expand(len(t_index), -1, grid_w).flatten().float()
    w = torch.arange(grid_w).view(1, 1, -1).expand(len(t_index), grid_h, -1).flatten().float()
    t = t_index.float().view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    return torch.stack([t, h, w]) + start


def _interleave_by_time(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two t-sorted position runs, video first on ties. Returns (merged [3, L], 0-dim max of the last piece).

    The last piece is what the reference appends last: the leftover run of whichever source was
    not exhausted by the merge, whose maximum decides where the next text starts. Reads nothing.
    """
    merged_from_video = torch.cat([torch.ones(video.shape[1], dtype=torch.bool), torch.zeros(audio.shape[1], dtype=torch.bool)])
    both = torch.cat([video, audio], dim=1)
    order = torch.sort(both[0], stable=True).indices  # video precedes audio on equal t
    merged, source = both[:, order], merged_from_video[order]
    after = torch.arange(1, source.numel() + 1)
    tail_start = torch.where(source != source[-1], after, 0).max()  # 0 when one source fills the merge
    return merged, merged.masked_fill((after <= tail_start)[None], float("-inf")).max()


def _take(values, index: int, name: str, place: Callable[[int], str], at: int):
    """values[index], or a ValueError naming how many there are and where the block without one opens
    (kept token `at` of its row, named by `place` only on that error path: it reads the device)."""
    count = 0 if values is None else len(values)
    if index >= count:
        raise ValueError(f"input_ids hold more {name} blocks than the {count} entries of {name}: the block "
                         f"opening at input_ids {place(at)} has none")
    return values[index]


def _audio_tokens(inputs: dict, index: int, place: Callable[[int], str], at: int, n_window: int) -> int:
    """Placeholder tokens of the audio block opening at kept token `at`, from its `audio_seqlens` entry.

    Raises:
        ValueError: no entry left (`_take`), or a raw length < 1: its encoder output has no tokens (0
        for 0, negative below), which the reference fails on with a RuntimeError (max of an empty run).
    """
    raw = int(_take(inputs["audio_seqlens"], index, "audio_seqlens", place, at))
    clip = audio_tokens_per_clip([raw], n_window)
    if clip.empty:
        raise ValueError(f"audio_seqlens entry {index} is {raw}: raw audio lengths must be >= 1 (the audio block "
                         f"opening at input_ids {place(at)})")
    return clip.tokens[0]


def _check_block(tokens: list[int], begin: int, length: int, ids: set, *, place: Callable[[int], str],
                 what: str) -> None:
    """tokens[begin:begin+length] are all placeholders of `ids`, and the block ends right there;
    `place(i)` names the row's kept token i in an error.

    Raises:
        ValueError: the block is shorter or longer than its grid / audio length says (naming both).
    """
    block = tokens[begin:begin + length]  # counted at C speed; the run is walked only to name an error
    if len(block) == length and sum(block.count(i) for i in ids) == length \
            and (begin + length == len(tokens) or tokens[begin + length] not in ids):
        return
    run = begin
    while run < len(tokens) and tokens[run] in ids:
        run += 1
    if run - begin != length:
        raise ValueError(f"the {what} block at input_ids {place(begin)} has {run - begin} placeholder tokens but "
                         f"its grid / audio length needs {length}")


def _openers(tokens: list[int], ids: set) -> list[int]:
    """Sorted indices of the tokens in `ids` (`list.index` scans: one Python step per opener, not per token)."""
    found = []
    for token in ids - {None}:
        at = -1
        while True:
            try:
                at = tokens.index(token, at + 1)
            except ValueError:
                break
            found.append(at)
    return sorted(found)


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
    from megatron_vlm_packing.rope.index_checks import any_bad_grid, check_grid_shape, checked_audio_in_video, seconds_and_bad

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
    from megatron_vlm_packing.rope.index_checks import check_grid, check_seconds

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
        positions = _row_positions(ids[first:first + length], config, inputs, used,
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


@dataclass(frozen=True)
class _Row:
    """One row's kept tokens (host ids) and what its blocks read: `inputs` (`_host_inputs`), `used`
    (images, videos and audio entries taken so far, updated in place), `place(i)` (names kept token i)."""

    tokens: list[int]
    config: MRopeConfig
    inputs: dict
    used: list[int]
    place: Callable[[int], str]


def _next_start(pieces: list[torch.Tensor]):
    """Where the next piece starts: 1 + the largest position of the last piece (0 for the first)."""
    return pieces[-1].max() + 1 if pieces else 0


def _row_positions(tokens: list[int], config: MRopeConfig, inputs: dict, used: list[int],
                   place: Callable[[int], str]) -> torch.Tensor:
    """[3, L] float positions of one row's kept tokens (host ids); `used` counts the images, videos
    and audio entries taken so far (updated in place); `place(i)` names kept token i in errors."""
    row = _Row(tokens, config, inputs, used, place)
    # Every block opens with a vision-start or audio-start token.
    opens = _openers(tokens, {config.vision_start_token_id, config.audio_start_token_id})
    pieces, cursor, blocks = [], 0, []
    for at in opens:
        if at < cursor:  # the audio-start inside an audio-in-video block, already consumed
            continue
        if at > cursor:
            pieces.append(_text(at - cursor, _next_start(pieces)))
        cursor = _block_positions(row, at, pieces)
        blocks.append((at, cursor))
    if cursor < len(tokens):
        pieces.append(_text(len(tokens) - cursor, _next_start(pieces)))
    _refuse_stray_placeholders(row, blocks)
    return torch.cat(pieces, dim=1)


def _refuse_stray_placeholders(row: _Row, blocks: list[tuple[int, int]]) -> None:
    """Every image, video and audio placeholder of the row lies inside one of its `blocks` ((first, end) kept
    tokens, wrappers included). One in text took text positions, silently: the other families count it as a
    block of its own and refuse it, and the HF model has no embedding for it. Counted at C speed (`list.count`);
    the text between blocks is walked only to name the first stray one."""
    kinds = {row.config.image_token_id: "image", row.config.video_token_id: "video",
             row.config.audio_token_id: "audio"}
    kinds.pop(None, None)
    tokens = row.tokens
    placeholders = sum(tokens.count(token) for token in kinds)
    inside = sum(tokens[first:end].count(token) for first, end in blocks for token in kinds)
    if placeholders == inside:
        return
    ends = [0] + [end for _, end in blocks]
    starts = [first for first, _ in blocks] + [len(tokens)]
    stray = next(i for gap_start, gap_end in zip(ends, starts) for i in range(gap_start, gap_end)
                 if tokens[i] in kinds)
    kind = kinds[tokens[stray]]
    raise ValueError(f"input_ids {row.place(stray)} is {'an' if kind == 'image' else 'a'} {kind} placeholder "
                     f"({tokens[stray]}) outside every block (no vision or audio start token opens it): the model "
                     f"has no grid or audio length for its embedding")


def _block_positions(row: _Row, at: int, pieces: list[torch.Tensor]) -> int:
    """Append the positions of the block opening at kept token `at` (its wrapper tokens included) to
    `pieces`; returns the kept token after the block."""
    tokens, config = row.tokens, row.config
    if at + 1 == len(tokens) and tokens[at] == config.vision_start_token_id:
        # A vision-start as the row's last kept token opens no block: reading the token after it was
        # an IndexError here (and in the reference).
        raise ValueError(f"input_ids {row.place(at)} is a vision_start_token_id ({config.vision_start_token_id}) "
                         f"with no image or video placeholder after it: the row's last kept token")
    audio_in_video = tokens[at] == config.vision_start_token_id and at + 1 < len(tokens) \
        and tokens[at + 1] == config.audio_start_token_id
    _check_audio_in_video_flag(row, at, audio_in_video)
    wrap = 2 if audio_in_video else 1
    pieces.append(_text(wrap, _next_start(pieces)))
    start = _next_start(pieces)  # right after the opening tokens
    if tokens[at] == config.audio_start_token_id:
        return _audio_block(row, at, wrap, start, pieces)
    if not audio_in_video and tokens[at + 1] == config.image_token_id:
        return _image_block(row, at, start, pieces)
    return _video_block(row, at, start, pieces, audio_in_video=audio_in_video)


def _check_audio_in_video_flag(row: _Row, at: int, audio_in_video: bool) -> None:
    """A `use_audio_in_video` given as True or False agrees with the video block opening at kept token `at`
    (None: its tokens decide). The thinker follows the flag: an audio-in-video block under False is read as text
    then an audio block, a plain video under True is left out of its block count; other positions, silently."""
    flag = row.inputs.get("use_audio_in_video")
    tokens, config = row.tokens, row.config
    is_video = audio_in_video or at + 1 < len(tokens) and tokens[at] == config.vision_start_token_id \
        and tokens[at + 1] == config.video_token_id
    if flag is None or not is_video or flag == audio_in_video:
        return
    raise ValueError(f"use_audio_in_video={flag} but the video block at input_ids {row.place(at)} has "
                     f"{'its' if audio_in_video else 'no'} audio interleaved (vision start then "
                     f"{'audio start' if audio_in_video else 'video placeholders'}): the flag and the tokens must "
                     f"agree")


def _audio_block(row: _Row, at: int, wrap: int, start, pieces: list[torch.Tensor]) -> int:
    """An audio block (`wrap` wrapper tokens each side: 1, or 2 where the audio-start id is also the
    vision-start id and repeats): 1D text positions over its placeholders."""
    config, used = row.config, row.used
    length = _audio_tokens(row.inputs, used[2], row.place, at, config.audio_n_window)
    _check_block(row.tokens, at + wrap, length, {config.audio_token_id}, place=row.place, what="audio")
    pieces.append(_text(length, start))
    used[2] += 1
    pieces.append(_text(wrap, _next_start(pieces)))
    return at + wrap + length + wrap


def _image_block(row: _Row, at: int, start, pieces: list[torch.Tensor]) -> int:
    """An image block (one wrapper token each side): its merged grid, t stepping by position_id_per_seconds."""
    config, used, merge = row.config, row.used, row.config.spatial_merge_size
    t, h, w = _take(row.inputs["image_grid_thw"], used[0], "image_grid_thw", row.place, at)
    _check_block(row.tokens, at + 1, t * h * w // merge ** 2, {config.image_token_id}, place=row.place, what="image")
    pieces.append(_vision(start, torch.arange(t) * 1 * config.position_id_per_seconds, h // merge, w // merge))
    used[0] += 1
    pieces.append(_text(1, _next_start(pieces)))
    return at + 1 + t * h * w // merge ** 2 + 1


def _video_block(row: _Row, at: int, start, pieces: list[torch.Tensor], *, audio_in_video: bool) -> int:
    """A video block: its merged grid, t stepping by seconds * position_id_per_seconds; with its audio
    (`audio_in_video`, two wrapper tokens each side) the two runs merged by time."""
    config, inputs, used, place, merge = row.config, row.inputs, row.used, row.place, row.config.spatial_merge_size
    t, h, w = _take(inputs["video_grid_thw"], used[1], "video_grid_thw", place, at)
    seconds = torch.tensor(_take(inputs["seconds"], used[1], "second_per_grid_ts", place, at), dtype=torch.float64)
    tokens_in = t * h * w // merge ** 2
    # The block is checked against its grid before its [3, tokens_in] positions are built: a huge grid with a
    # short block was a RuntimeError (cannot allocate), not the block's count error.
    if not audio_in_video:
        _check_block(row.tokens, at + 1, tokens_in, {config.video_token_id}, place=place, what="video")
    else:
        length = _audio_tokens(inputs, used[2], place, at, config.audio_n_window)
        _check_block(row.tokens, at + 2, length + tokens_in, {config.video_token_id, config.audio_token_id},
                     place=place, what="video with audio")
    video = _vision(start, torch.arange(t) * seconds.float() * config.position_id_per_seconds, h // merge, w // merge)
    if not audio_in_video:
        pieces.append(video)
        used[1] += 1
        pieces.append(_text(1, _next_start(pieces)))
        return at + 1 + tokens_in + 1
    merged, last_max = _interleave_by_time(video, _text(length, start))
    pieces += [merged, _text(2, last_max + 1)]
    used[1], used[2] = used[1] + 1, used[2] + 1
    return at + 2 + length + tokens_in + 2
