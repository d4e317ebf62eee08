"""Bins: sets of samples that become one packed micro-batch of a physical capacity.

A bin's size is counted exactly as `make_pack_plan` lays it out: each sample takes
round_up(tokens, multiples.segment) slots, and the pack's total is rounded up to `multiples.total`
(or is `capacity` itself under static shapes, `pad_to=capacity`). So a bin that fits here is one
that `pack_batch(..., pad_to=capacity)` accepts, and `Bin.plan` is the plan it will build.

Tokens are counted in the space attention sees (after image expansion; see `metadata.TokenCounter`
and `metadata.llava_tokens`).

Shape legend: N = samples, B = bins.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.plan import PackMultiples, PackPlan, make_pack_plan, round_up
from megatron_vlm_packing.packing.row_fields import check_flags

OVERSIZE_POLICIES = ("error", "own_bin")


@dataclass(frozen=True, kw_only=True)
class BinLayout:
    """The physical shape of a bin.

    Attributes:
        capacity: physical tokens per bin (the `pad_to` of a static pack); a multiple of `multiples.total`.
        multiples: alignment from `PackMultiples.for_parallel(tp_size=, cp_size=, sequence_parallel=, fp8=)`.
        static_shapes: every bin is exactly `capacity` tokens (PP > 1, EP > 1, CUDA graphs); otherwise
            a bin is its aligned length and `capacity` is only an upper bound (memory).
        oversize: a sample longer than `capacity`: "error" (ValueError naming it) or "own_bin" (it
            gets a bin of its own, rounded up to the total multiple: nothing is truncated).
    """

    capacity: int
    multiples: PackMultiples = PackMultiples()
    static_shapes: bool = True
    oversize: str = "error"

    def __post_init__(self) -> None:
        if not isinstance(self.multiples, PackMultiples):  # else an AttributeError ('total') below
            raise ValueError(f"multiples must be a PackMultiples (PackMultiples.for_parallel(...)), "
                             f"got {type(self.multiples).__name__}")
        check_flags(static_shapes=self.static_shapes)  # "no" padded every bin to the capacity
        if not is_int(self.capacity):
            # 4096.0 was accepted and made every bin's physical length a float
            raise ValueError(f"capacity must be an int, got {self.capacity!r}")
        object.__setattr__(self, "capacity", int(self.capacity))  # a numpy int as its int
        if self.capacity < 1 or self.capacity % self.multiples.total:
            raise ValueError(f"capacity={self.capacity} must be a positive multiple of the total multiple "
                             f"{self.multiples.total} (segment {self.multiples.segment})")
        if self.capacity >= 2**31:  # else bins of that size were refused only when the loader packed them
            raise ValueError(f"capacity={self.capacity} must be below 2**31: a pack's cu_seqlens are int32")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize must be one of {OVERSIZE_POLICIES}, got {self.oversize!r}")

    def slot_sizes(self, tokens: np.ndarray) -> np.ndarray:
        """[N] int64: slots each sample takes in a pack (tokens rounded up to the segment multiple)."""
        seg = self.multiples.segment
        return -(-tokens.astype(np.int64) // seg) * seg

    def physical(self, slots_sum: int) -> int:
        """T of a bin whose samples take `slots_sum` slots."""
        aligned = round_up(int(slots_sum), self.multiples.total)
        return max(aligned, self.capacity) if self.static_shapes else aligned

    def check_oversize(self, slots: np.ndarray, sample_ids: np.ndarray) -> np.ndarray:
        """[K] positions of samples that do not fit a bin; ValueError under oversize="error", and for a sample
        whose own bin no pack can hold (T >= 2**31, int32 cu_seqlens) under either policy."""
        over = np.flatnonzero(slots > self.capacity)
        unpackable = over[-(-slots[over] // self.multiples.total) * self.multiples.total >= 2**31]
        if len(unpackable):
            i = unpackable[0]
            raise ValueError(f"{len(unpackable)} sample(s) need a pack of 2**31 slots or more: sample "
                             f"{int(sample_ids[i])} ({int(slots[i])} slots) alone is more than int32 cu_seqlens can "
                             f"hold (< 2**31), so no pack can take it")
        if len(over) and self.oversize == "error":
            named = ", ".join(f"sample {int(sample_ids[i])} ({int(slots[i])} slots)" for i in over[:5])
            raise ValueError(f"{len(over)} sample(s) exceed the bin capacity {self.capacity}: {named}"
                             f"{' ...' if len(over) > 5 else ''}; raise capacity or pass oversize='own_bin'")
        return over


@dataclass(frozen=True)
class Bin:
    """One packed micro-batch: which samples, in which order, how long.

    Attributes:
        samples: dataset indices, in pack order.
        tokens: real (expanded) tokens of each sample.
        physical: T, physical tokens of the pack.
        cost: the cost model's cost of the pack.
    """

    samples: tuple[int, ...]
    tokens: tuple[int, ...]
    physical: int
    cost: float

    @property
    def real_tokens(self) -> int:
        return sum(self.tokens)

    def plan(self, layout: BinLayout) -> PackPlan:
        """The plan `pack_batch` builds for these samples as right-padded rows (pad_to under static shapes)."""
        return make_pack_plan(self.tokens, row_capacity=max(self.tokens), multiples=layout.multiples,
                              pad_to=self.physical if layout.static_shapes else None)


def _check_items(slots: np.ndarray, capacity: int) -> None:
    """`best_fit_decreasing`'s preconditions, O(N) in numpy (see its Raises)."""
    if not is_int(capacity) or capacity < 1:
        raise ValueError(f"best_fit_decreasing's capacity must be a positive int, got {capacity!r}")
    if not isinstance(slots, np.ndarray) or slots.ndim != 1 or (slots.dtype.kind not in "iu" and slots.size):
        got = f"{slots.dtype} {slots.shape}" if isinstance(slots, np.ndarray) else type(slots).__name__
        raise ValueError(f"best_fit_decreasing's slots must be a 1-D array of ints, got {got}")
    bad = np.flatnonzero((slots < 1) | (slots > capacity))
    if len(bad):
        raise ValueError(f"best_fit_decreasing's slots must lie in [1, {capacity}] (the capacity); item {int(bad[0])} "
                         f"is {int(slots[bad[0]])}")


