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

Shape legend: N = samples, R = data-parallel ranks, M = micro-batches per rank per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_vlm_packing.packing.bounds import checked_int, is_int
from megatron_vlm_packing.packing.row_fields import check_flags
from megatron_vlm_packing.planner.balance import assign_to_ranks, group_into_steps, imbalance
from megatron_vlm_packing.planner.bins import Bin, BinLayout, balanced_fit, best_fit_decreasing, split_to_count
from megatron_vlm_packing.planner.cost import CostModel, check_cost_model, checked_extra_costs
from megatron_vlm_packing.planner.metadata import ExpandedTokens, SampleTable, TokenCounter, count_array
from megatron_vlm_packing.planner.progress import Progress


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What the planner needs besides the samples.

    Attributes:
        layout: bin capacity, alignment, static shapes, oversize policy.
        dp_size: data-parallel ranks R.
        micro_batches_per_rank: M, bins each rank runs per optimizer step.
        window_steps: steps planned together; larger balances better, drifts further from random.
        seed: seeds the permutation (with the epoch) and the order of steps in a window.
        shuffle: permute the dataset each epoch (False: dataset order).
        balance: balance cost over ranks (False: the unbalanced baseline).
        tail: the epoch's last samples (less than a step): "short_step" (one step with fewer
            micro-batches per rank, bins less full) or "carry" (they lead the next epoch; those of
            the last epoch a run trains are never trained: `PackedBatchSampler.carried_over()` names them).
        samples_per_step: a fixed number of samples per optimizer step (what sample-based LR
            schedules assume); each step then runs as many micro-batches per rank as its samples
            need (variable), spread over R * m bins of balanced cost (bins are then less full: pair
            it with dynamic shapes). None: a fixed number of bins
            (`micro_batches_per_rank`) per step and a variable number of samples.
        cost_model: per-bin cost; expanded_tokens: tokens per sample in the space attention sees.
    """

    layout: BinLayout
    dp_size: int = 1
    micro_batches_per_rank: int = 1
    window_steps: int = 8
    seed: int = 0
    shuffle: bool = True
    balance: bool = True
    tail: str = "short_step"
    samples_per_step: int | None = None
    cost_model: CostModel = field(default_factory=CostModel.qwen2_5_vl_7b)
    expanded_tokens: ExpandedTokens = field(default_factory=TokenCounter)

    def __post_init__(self) -> None:
        # Checked here, not as an AttributeError / TypeError at planning; True was 1 and "no" a truthy flag.
        if not isinstance(self.layout, BinLayout):
            raise ValueError(f"layout must be a BinLayout, got {type(self.layout).__name__}")
        check_cost_model(self.cost_model)
        if not callable(self.expanded_tokens):
            raise ValueError(f"expanded_tokens must be callable (table -> [N] tokens), got "
                             f"{type(self.expanded_tokens).__name__}")
        check_flags(shuffle=self.shuffle, balance=self.balance)
        for name in ("dp_size", "micro_batches_per_rank", "window_steps"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy int kept as a Python int
        if self.samples_per_step is not None and (not is_int(self.samples_per_step)
                                                  or self.samples_per_step < self.dp_size):
            raise ValueError(f"samples_per_step must be an int >= dp_size={self.dp_size}, got {self.samples_per_step!r}")
        if self.samples_per_step is not None:
            object.__setattr__(self, "samples_per_step", int(self.samples_per_step))
        if not is_int(self.seed) or self.seed < 0:
            # numpy's generator takes no negative seed: the error came at planning, naming no field
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.tail not in ("short_step", "carry"):
            raise ValueError(f"tail must be 'short_step' or 'carry', got {self.tail!r}")

    @property
    def bins_per_step(self) -> int:
        return self.dp_size * self.micro_batches_per_rank


@dataclass(frozen=True)
class Step:
    """One optimizer step: `ranks[r]` is the tuple of bins (micro-batches) rank r runs."""

    ranks: tuple[tuple[Bin, ...], ...]

    def rank_costs(self) -> np.ndarray:
        """[R] float64."""
        return np.asarray([sum(b.cost for b in bins) for bins in self.ranks], dtype=np.float64)

    @property
    def imbalance(self) -> float:
        return imbalance(self.rank_costs())


@dataclass(frozen=True)
class EpochPlan:
    """Steps of one epoch, and the samples it hands to the next (its last ones, fewer than a step needs)."""

    epoch: int
    steps: tuple[Step, ...]
    carried: tuple[int, ...] = ()

    def bins(self) -> list[Bin]:
        return [b for step in self.steps for bins in step.ranks for b in bins]

    def micro_batches(self, rank: int) -> list[Bin]:
        """The bins rank `rank` runs this epoch, in order."""
        return [b for step in self.steps for b in step.ranks[rank]]

    def fill(self) -> float:
        """Real tokens / physical tokens over every bin."""
        bins = self.bins()
        return sum(b.real_tokens for b in bins) / max(1, sum(b.physical for b in bins))


@dataclass(frozen=True)
class _Columns:
    """Per-sample columns the planner reads (all [N])."""

    tokens: np.ndarray
    slots: np.ndarray
    extra: np.ndarray


def _columns(table: SampleTable, config: PlannerConfig) -> _Columns:
    # Whole numbers only: a hook returning 7.5 tokens was cast to 7 and the bin laid out too short.
    tokens = count_array(config.expanded_tokens(table), "expanded_tokens").reshape(-1)
    if len(tokens) != len(table):
        raise ValueError(f"expanded_tokens returned {len(tokens)} counts for {len(table)} samples")
    if len(tokens) and tokens.min() < 1:
        empty = np.flatnonzero(tokens < 1)
        raise ValueError(f"{len(empty)} sample(s) have no tokens (e.g. sample {int(empty[0])}): a pack "
                         f"cannot hold an empty document")
    return _Columns(tokens, config.layout.slot_sizes(tokens), checked_extra_costs(config.cost_model, table, tokens))


def _fit_costs(positions: np.ndarray, cols: _Columns, config: PlannerConfig) -> np.ndarray:
    """[K] the part of each sample's cost that differs between bins: under static shapes every bin
    pays lm_linear * capacity, so only the extras; otherwise its tokens' GEMMs too."""
    extra = cols.extra[positions]
    if config.layout.static_shapes:
        return extra
    return extra + config.cost_model.lm_linear * cols.slots[positions]


