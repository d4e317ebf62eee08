"""Planning with `samples_per_step`: steps of a fixed number of samples, each in as many bins as it needs.

Each step's samples are split into R * m non-empty bins (m per rank, the fewest their slots allow);
only the epoch's last, shorter step may be carried to the next epoch. Whether some epoch could draw
a step that cannot be split over the ranks is decided from the dataset before any epoch is planned
(`check_steps_split`: `PackedBatchSampler` at construction, `plan_epoch` for every epoch alike), not
by the shuffle of the epoch that first draws one. A module of its own: `schedule.plan_epoch` hands
a config with `samples_per_step` here, and plans every other by windows.

Shape legend: N = samples, R = data-parallel ranks, n = samples_per_step.
"""

from __future__ import annotations

import numpy as np

from megatron_vlm_packing.planner.bins import best_fit_decreasing
from megatron_vlm_packing.planner.epoch_plan import PlannerConfig
from megatron_vlm_packing.planner.metadata import SampleTable
from megatron_vlm_packing.planner.progress import Progress
from megatron_vlm_packing.planner.stream_bins import (
    Columns, last_step_groups, make_bins, sample_columns, steps_from_bins,
)


def fixed_samples_steps(cols: Columns, stream: np.ndarray, config: PlannerConfig, rng, bar: Progress):
    """Steps of exactly `samples_per_step` samples, micro-batches as needed; the last, shorter one
    runs (tail="short_step") or is carried (tail="carry", or fewer samples than its bins need).

    Only the epoch's last, shorter step may be carried: a whole step whose samples cannot fill an
    equal number of non-empty bins per rank raises (`_unsplittable_step`), never ends the epoch."""
    steps, n = [], config.samples_per_step
    for start in range(0, len(stream), n):
        positions = np.arange(start, min(start + n, len(stream)))
        partial = len(positions) < n
        if partial and config.tail == "carry":
            return steps, tuple(int(stream[p]) for p in positions)
        config.layout.check_oversize(cols.slots[positions], stream[positions])
        last, per_rank = _split_step(positions, cols, config)
        if last is None and partial:
            return steps, tuple(int(stream[p]) for p in positions)
        if last is None:
            raise _unsplittable_step(len(steps), positions, cols, stream, config, per_rank)
        steps.extend(steps_from_bins(make_bins(last, cols, stream, config), config, per_rank, rng))
        bar.update(positions[-1] + 1)
    return steps, ()


