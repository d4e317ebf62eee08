"""The Qwen-VL families' mRoPE rule, vectorised over tokens (`rope.index` checks the inputs, then calls it).

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

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_vlm_packing.rope.index import QueuedRopeIndex


def grid_per_run(run_type, image_grid_thw, video_grid_thw, device, *, video_frames: bool = False
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """([K, 3] grid of every run in order (zeros for text and for blocks beyond the grid's rows),
    [image blocks, video blocks] as 0-dim device counts for the caller's one read). Reads nothing:
    the k-th block of a kind takes row k of its grid through a running count. `video_frames`
    (Qwen3-VL): every video block is one frame, so block k takes grid row (1, h, w) of the video
    whose cumulative frame count first exceeds k (`searchsorted`, no host-sized repeat)."""
    grids = torch.zeros(run_type.numel(), 3, dtype=torch.long, device=device)
    counts = []
    for kind, grid in ((1, image_grid_thw), (2, video_grid_thw)):
        runs = run_type == kind
        counts.append(runs.sum())
        if grid is not None and grid.shape[0]:
            grid = grid.to(device=device, dtype=torch.long)
            ordinal = torch.cumsum(runs, 0) - 1
            if kind == 2 and video_frames:
                ordinal = torch.searchsorted(torch.cumsum(grid[:, 0], 0), ordinal, right=True)
                grid = torch.cat([torch.ones_like(grid[:, :1]), grid[:, 1:]], dim=1)
            table = torch.cat([grid, grids.new_zeros(1, 3)])  # row n: none
            grids = torch.where(runs[:, None], table.index_select(0, ordinal.clamp(0, grid.shape[0])), grids)
    return grids, counts


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


def _interval_per_run(run_type, config, second_per_grid_ts, n_videos: int, device) -> torch.Tensor | None:
    """[K] temporal step of each run (1 except Qwen2.5-VL videos), in transformers' arithmetic dtype;
    None when every step is 1 (the t position is then just the frame index). `n_videos`: video
    blocks (host int, already read)."""
    videos = run_type == 2
    if config.family != "qwen2_5_vl" or not n_videos:
        return None
    steps = _video_intervals(second_per_grid_ts, config.tokens_per_second, n_videos, device)
    ordinal = (torch.cumsum(videos, 0) - 1).clamp(0, n_videos - 1)
    return torch.where(videos, steps.index_select(0, ordinal), torch.ones((), dtype=steps.dtype, device=device))


def _scaled_frames(frames: torch.Tensor, interval: torch.Tensor | None) -> torch.Tensor:
    """floor(frames * interval) in the interval's dtype, as a long tensor (the frames as given without an
    interval). Long, not the frames' dtype: int32 frames times a long interval pass 2**31 (transformers keeps
    them int64), and the truncation to int32 wrapped them negative."""
    if interval is None:
        return frames
    return (frames.to(interval.dtype) * interval).long()


def token_runs(keep: torch.Tensor, types: torch.Tensor, batch: int, seq: int):
    """Real tokens and their runs, padded to N = B*S so that no size is read back.

    Returns (flat [N] flat index of each real token then N for fills, kind [N] (-1 for fills),
    run_of_token [N], run_first [N], run_len [N], run_type [N], run_row [N]): entries past the K
    runs are empty text runs of the virtual row B; the fills form one run of kind -1 in row B.
    """
    n = batch * seq
    flat = torch.nonzero_static(keep.reshape(-1), size=n, fill_value=n).flatten()  # [N], row-major
    real = flat < n
    at = flat.clamp(max=max(n - 1, 0))
    rows = torch.where(real, torch.div(at, seq, rounding_mode="floor"), batch)
    kind = torch.where(real, types.reshape(-1).index_select(0, at).long(), -1)
    # Runs: consecutive real tokens of one row with one type (transformers' itertools.groupby).
    starts_run = torch.ones_like(kind, dtype=torch.bool)
    starts_run[1:] = (kind[1:] != kind[:-1]) | (rows[1:] != rows[:-1])
    run_of_token = torch.cumsum(starts_run, 0) - 1  # [N]
    run_first = torch.nonzero_static(starts_run, size=n, fill_value=n).flatten()  # [N]: K starts, then N
    run_len = torch.diff(run_first, append=run_first.new_full((1,), n))
    used = run_first < n
    first = run_first.clamp(max=max(n - 1, 0))
    run_type = torch.where(used, kind.index_select(0, first), 0)
    run_row = torch.where(used, rows.index_select(0, first), batch)
    return flat, kind, run_of_token, run_first, run_len, run_type, run_row


def run_positions(queued: QueuedRopeIndex, n_videos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, B, S] ids' dtype, deltas [B, 1] long) of checked inputs (`n_videos`: video blocks, a
    host int); `rope.index.finish_rope_index` wraps them in a `RopeIndex`."""
    config, input_ids, keep = queued.config, queued.input_ids, queued.keep
    device, merge = input_ids.device, config.spatial_merge_size
    batch, seq = input_ids.shape
    flat, kind, run_of_token, run_first, run_len, run_type, run_row = queued.runs
    grid, second_per_grid_ts = queued.grid, queued.second_per_grid_ts
    gt, gh, gw = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge
    vision = run_type > 0
    interval = _interval_per_run(run_type, config, second_per_grid_ts, n_videos, device)
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
    # memory traffic of the per-token arithmetic; offsets and grids of a block fit, its start does without
    # Qwen2.5-VL videos). Video t positions step by tokens_per_second * seconds and may pass 2**31 (so may
    # text resuming after them with text_offset="max_position"): with an interval the table stays int64.
    table = torch.stack([run_first, run_start, (gh * gw).clamp_min(1), gw.clamp_min(1), vision.long()], dim=1)
    per_token = table.to(torch.int32 if interval is None else torch.long).index_select(0, run_of_token)  # [N, 5]
    first, start, hw, w, is_vision = per_token.unbind(1)
    k = torch.arange(kind.numel(), device=device, dtype=per_token.dtype) - first  # offset in run
    frame = torch.div(k, hw, rounding_mode="floor")
    in_frame = k - frame * hw
    row_in_frame = torch.div(in_frame, w, rounding_mode="floor")
    t_pos = _scaled_frames(frame, None if interval is None else interval.index_select(0, run_of_token)) + start
    vis = is_vision.bool()
    text_pos = k + start
    positions = torch.stack([torch.where(vis, t_pos, text_pos), torch.where(vis, row_in_frame + start, text_pos),
                             torch.where(vis, in_frame - row_in_frame * w + start, text_pos)])  # [3, R]
    out = torch.zeros(3, batch * seq + 1, dtype=input_ids.dtype, device=device)  # column B*S: the fill slots
    out.index_copy_(1, flat, positions.to(input_ids.dtype))
    out = out[:, :batch * seq].reshape(3, batch, seq)
    # Each row's largest position, from its runs (K values, not R): a run ends at start + its span.
    t_last = _scaled_frames((gt - 1).clamp_min(0), interval)
    run_max = run_start + torch.where(vision, torch.maximum(t_last, torch.maximum(gh, gw) - 1), run_len - 1)
    row_max = torch.zeros(batch + 1, dtype=torch.long, device=device).scatter_reduce(
        0, run_row, run_max, "amax", include_self=False)[:batch]  # row B: fill slots and unused runs
    deltas = (row_max + 1 - keep.sum(1)).unsqueeze(1)
    return out, deltas