def _make_bins(groups: list[list[int]], cols: _Columns, stream: np.ndarray, config: PlannerConfig) -> list[Bin]:
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


def _pack_window(pos: np.ndarray, cols: _Columns, stream: np.ndarray, config: PlannerConfig) -> list[list[int]]:
    """Pack the window's stream positions (cost-balanced fit or best fit decreasing); oversize alone."""
    slots = cols.slots[pos]
    capacity = config.layout.capacity
    over = config.layout.check_oversize(slots, stream[pos])
    fits = np.setdiff1d(np.arange(len(pos)), over, assume_unique=True) if len(over) else np.arange(len(pos))
    if config.balance:
        num_bins = max(1, -(-int(slots[fits].sum()) // capacity))
        groups = balanced_fit(slots[fits], _fit_costs(pos[fits], cols, config), capacity, num_bins)
    else:
        groups = best_fit_decreasing(slots[fits], capacity)
    window = pos[fits].tolist()
    return [[window[p] for p in g] for g in groups] + [[int(pos[p])] for p in over]


def _steps_from_bins(bins: list[Bin], config: PlannerConfig, per_rank: int, rng) -> list[Step]:
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


def _last_step_groups(tail: list[list[int]], cols: _Columns, config: PlannerConfig, per_rank: int | None = None):
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
        balanced = balanced_fit(slots[fits], _fit_costs(positions[fits], cols, config), capacity,
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


def _fixed_samples_steps(cols: _Columns, stream: np.ndarray, config: PlannerConfig, rng, bar: Progress):
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
        steps.extend(_steps_from_bins(_make_bins(last, cols, stream, config), config, per_rank, rng))
        bar.update(positions[-1] + 1)
    return steps, ()


def _split_step(positions: np.ndarray, cols: _Columns, config: PlannerConfig):
    """One step's samples (stream positions) in R * m non-empty bins: (groups, m), groups None when they
    need more bins than they are samples. m is the fewest per rank their slots allow, more if the fit needs it."""
    groups = [[int(p) for p in positions]]  # _last_step_groups re-packs them into R * m bins
    slots, capacity = cols.slots[positions], config.layout.capacity
    min_bins = -(-int(slots[slots <= capacity].sum()) // capacity) + int((slots > capacity).sum())
    per_rank = -(-min_bins // config.dp_size)  # oversize samples: a bin each, however long
    return _last_step_groups(groups, cols, config, per_rank=max(1, per_rank))


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


def _check_steps_split(cols: _Columns, config: PlannerConfig) -> None:
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
    groups, _ = _split_step(np.arange(n), _Columns(cols.tokens[worst], cols.slots[worst], cols.extra[worst]), config)
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
    that cannot be split over the ranks (see `_check_steps_split`); None when every step splits. O(N log N)."""
    if config.samples_per_step is not None and config.samples_per_step % config.dp_size:
        _check_steps_split(_columns(table, config), config)


def _unsplittable_step(index: int, positions: np.ndarray, cols: _Columns, stream: np.ndarray,
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


def _tail_steps(groups: list[list[int]], cols: _Columns, stream: np.ndarray, config: PlannerConfig, rng):
    """The epoch's last steps: whole steps, then (tail="short_step") a shorter step every rank shares
    equally, or (tail="carry") the rest carried to the next epoch."""
    size = config.bins_per_step
    whole = (len(groups) // size) * size
    steps = (_steps_from_bins(_make_bins(groups[:whole], cols, stream, config), config,
                              config.micro_batches_per_rank, rng) if whole else [])
    tail = groups[whole:]
    if not tail:
        return steps, ()
    last, per_rank = _last_step_groups(tail, cols, config) if config.tail == "short_step" else (None, 0)
    if last is None:
        return steps, tuple(int(stream[p]) for g in tail for p in g)
    return steps + _steps_from_bins(_make_bins(last, cols, stream, config), config, per_rank, rng), ()


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
    cols = _columns(table, config)
    _check_steps_split(cols, config)  # from the dataset: the same answer in every epoch
    rng = np.random.default_rng([config.seed, epoch])
    order = rng.permutation(len(table)) if config.shuffle else np.arange(len(table))
    stream = np.concatenate([np.asarray(carried_in, dtype=np.int64), order])
    cols = _Columns(cols.tokens[stream], cols.slots[stream], cols.extra[stream])  # by stream position
    cum = np.cumsum(cols.slots)
    window_slots = config.window_steps * config.bins_per_step * config.layout.capacity
    bar = Progress(len(stream), enabled=progress, label=f"planning epoch {epoch}")
    if config.samples_per_step is not None:
        steps, carried = _fixed_samples_steps(cols, stream, config, rng, bar)
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
            steps.extend(_steps_from_bins(_make_bins(kept, cols, stream, config), config,
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
