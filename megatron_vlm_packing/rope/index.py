"""HF-identical mRoPE position ids, vectorised over tokens.

Per sample, over the tokens its attention mask keeps (the Hugging Face rule):
- a text run gets `arange(len) + cur` on all three axes, then `cur += len`;
- a vision block with merged grid (t, h, w) gets t = cur + floor(k * interval), h = cur + row,
  w = cur + col over the t x h x w grid, then `cur += max(h, w)` (transformers >= 5) or
  `cur = block max + 1` (transformers 4.57, `text_offset="max_position"`).
`interval` is 1, except Qwen2.5-VL videos: `tokens_per_second * second_per_grid_ts`, multiplied
and truncated in the dtype transformers uses (float64 seconds stay float64). Qwen3-VL
splits every video into one block per frame (frames are separated by timestamp text).
Masked tokens get 0 on every axis, like the reference.

The work is a handful of gathers over all real tokens at once (runs are found with a cumsum),
not a Python loop over tokens. Shape legend: B = rows, S = row length, R = real tokens,
K = runs (text runs and vision blocks) over the whole batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_vlm_packing.rope.config import MRopeConfig


class RopeIndex(NamedTuple):
    """position_ids: [3, B, S] long; deltas: [B, 1] long (max position + 1 - real length)."""

    position_ids: torch.Tensor
    deltas: torch.Tensor


def token_types(input_ids: torch.Tensor, config: MRopeConfig) -> torch.Tensor:
    """[B, S] int: 0 text, 1 image placeholder, 2 video placeholder (transformers' mm_token_type_ids)."""
    return (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()


def check_grid_shape(grid, name: str) -> torch.Tensor | None:
    """`grid` when it is a [N, 3] integer tensor (None stays None), else ValueError naming it. Reads no values."""
    if grid is None:
        return None
    if not isinstance(grid, torch.Tensor):
        raise ValueError(f"{name} must be a [N, 3] integer tensor, got {type(grid).__name__}")
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() or grid.is_complex() \
            or grid.dtype == torch.bool:
        raise ValueError(f"{name} must be a [N, 3] integer tensor, got shape {tuple(grid.shape)} {grid.dtype}")
    return grid


def check_grid(grid, name: str, merge: int) -> torch.Tensor | None:
    """A [N, 3] integer grid with every entry >= 1 and h, w multiples of `merge`, or ValueError naming it."""
    if check_grid_shape(grid, name) is None:
        return None
    bad = (grid < 1).any(dim=1) | (grid[:, 1:] % merge != 0).any(dim=1)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        raise ValueError(f"{name} row {row} is {grid[row].tolist()}: t, h, w must be >= 1 and h, w multiples "
                         f"of spatial_merge_size={merge}")
    return grid


def check_seconds(seconds, name: str = "second_per_grid_ts") -> None:
    """Seconds per temporal grid step must be finite and >= 0 (NaN would give garbage positions)."""
    if seconds is None:
        return
    values = torch.as_tensor(seconds if not isinstance(seconds, (list, tuple)) or not seconds
                             or not torch.is_tensor(seconds[0]) else torch.stack([torch.as_tensor(x) for x in seconds]))
    values = values.reshape(-1).double()
    bad = ~torch.isfinite(values) | (values < 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"{name} entry {i} is {float(values[i])}: seconds per grid step must be finite and >= 0")


def check_rope_inputs(input_ids, config: MRopeConfig, image_grid_thw, video_grid_thw, attention_mask,
                      second_per_grid_ts) -> None:
    """ValueError naming the field for inputs the index cannot take (before any arithmetic)."""
    if not isinstance(config, MRopeConfig):
        raise ValueError(f"config must be an MRopeConfig, got {type(config).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be a [B, S] integer tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
                         f"{' ' + str(input_ids.dtype) if isinstance(input_ids, torch.Tensor) else ''}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(input_ids.shape)):
        raise ValueError(f"attention_mask must be [B, S] = {tuple(input_ids.shape)} like input_ids, got "
                         f"{tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
    check_grid(image_grid_thw, "image_grid_thw", config.spatial_merge_size)
    check_grid(video_grid_thw, "video_grid_thw", config.spatial_merge_size)
    check_seconds(second_per_grid_ts)


def _grid_per_run(run_type, image_grid_thw, video_grid_thw, device):
    """[K, 3] grid of every run in order (zeros for text), checking the counts."""
    grids = torch.zeros(run_type.numel(), 3, dtype=torch.long, device=device)
    for kind, name, grid in ((1, "image", image_grid_thw), (2, "video", video_grid_thw)):
        runs = run_type == kind
        n_runs = int(runs.sum())
        n_grids = 0 if grid is None else grid.shape[0]
        if n_runs != n_grids:
            raise ValueError(f"{n_runs} {name} placeholder blocks in input_ids but {n_grids} rows in {name}_grid_thw")
        if n_runs:
            grids[runs] = grid.to(device=device, dtype=torch.long)
    return grids


def _video_intervals(second_per_grid_ts, tokens_per_second: float, n_videos: int, device) -> torch.Tensor:
    """[V] temporal step of each Qwen2.5-VL video, in the dtype transformers computes it in.

    transformers multiplies `arange(t) * (tokens_per_second * s)` and truncates. The product's dtype
    follows `s`: a tensor keeps its dtype (float64 stays float64), a Python number (a list entry, or
    the default 1 when `second_per_grid_ts` is None) makes a float32 product of the float32-rounded
    double `tokens_per_second * s`. Matching that arithmetic is what keeps `floor` identical for
    fractional seconds.
    """
    if second_per_grid_ts is None:
        return torch.full((n_videos,), float(tokens_per_second), dtype=torch.float32, device=device)
    if isinstance(second_per_grid_ts, (list, tuple)) and not any(torch.is_tensor(x) for x in second_per_grid_ts):
        doubles = torch.tensor([tokens_per_second * float(x) for x in second_per_grid_ts], dtype=torch.float64)
        seconds = doubles.to(torch.float32)
    else:
        seconds = torch.as_tensor(second_per_grid_ts) if not isinstance(second_per_grid_ts, (list, tuple)) \
            else torch.stack([torch.as_tensor(x) for x in second_per_grid_ts])
        seconds = seconds.reshape(-1) * tokens_per_second  # keeps a floating dtype; integers -> float32
        if not seconds.is_floating_point():
            seconds = seconds.to(torch.float32)
    if seconds.numel() != n_videos:
        raise ValueError(f"{seconds.numel()} entries in second_per_grid_ts but {n_videos} video blocks in input_ids")
    return seconds.to(device)


def _interval_per_run(run_type, config, second_per_grid_ts, device) -> torch.Tensor | None:
    """[K] temporal step of each run (1 except Qwen2.5-VL videos), in transformers' arithmetic dtype;
    None when every step is 1 (the t position is then just the frame index)."""
    videos = run_type == 2
    if config.family != "qwen2_5_vl" or not bool(videos.any()):
        return None
    steps = _video_intervals(second_per_grid_ts, config.tokens_per_second, int(videos.sum()), device)
    interval = torch.ones(run_type.numel(), dtype=steps.dtype, device=device)
    interval[videos] = steps
    return interval


def _scaled_frames(frames: torch.Tensor, interval: torch.Tensor | None) -> torch.Tensor:
    """floor(frames * interval) in the interval's dtype, as an integer tensor of the frames' dtype."""
    if interval is None:
        return frames
    return (frames.to(interval.dtype) * interval).to(frames.dtype)


def get_rope_index(
    input_ids: torch.Tensor,
    config: MRopeConfig,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
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
        use_audio_in_video, audio_seqlens: Qwen3-Omni audio inputs (raw audio feature lengths).

    Returns:
        RopeIndex(position_ids [3, B, S] long, deltas [B, 1] long).

    Raises:
        ValueError: placeholder blocks vs grid rows, or tokens per block vs grid, disagree; a grid
        entry < 1 (or h, w not multiples of the merge size); seconds NaN, infinite or negative;
        non-integer ids or grids.

    Qwen3-Omni follows its own rule (rope/omni.py) and returns float positions, as its reference does.
    """
    check_rope_inputs(input_ids, config, image_grid_thw, video_grid_thw, attention_mask, second_per_grid_ts)
    if config.family == "qwen3_omni":
        from megatron_vlm_packing.rope.omni import omni_rope_index

        return RopeIndex(*omni_rope_index(
            input_ids, config, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            attention_mask=attention_mask, use_audio_in_video=use_audio_in_video, audio_seqlens=audio_seqlens,
            second_per_grids=second_per_grid_ts))
    device = input_ids.device
    batch, seq = input_ids.shape
    types = mm_token_type_ids if mm_token_type_ids is not None else token_types(input_ids, config)
    keep = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    if config.family == "qwen3_vl" and video_grid_thw is not None:  # one block per frame
        video_grid_thw = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
        video_grid_thw = torch.cat([torch.ones_like(video_grid_thw[:, :1]), video_grid_thw[:, 1:]], dim=1)
    flat = torch.nonzero(keep.reshape(-1)).flatten()  # [R], row-major: each row's real tokens in order
    rows = torch.div(flat, seq, rounding_mode="floor")
    kind = types.reshape(-1).index_select(0, flat).long()
    # Runs: consecutive real tokens of one row with one type (transformers' itertools.groupby).
    starts_run = torch.ones_like(kind, dtype=torch.bool)
    starts_run[1:] = (kind[1:] != kind[:-1]) | (rows[1:] != rows[:-1])
    run_of_token = torch.cumsum(starts_run, 0) - 1  # [R]
    run_first = torch.nonzero(starts_run).flatten()  # [K]
    run_len = torch.diff(run_first, append=torch.tensor([kind.numel()], device=device))
    run_type, run_row = kind[run_first], rows[run_first]
    grid = _grid_per_run(run_type, image_grid_thw, video_grid_thw, device)
    merge = config.spatial_merge_size
    gt, gh, gw = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge
    vision = run_type > 0
    expected = torch.where(vision, gt * gh * gw, run_len)
    if bool((expected != run_len).any()):
        k = int(torch.nonzero(expected != run_len)[0])
        raise ValueError(f"vision block {k} (row {int(run_row[k])}) has {int(run_len[k])} placeholder tokens but its "
                         f"grid {grid[k].tolist()} with merge {merge} needs {int(expected[k])}")
    interval = _interval_per_run(run_type, config, second_per_grid_ts, device)
    if config.text_offset == "max_hw":
        advance = torch.where(vision, torch.maximum(gh, gw), run_len)
    else:
        t_span = _scaled_frames((gt - 1).clamp_min(0), interval)
        advance = torch.where(vision, torch.maximum(t_span, torch.maximum(gh, gw) - 1) + 1, run_len)
    # Start of each run: exclusive cumsum of advances, restarted at every row's first run.
    run_start = torch.cumsum(advance, 0) - advance
    first_run_of_row = torch.ones_like(run_row, dtype=torch.bool)
    first_run_of_row[1:] = run_row[1:] != run_row[:-1]
    row_base = torch.cummax(torch.where(first_run_of_row, run_start, 0), 0).values
    run_start = run_start - row_base
    # Token positions from their run: one gather of a [K, 5] int32 per-run table (int32 halves the
    # memory traffic of the per-token arithmetic; positions fit easily).
    table = torch.stack([run_first, run_start, (gh * gw).clamp_min(1), gw.clamp_min(1), vision.long()], dim=1)
    per_token = table.to(torch.int32).index_select(0, run_of_token)  # [R, 5]
    first, start, hw, w, is_vision = per_token.unbind(1)
    k = torch.arange(kind.numel(), device=device, dtype=torch.int32) - first  # offset in run
    frame = torch.div(k, hw, rounding_mode="floor")
    in_frame = k - frame * hw
    row_in_frame = torch.div(in_frame, w, rounding_mode="floor")
    t_pos = _scaled_frames(frame, None if interval is None else interval.index_select(0, run_of_token)) + start
    vis = is_vision.bool()
    text_pos = k + start
    positions = torch.stack([torch.where(vis, t_pos, text_pos), torch.where(vis, row_in_frame + start, text_pos),
                             torch.where(vis, in_frame - row_in_frame * w + start, text_pos)])  # [3, R]
    out = torch.zeros(3, batch * seq, dtype=input_ids.dtype, device=device)
    out.index_copy_(1, flat, positions.to(input_ids.dtype))
    out = out.view(3, batch, seq)
    # Each row's largest position, from its runs (K values, not R): a run ends at start + its span.
    t_last = _scaled_frames((gt - 1).clamp_min(0), interval)
    run_max = run_start + torch.where(vision, torch.maximum(t_last, torch.maximum(gh, gw) - 1), run_len - 1)
    row_max = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(
        0, run_row, run_max, "amax", include_self=False)
    deltas = (row_max + 1 - keep.sum(1)).unsqueeze(1)
    return RopeIndex(out, deltas)