def best_fit_decreasing(slots: np.ndarray, capacity: int) -> list[list[int]]:
    """Bin packing: each item, largest first, goes to the fullest bin it fits (best fit).

    Args:
        slots: [N] int64 item sizes, each <= capacity.

    Returns:
        B lists of positions into `slots`; each list in decreasing size. Ties keep input order.

    Items above capacity/2 each open a bin (no earlier bin, which holds an item at least as large,
    has room), so only the smaller ones walk the sorted list of free space.

    Raises:
        ValueError: `capacity` not a positive int, or `slots` not 1-D ints in [1, capacity] (an item over the
            capacity, or of a fractional size, was packed into a bin larger than it, silently).
    """
    _check_items(slots, capacity)
    order = np.argsort(-slots, kind="stable")
    sizes = slots[order].tolist()
    order = order.tolist()
    big = int(np.searchsorted(-slots[order], -capacity / 2, side="left")) if order else 0
    bins: list[list[int]] = [[order[i]] for i in range(big)]
    free = sorted((capacity - sizes[i], i) for i in range(big))  # (free slots, bin id)
    smallest = sizes[-1] if sizes else 0
    for pos in range(big, len(order)):
        size = sizes[pos]
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([order[pos]])
            left, bin_id = capacity - size, len(bins) - 1
        else:
            left, bin_id = free.pop(at)
            bins[bin_id].append(order[pos])
            left -= size
        if left >= smallest:  # a bin no remaining item can enter leaves the search list
            bisect.insort(free, (left, bin_id))
    return bins


def balanced_fit(slots: np.ndarray, extra: np.ndarray, capacity: int, num_bins: int) -> list[list[int]]:
    """Bin packing that evens out cost: each item, largest first, goes to the cheapest bin with room.

    `extra` is the part of an item's cost that differs between bins of equal size (attention,
    vision and audio encoders; see `CostModel.extra_costs`). Starting from `num_bins` empty bins,
    the cheapest bins take the next items until they are full, so every bin ends near the same
    cost while the small items last fill the gaps. An item no bin has room for opens a new bin.

    Args:
        slots: [N] int64 sizes, each <= capacity; extra: [N] float costs.
        num_bins: bins to start from (e.g. ceil(sum(slots) / capacity)).

    Returns:
        lists of positions into `slots` (empty bins removed), each in decreasing size.
    """
    order = np.argsort(-slots, kind="stable")
    sizes, costs, order = slots[order].tolist(), extra[order].tolist(), order.tolist()
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    free = [capacity] * num_bins
    heap = [(0.0, b) for b in range(num_bins)]  # (cost so far, bin id): bins that may take the item
    parked: list[tuple[int, float, int]] = []  # (-free, cost, bin id): too full for the current size
    smallest = sizes[-1] if sizes else 0
    for pos, size in enumerate(sizes):
        while parked and -parked[0][0] >= size:  # sizes only shrink: a parked bin returns once
            _, cost, bin_id = heapq.heappop(parked)
            heapq.heappush(heap, (cost, bin_id))
        while heap and free[heap[0][1]] < size:
            cost, bin_id = heapq.heappop(heap)
            heapq.heappush(parked, (-free[bin_id], cost, bin_id))
        if heap:
            cost, bin_id = heapq.heappop(heap)
        else:
            bins.append([]); free.append(capacity)
            cost, bin_id = 0.0, len(bins) - 1
        bins[bin_id].append(order[pos])
        free[bin_id] -= size
        if free[bin_id] >= smallest:  # otherwise no remaining item fits: the bin is closed
            heapq.heappush(heap, (cost + costs[pos], bin_id))
    return [b for b in bins if b]


def split_to_count(bins: list[list[int]], count: int, slots: np.ndarray) -> list[list[int]] | None:
    """Split bins (largest sample count first) until there are `count`; None when too few samples.

    A split deals a bin's items alternately into two bins, so both stay within the capacity.
    """
    if sum(len(b) for b in bins) < count:
        return None
    bins = [list(b) for b in bins]
    while len(bins) < count:
        widest = max(range(len(bins)), key=lambda i: (len(bins[i]), -i))
        items = sorted(bins.pop(widest), key=lambda p: (-int(slots[p]), p))
        bins[widest:widest] = [items[0::2], items[1::2]]
    return bins
