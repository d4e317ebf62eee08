"""Qwen3-Omni mRoPE positions, identical to transformers' `Qwen3OmniMoe...get_rope_index`.

The rule differs from the Qwen-VL families: every block (image, video, audio, or a video with its
audio interleaved) is wrapped in start/end tokens that take text positions; text and wrapper tokens
resume at 1 + the largest position of the previous piece; image t positions step by
`position_id_per_seconds`, video t positions by `second_per_grids * position_id_per_seconds`
(fractional: positions are float, as in the reference); audio runs are 1D with the audio
encoder's output length; with `use_audio_in_video` the video and audio positions are merged by
their t value (video first on ties). The loop over a sample's blocks runs on the host, on the ids,
grids, seconds and audio lengths read back once (`rope.omni_index`: `queue_omni_index` queues them on
the caller's read, e.g. packing's; `finish_omni_index` then reads nothing and calls `row_positions`
here for each row). The audio placeholder count (`audio_tokens_per_clip`) is the packers' and planner's
rule too.

Shape legend: B = rows, S = row length, L = one block's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

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
class _Row:
    """One row's kept tokens (host ids) and what its blocks read: `inputs` (`omni_index._host_inputs`), `used`
    (images, videos and audio entries taken so far, updated in place), `place(i)` (names kept token i)."""

    tokens: list[int]
    config: MRopeConfig
    inputs: dict
    used: list[int]
    place: Callable[[int], str]


def _next_start(pieces: list[torch.Tensor]):
    """Where the next piece starts: 1 + the largest position of the last piece (0 for the first)."""
    return pieces[-1].max() + 1 if pieces else 0


def row_positions(tokens: list[int], config: MRopeConfig, inputs: dict, used: list[int],
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
