"""Bins and steps made from an epoch's sample stream: the pieces both ways of planning share.

The planner reads each sample's tokens, slots and extra cost as columns indexed by stream position
(`Columns`, `sample_columns`); groups of positions become `Bin`s (`make_bins`), whole steps' worth of
bins become `Step`s balanced over the ranks or in order (`steps_from_bins`), and a step's leftover
samples are re-packed into as many non-empty bins as every rank can share (`last_step_groups`).
Used by the windows of `schedule.plan_epoch` and by the fixed-samples steps of `fixed_samples.py`.

Shape legend: N = samples, K = samples of a group, R = data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_vlm_packing.planner.balance import assign_to_ranks, group_into_steps
from megatron_vlm_packing.planner.bins import Bin, balanced_fit, best_fit_decreasing, split_to_count
from megatron_vlm_packing.planner.cost import checked_extra_costs
from megatron_vlm_packing.planner.epoch_plan import PlannerConfig, Step
from megatron_vlm_packing.planner.metadata import SampleTable, count_array


@dataclass(frozen=True)
class Columns:
    """Per-sample columns the planner reads (all [N])."""

    tokens: np.ndarray
    slots: np.ndarray
    extra: np.ndarray


def sample_columns(table: SampleTable, config: PlannerConfig) -> Columns:
    # Whole numbers only: a hook returning 7.5 tokens was cast to 7 and the bin laid out too short.
    tokens = count_array(config.expanded_tokens(table), "expanded_tokens").reshape(-1)
    if len(tokens) != len(table):
        raise ValueError(f"expanded_tokens returned {len(tokens)} counts for {len(table)} samples")
    if len(tokens) and tokens.min() < 1:
        empty = np.flatnonzero(tokens < 1)
        raise ValueError(f"{len(empty)} sample(s) have no tokens (e.g. sample {int(empty[0])}): a pack "
                         f"cannot hold an empty document")
    return Columns(tokens, config.layout.slot_sizes(tokens), checked_extra_costs(config.cost_model, table, tokens))


def fit_costs(positions: np.ndarray, cols: Columns, config: PlannerConfig) -> np.ndarray:
    """[K] the part of each sample's cost that differs between bins: under static shapes every bin
    pays lm_linear * capacity, so only the extras; otherwise its tokens' GEMMs too."""
    extra = cols.extra[positions]
    if config.layout.static_shapes:
        return extra
    return extra + config.cost_model.lm_linear * cols.slots[positions]


def make_bins(groups: list[list[int]], cols: Columns, stream: np.ndarray, config: PlannerConfig) -> list[Bin]:
    """Bins from lists of stream positions (`cols` is indexed by stream position)."""
    if not groups:
        return []
    flat = np.fromiter((p for g in groups for p in g), dtype=np.int64)
    starts = np.cumsum([0] + [len(g) for g in groups[:-1]])
    slot_sums = np.add.reduceat(cols.slots[flat], starts).tolist()
    extra_sums = np.add.reduceat(cols.extra[flat], starts)
    physical = [config.layout.physical(n) for n in slot_sums]
    costs = config.cost_model.bin_cost(np.asarray(physical), extra_sums).tolist()
    samples, tokens = stream[flat].tolist(), cols.tokens[flat].tolist()
    bins, at = [], 0
    for group, phys, cost in zip(groups, physical, costs):
        bins.append(Bin(tuple(samples[at:at + len(group)]), tuple(tokens[at:at + len(group)]), phys, cost))
        at += len(group)
    return bins



def steps_from_bins(bins: list[Bin], config: PlannerConfig, per_rank: int, rng) -> list[Step]:
    """Whole steps of R * per_rank bins from `bins` (a multiple of that), balanced or in order."""
    size = config.dp_size * per_rank
    costs = np.asarray([b.cost for b in bins])
    if not config.balance:
        chunks = [np.arange(i, i + size) for i in range(0, len(bins), size)]
        return [Step(tuple(tuple(bins[c[j]] for j in range(r, size, config.dp_size))
                           for r in range(config.dp_size))) for c in chunks]
    steps = []
    for chunk in group_into_steps(costs, size):
        ranks = assign_to_ranks(costs[chunk], config.dp_size, per_rank)
        steps.append(Step(tuple(tuple(bins[chunk[p]] for p in rank) for rank in ranks)))
    order = rng.permutation(len(steps))
    return [steps[i] for i in order]


def last_step_groups(tail: list[list[int]], cols: Columns, config: PlannerConfig, per_rank: int | None = None):
    """Re-pack samples into R * m bins (m per rank: `per_rank`, or as many as `tail` had bins, per
    rank); None if there are fewer samples than bins."""
    positions = np.asarray([p for g in tail for p in g], dtype=np.int64)
    per_rank = per_rank or -(-len(tail) // config.dp_size)
    count = config.dp_size * per_rank
    if len(positions) < count:
        return None, per_rank
    slots, capacity = cols.slots[positions], config.layout.capacity
    over = np.flatnonzero(slots > capacity)  # oversize="own_bin" (the callers checked): one of the R * m each
    fits = np.setdiff1d(np.arange(len(positions)), over, assume_unique=True)
    groups = best_fit_decreasing(slots[fits], capacity)
    if config.balance and len(groups) <= count - len(over):  # balanced within the bins the oversize ones leave
        balanced = balanced_fit(slots[fits], fit_costs(positions[fits], cols, config), capacity,
                                max(1, count - len(over)))
        groups = balanced if len(balanced) <= count - len(over) else groups  # else the tighter fit
    groups = [[int(fits[p]) for p in g] for g in groups] + [[int(p)] for p in over]
    if len(groups) > count:  # the greedy needed more bins: more per rank
        per_rank = -(-len(groups) // config.dp_size)
        count = config.dp_size * per_rank
    groups = split_to_count(groups, count, slots)
    if groups is None:
        return None, per_rank
    return [[int(positions[p]) for p in g] for g in groups], per_rank
