"""Qwen3-Omni mRoPE positions, identical to transformers' `Qwen3OmniMoe...get_rope_index`.

The rule differs from the Qwen-VL families: every block (image, video, audio, or a video with its
audio interleaved) is wrapped in start/end tokens that take text positions; text and wrapper tokens
resume at 1 + the largest position of the previous piece; image t positions step by
`position_id_per_seconds`, video t positions by `second_per_grids * position_id_per_seconds`
(fractional: positions are float, as in the reference); audio runs are 1D with the audio
encoder's output length; with `use_audio_in_video` the video and audio positions are merged by
their t value (video first on ties). The loop is over blocks of a sample, never over tokens.

Shape legend: B = rows, S = row length, L = one block's tokens.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.rope.config import MRopeConfig


def audio_output_length(input_lengths: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio encoder output length for raw feature lengths (the reference's conv + chunk arithmetic)."""
    chunk = n_window * 2
    leave = input_lengths % chunk
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (input_lengths // chunk) * 13


def _text(length: int, start) -> torch.Tensor:
    return torch.arange(length).float().view(1, -1).expand(3, -1) + start  # [3, L]


def _vision(start, t_index: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """[3, t*h*w] positions of a merged vision grid, t-major, offset by `start`."""
    h = torch.arange(grid_h).view(1, -1, 1).expand(len(t_index), -1, grid_w).flatten().float()
    w = torch.arange(grid_w).view(1, 1, -1).expand(len(t_index), grid_h, -1).flatten().float()
    t = t_index.float().view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    return torch.stack([t, h, w]) + start


def _interleave_by_time(video: torch.Tensor, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two t-sorted position runs, video first on ties. Returns (merged [3, L], last piece).

    The last piece is what the reference appends last: the leftover run of whichever source was
    not exhausted by the merge, whose maximum decides where the next text starts.
    """
    merged_from_video = torch.cat([torch.ones(video.shape[1], dtype=torch.bool), torch.zeros(audio.shape[1], dtype=torch.bool)])
    both = torch.cat([video, audio], dim=1)
    order = torch.sort(both[0], stable=True).indices  # video precedes audio on equal t
    merged, source = both[:, order], merged_from_video[order]
    tail_source = source[-1]
    other = torch.nonzero(source != tail_source).flatten()
    tail_start = int(other[-1]) + 1 if other.numel() else 0
    return merged, merged[:, tail_start:]


def _take(values, index: int, name: str):
    """values[index], or a ValueError naming how many there are."""
    count = 0 if values is None else len(values)
    if index >= count:
        raise ValueError(f"input_ids hold more {name} blocks than the {count} entries of {name}")
    return values[index]


def _check_block(tokens: list[int], begin: int, length: int, ids: set, *, row: int, what: str) -> None:
    """tokens[begin:begin+length] are all placeholders of `ids`, and the block ends right there.

    Raises:
        ValueError: the block is shorter or longer than its grid / audio length says (naming both).
    """
    run = begin
    while run < len(tokens) and tokens[run] in ids:
        run += 1
    if run - begin != length:
        raise ValueError(f"row {row}: the {what} block at token {begin} has {run - begin} placeholder tokens but "
                         f"its grid / audio length needs {length}")


def omni_rope_index(input_ids, config: MRopeConfig, *, image_grid_thw=None, video_grid_thw=None,
                    attention_mask=None, use_audio_in_video: bool = False, audio_seqlens=None,
                    second_per_grids=None):
    """[3, B, S] float positions and [B, 1] deltas, as Qwen3-Omni's reference computes them."""
    from megatron_vlm_packing.rope.index import check_seconds

    check_seconds(second_per_grids)
    batch, seq = input_ids.shape
    mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    if image_grid_thw is None and video_grid_thw is None:
        positions = mask.float().cumsum(-1) - 1
        positions = positions.masked_fill(~mask, 1).unsqueeze(0).expand(3, -1, -1)
        deltas = positions.max(0)[0].max(-1, keepdim=True)[0] + 1 - mask.sum(-1, keepdim=True)
        return positions, deltas
    merge, pps = config.spatial_merge_size, config.position_id_per_seconds
    out = torch.zeros(3, batch, seq, dtype=torch.float, device=input_ids.device)
    deltas = []
    image_i = video_i = audio_i = 0
    for row in range(batch):
        row_ids = input_ids[row][mask[row]]
        tokens = row_ids.tolist()
        # Every block opens with a vision-start or audio-start token: find them once, with a tensor op.
        opens = torch.nonzero((row_ids == config.vision_start_token_id)
                              | (row_ids == config.audio_start_token_id)).flatten().tolist()
        pieces, cursor = [], 0
        next_start = lambda: pieces[-1].max() + 1 if pieces else 0  # noqa: E731
        for at in opens:
            if at < cursor:  # the audio-start inside an audio-in-video block, already consumed
                continue
            if at > cursor:
                pieces.append(_text(at - cursor, next_start()))
            audio_in_video = tokens[at] == config.vision_start_token_id and at + 1 < len(tokens) \
                and tokens[at + 1] == config.audio_start_token_id
            wrap = 2 if audio_in_video else 1
            pieces.append(_text(wrap, next_start()))
            start = next_start()  # right after the opening tokens
            if tokens[at] == config.audio_start_token_id:
                length = int(audio_output_length(torch.as_tensor(_take(audio_seqlens, audio_i, "audio_seqlens")), config.audio_n_window))
                _check_block(tokens, at + wrap, length, {config.audio_token_id}, row=row, what="audio")
                pieces.append(_text(length, start))
                cursor, audio_i = at + wrap + length + wrap, audio_i + 1
            elif not audio_in_video and tokens[at + 1] == config.image_token_id:
                t, h, w = (int(x) for x in _take(image_grid_thw, image_i, "image_grid_thw"))
                _check_block(tokens, at + wrap, t * h * w // merge ** 2, {config.image_token_id}, row=row, what="image")
                pieces.append(_vision(start, torch.arange(t) * 1 * pps, h // merge, w // merge))
                cursor, image_i = at + wrap + t * h * w // merge ** 2 + wrap, image_i + 1
            else:
                t, h, w = (int(x) for x in _take(video_grid_thw, video_i, "video_grid_thw"))
                t_index = torch.arange(t) * _take(second_per_grids, video_i, "second_per_grid_ts").cpu().float() * pps
                video = _vision(start, t_index, h // merge, w // merge)
                if audio_in_video:
                    length = int(audio_output_length(torch.as_tensor(_take(audio_seqlens, audio_i, "audio_seqlens")), config.audio_n_window))
                    _check_block(tokens, at + wrap, length + t * h * w // merge ** 2,
                                 {config.video_token_id, config.audio_token_id}, row=row, what="video with audio")
                    merged, tail = _interleave_by_time(video, _text(length, start))
                    pieces.append(merged)
                    last = tail
                    cursor, audio_i = at + wrap + length + t * h * w // merge ** 2 + wrap, audio_i + 1
                else:
                    _check_block(tokens, at + wrap, t * h * w // merge ** 2, {config.video_token_id}, row=row, what="video")
                    pieces.append(video)
                    cursor = at + wrap + t * h * w // merge ** 2 + wrap
                video_i += 1
                if audio_in_video:
                    pieces.append(_text(wrap, last.max() + 1))
                    continue
            pieces.append(_text(wrap, next_start()))
        if cursor < len(tokens):
            pieces.append(_text(len(tokens) - cursor, next_start()))
        positions = torch.cat(pieces, dim=1)
        out[:, row, mask[row]] = positions.to(out.device)
        deltas.append(positions.max() + 1 - len(tokens))
    for name, used, given in (("image_grid_thw", image_i, image_grid_thw), ("video_grid_thw", video_i, video_grid_thw),
                              ("audio_seqlens", audio_i, audio_seqlens)):
        if given is not None and used != len(given):
            raise ValueError(f"{used} blocks in input_ids use {name}, which has {len(given)} entries")
    return out, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)
