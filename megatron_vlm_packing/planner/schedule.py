"""The epoch plan: every sample of an epoch in exactly one bin, bins in steps, steps split over ranks.

The planner walks a seeded permutation of the dataset in windows of about `window_steps` steps of
tokens. Each window is bin-packed (best fit decreasing over the slots `make_pack_plan` will use);
the fullest whole steps' worth of bins are kept and the rest of the window's samples lead the next
window, so only the last bins of the epoch can be underfull. With `balance=True` a window's bins
are grouped into steps by cost and each step's bins split over ranks longest-first (see
`balance`); with `balance=False` steps take bins in packing order and ranks take them in turn
(the unbalanced baseline the demo and benchmarks compare against).

The end of an epoch: leftover bins (fewer than a step) are split until every rank has the same
number of micro-batches (a shorter last step). When fewer samples remain than that needs, they
are carried to the next epoch (`EpochPlan.carried`), never dropped. With `samples_per_step`, only
the epoch's last, shorter step can be carried; a whole step whose samples cannot fill the same
number of non-empty bins on every rank is a ValueError. Whether an epoch could draw such a step is
decided from the dataset, before any epoch is planned (`check_steps_split`: `PackedBatchSampler`
at construction, `plan_epoch` for every epoch alike), not by the shuffle of the epoch that first
draws one. Every plan is checked to hold each input sample exactly once (bins plus carried) before it is returned.

The config and the plan's types live in `epoch_plan.py`, the bins and steps both ways build in
`stream_bins.py`, and the `samples_per_step` way in `fixed_samples.py`; this module plans the epoch.

Shape legend: N = samples, R = data-parallel ranks, M = micro-batches per rank per step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_vlm_packing.packing.bounds import checked_int
from megatron_vlm_packing.packing.row_fields import check_flags
from megatron_vlm_packing.planner.bins import balanced_fit, best_fit_decreasing
from megatron_vlm_packing.planner.epoch_plan import EpochPlan, PlannerConfig, Step  # noqa: F401 (Step: as before)
from megatron_vlm_packing.planner.fixed_samples import (  # noqa: F401 (check_steps_split: as before)
    check_steps_split, check_steps_split_of_columns, fixed_samples_steps,
)
from megatron_vlm_packing.planner.metadata import SampleTable
from megatron_vlm_packing.planner.progress import Progress
from megatron_vlm_packing.planner.stream_bins import (
    Columns, fit_costs, last_step_groups, make_bins, sample_columns, steps_from_bins,
)


def _pack_window(pos: np.ndarray, cols: Columns, stream: np.ndarray, config: PlannerConfig) -> list[list[int]]:
    """Pack the window's stream positions (cost-balanced fit or best fit decreasing); oversize alone."""
    slots = cols.slots[pos]
    capacity = config.layout.capacity
    over = config.layout.check_oversize(slots, stream[pos])
    fits = np.setdiff1d(np.arange(len(pos)), over, assume_unique=True) if len(over) else np.arange(len(pos))
    if config.balance:
        num_bins = max(1, -(-int(slots[fits].sum()) // capacity))
        groups = balanced_fit(slots[fits], fit_costs(pos[fits], cols, config), capacity, num_bins)
    else:
        groups = best_fit_decreasing(slots[fits], capacity)
    window = pos[fits].tolist()
    return [[window[p] for p in g] for g in groups] + [[int(pos[p])] for p in over]


def _keep_whole_steps(groups: list[list[int]], slots: np.ndarray, size: int, capacity: int):
    """The fullest whole steps' worth of groups (in packing order), and the positions of the others."""
    keep = (len(groups) // size) * size
    if keep == len(groups):
        return groups, np.zeros(0, np.int64)
    flat = np.fromiter((p for g in groups for p in g), dtype=np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    fill = np.minimum(np.add.reduceat(slots[flat], starts), capacity)
    order = np.argsort(-fill, kind="stable")
    kept = np.sort(order[:keep]).tolist()
    rest = [p for i in np.sort(order[keep:]).tolist() for p in groups[i]]
    return [groups[i] for i in kept], np.asarray(rest, dtype=np.int64)


def _tail_steps(groups: list[list[int]], cols: Columns, stream: np.ndarray, config: PlannerConfig, rng):
    """The epoch's last steps: whole steps, then (tail="short_step") a shorter step every rank shares
    equally, or (tail="carry") the rest carried to the next epoch."""
    size = config.bins_per_step
    whole = (len(groups) // size) * size
    steps = (steps_from_bins(make_bins(groups[:whole], cols, stream, config), config,
                              config.micro_batches_per_rank, rng) if whole else [])
    tail = groups[whole:]
    if not tail:
        return steps, ()
    last, per_rank = last_step_groups(tail, cols, config) if config.tail == "short_step" else (None, 0)
    if last is None:
        return steps, tuple(int(stream[p]) for g in tail for p in g)
    return steps + steps_from_bins(make_bins(last, cols, stream, config), config, per_rank, rng), ()


def plan_epoch(table: SampleTable, config: PlannerConfig, *, epoch: int = 0, carried_in: Sequence[int] = (),
               progress: bool = False) -> EpochPlan:
    """Plan one epoch: every sample of `table` (plus each occurrence in `carried_in`) in exactly one bin, or carried.

    Deterministic for (config.seed, epoch, carried_in). Raises ValueError for a sample without
    tokens, or one over capacity under oversize="error" (naming it and its size).
    """
    if len(table) == 0:  # an epoch of no micro-batches: a loop cycling epochs would spin forever
        raise ValueError("the sample table is empty: there is nothing to plan")
    checked_int(epoch, "epoch", least=0)
    check_flags(progress=progress)  # "no" drew the progress line
    carried_arr = np.asarray(carried_in)
    if carried_arr.ndim != 1:  # None, a string, [[1]]: a TypeError or numpy's error further on
        raise ValueError(f"carried_in must be a sequence of sample indices, got {carried_in!r}")
    if len(carried_arr) and (carried_arr.dtype.kind not in "iu" or carried_arr.min() < 0
                             or carried_arr.max() >= len(table)):
        # A negative index would be planned (and handed to the dataset) as sample N + i; one past
        # the end raised an IndexError; 1.5 was cast to sample 1.
        raise ValueError(f"carried_in must hold sample indices in [0, {len(table)}); got {carried_arr[:8].tolist()}")
    # A sample may be carried more than once: an epoch's carried samples lead the next epoch beside its own
    # permutation, so both occurrences can be left over together. Each occurrence is planned once.
    cols = sample_columns(table, config)
    check_steps_split_of_columns(cols, config)  # from the dataset: the same answer in every epoch
    rng = np.random.default_rng([config.seed, epoch])
    order = rng.permutation(len(table)) if config.shuffle else np.arange(len(table))
    stream = np.concatenate([np.asarray(carried_in, dtype=np.int64), order])
    cols = Columns(cols.tokens[stream], cols.slots[stream], cols.extra[stream])  # by stream position
    cum = np.cumsum(cols.slots)
    window_slots = config.window_steps * config.bins_per_step * config.layout.capacity
    bar = Progress(len(stream), enabled=progress, label=f"planning epoch {epoch}")
    if config.samples_per_step is not None:
        steps, carried = fixed_samples_steps(cols, stream, config, rng, bar)
        bar.close()
        return _checked(EpochPlan(epoch, tuple(steps), carried), stream)
    steps, pending, start = [], np.zeros(0, np.int64), 0
    while start < len(stream):
        base = int(cum[start - 1]) if start else 0
        budget = window_slots - int(cols.slots[pending].sum())
        stop = max(start + 1, int(np.searchsorted(cum, base + budget, side="right")))
        pos = np.concatenate([pending, np.arange(start, stop)])
        start = stop
        groups = _pack_window(pos, cols, stream, config)
        if start >= len(stream):
            last, carried = _tail_steps(groups, cols, stream, config, rng)
            bar.close()
            return _checked(EpochPlan(epoch, tuple(steps + last), carried), stream)
        kept, pending = _keep_whole_steps(groups, cols.slots, config.bins_per_step, config.layout.capacity)
        if kept:
            steps.extend(steps_from_bins(make_bins(kept, cols, stream, config), config,
                                          config.micro_batches_per_rank, rng))
        bar.update(start - len(pending))
    bar.close()
    return _checked(EpochPlan(epoch, tuple(steps), ()), stream)


def _checked(plan: EpochPlan, stream: np.ndarray) -> EpochPlan:
    """`plan`, after checking that its bins and carried samples hold every sample of `stream` exactly
    as often as the stream does (an internal invariant: a planner bug raises instead of dropping or
    repeating samples silently). O(N log N)."""
    out = np.fromiter((s for b in plan.bins() for s in b.samples), dtype=np.int64)
    out = np.sort(np.concatenate([out, np.asarray(plan.carried, dtype=np.int64)]))
    want = np.sort(stream)
    if len(out) != len(want) or not np.array_equal(out, want):
        lost = np.setdiff1d(want, out).tolist()
        raise RuntimeError(f"planner bug: epoch {plan.epoch} plans {len(out)} sample slots for {len(want)} "
                           f"inputs (e.g. lost {lost[:8]}); please report it with the config and seed")
    return plan