def _split_step(positions: np.ndarray, cols: Columns, config: PlannerConfig):
    """One step's samples (stream positions) in R * m non-empty bins: (groups, m), groups None when they
    need more bins than they are samples. m is the fewest per rank their slots allow, more if the fit needs it."""
    groups = [[int(p) for p in positions]]  # last_step_groups re-packs them into R * m bins
    slots, capacity = cols.slots[positions], config.layout.capacity
    min_bins = -(-int(slots[slots <= capacity].sum()) // capacity) + int((slots > capacity).sum())
    per_rank = -(-min_bins // config.dp_size)  # oversize samples: a bin each, however long
    return last_step_groups(groups, cols, config, per_rank=max(1, per_rank))


def _copies_in_a_step(num_samples: int, samples_per_step: int) -> int:
    """How often one sample can come in one step of a plan whose epochs follow each other.

    A stream is the samples carried in (fewer than a step), then the epoch's permutation. When the
    dataset divides into whole steps nothing is ever carried: once. Otherwise a carried sample can meet
    its own occurrence in the first step: twice, as long as the permutation alone fills a step (the
    carried part then comes from the permutation's end, each sample once); a dataset smaller than a
    step can carry a sample again and again: bounded by the step."""
    if num_samples % samples_per_step == 0:
        return 1
    return 2 if num_samples >= samples_per_step else samples_per_step


def _largest_step(slots: np.ndarray, n: int, copies: int) -> np.ndarray:
    """[n] sample indices (N * copies >= n) of the n largest samples, each at most `copies` times: distinct
    samples before a repeat of one of equal size, the largest first."""
    order = np.argsort(-slots, kind="stable")[:n]
    candidates = np.tile(order, copies)
    repeat = np.repeat(np.arange(copies), len(order))
    return candidates[np.lexsort((repeat, -slots[candidates]))][:n]


def check_steps_split_of_columns(cols: Columns, config: PlannerConfig) -> None:
    """ValueError when a step of `samples_per_step` samples that some epoch can draw cannot be split over
    the ranks: decided from the dataset, not from one epoch's shuffle (which met such a step first in
    whatever epoch drew it, hours into a run).

    A step runs R * m micro-batches of at least one sample each. With samples_per_step a multiple of R
    every step splits (at most one bin per sample). Otherwise a step holds at most R * (n // R) bins,
    and the worst step is its n largest samples (`_copies_in_a_step` times each): the planner's own
    split is tried on them. Oversize samples under oversize="error" are left to the plan's error naming them.
    """
    n, dp, capacity = config.samples_per_step, config.dp_size, config.layout.capacity
    if n is None or n % dp == 0:
        return
    if config.layout.oversize == "error" and (cols.slots > capacity).any():
        return
    worst = _largest_step(cols.slots, n, _copies_in_a_step(len(cols.slots), n))  # n of them: N * copies >= n
    groups, _ = _split_step(np.arange(n), Columns(cols.tokens[worst], cols.slots[worst], cols.extra[worst]), config)
    if groups is not None:
        return
    most = dp * (n // dp)
    slots = cols.slots[worst]
    need = len(best_fit_decreasing(slots[slots <= capacity], capacity)) + int((slots > capacity).sum())
    named = list(dict.fromkeys(worst.tolist()))
    ids = ", ".join(map(str, named[:8])) + (" ..." if len(named) > 8 else "")
    twice = "" if len(named) == n else "; a sample carried into the next epoch can come again in the same step"
    big = int((slots > capacity // 2).sum())
    raise ValueError(
        f"samples_per_step={n} is not a multiple of dp_size={dp}: a step runs at most {most} micro-batches "
        f"({most // dp} per rank), but the {n} largest samples the dataset can put in one step (samples {ids}{twice}) "
        f"need {need} bins of capacity {capacity} ({big} of them take more than half a bin), and an epoch's "
        f"shuffle can draw them together; use a samples_per_step that is a multiple of dp_size "
        f"({most} or {most + dp}: every step then splits) or raise the capacity")


def check_steps_split(table: SampleTable, config: PlannerConfig) -> None:
    """ValueError if some epoch of `table` under `config` could draw a step of `samples_per_step` samples
    that cannot be split over the ranks (see `check_steps_split_of_columns`); None when every step splits. O(N log N)."""
    if config.samples_per_step is not None and config.samples_per_step % config.dp_size:
        check_steps_split_of_columns(sample_columns(table, config), config)


def _unsplittable_step(index: int, positions: np.ndarray, cols: Columns, stream: np.ndarray,
                       config: PlannerConfig, per_rank: int) -> ValueError:
    """The error for a whole step of `samples_per_step` samples that need more bins than it has samples."""
    ids = ", ".join(str(int(stream[p])) for p in positions[:8]) + (" ..." if len(positions) > 8 else "")
    capacity = config.layout.capacity
    big = int((cols.slots[positions] > capacity // 2).sum())
    return ValueError(
        f"samples_per_step={config.samples_per_step}: step {index} (samples {ids}) needs "
        f"{per_rank} micro-batches on each of dp_size={config.dp_size} ranks ({per_rank * config.dp_size} bins of "
        f"capacity {capacity}; {big} of its samples take more than half a bin), more bins than it has "
        f"samples; raise samples_per_step (to at least {per_rank * config.dp_size}) or the capacity")
