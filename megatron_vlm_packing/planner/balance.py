"""Balancing: bins grouped into steps, and each step's bins split over data-parallel ranks.

Every rank of a step waits for the slowest, so what matters is max / mean of the per-rank cost.
Two moves:

1. Steps from a window of bins: bins sorted by cost and cut into consecutive groups of
   `bins_per_step`, so a step's bins cost about the same; the steps' order is then shuffled. The
   window (a few steps) bounds how far from random a step's composition can drift.
2. Ranks within a step: longest-processing-time first with a cardinality limit (every rank gets
   exactly `per_rank` bins): the next most expensive bin goes to the cheapest rank with room.

Shape legend: B = bins, R = ranks, M = bins per rank.
"""

from __future__ import annotations

import heapq

import numpy as np

from megatron_vlm_packing.packing.bounds import is_int


def assign_to_ranks(costs: np.ndarray, num_ranks: int, per_rank: int) -> list[list[int]]:
    """Split B = num_ranks * per_rank bins over ranks, balancing the sum of costs.

    Args:
        costs: [B] float, cost of each bin.

    Returns:
        R lists of M positions into `costs`. Deterministic: ties go to the lower rank / position.
    """
    if any(not is_int(n) or n < 1 for n in (num_ranks, per_rank)):
        raise ValueError(f"num_ranks and per_rank must be positive ints, got {num_ranks!r} and {per_rank!r}")
    values = np.asarray(costs, dtype=np.float64)
    finite = np.isfinite(values) & (values >= 0)
    if not finite.all():  # a NaN compares as neither more nor less: its bin was placed as if free
        bad = int(np.flatnonzero(~finite)[0])
        raise ValueError(f"costs must be finite and >= 0; bin {bad} costs {float(costs[bad])}")
    if len(costs) != num_ranks * per_rank:
        raise ValueError(f"{len(costs)} bins cannot be split into {num_ranks} ranks x {per_rank} bins")
    order = np.argsort(-values, kind="stable")
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks)]
    for pos in order:
        load, r = heapq.heappop(heap)
        ranks[r].append(int(pos))
        if len(ranks[r]) < per_rank:
            heapq.heappush(heap, (load + float(costs[pos]), r))
    return ranks


def group_into_steps(costs: np.ndarray, bins_per_step: int) -> list[np.ndarray]:
    """Cut bins, sorted by cost, into consecutive steps of `bins_per_step` (len(costs) a multiple)."""
    if len(costs) % bins_per_step:
        raise ValueError(f"{len(costs)} bins are not a whole number of steps of {bins_per_step}")
    order = np.argsort(np.asarray(costs, dtype=np.float64), kind="stable")
    return [order[i:i + bins_per_step] for i in range(0, len(order), bins_per_step)]


def rank_costs(costs: np.ndarray, ranks: list[list[int]]) -> np.ndarray:
    """[R] float64: per-rank sum of bin costs."""
    return np.asarray([float(np.sum(costs[r])) for r in ranks], dtype=np.float64)


def imbalance(per_rank: np.ndarray) -> float:
    """max / mean of per-rank costs (1.0 is perfect).

    Raises:
        ValueError: no ranks, or a cost that is NaN, infinite or negative (naming the rank).
    """
    per_rank = np.asarray(per_rank, dtype=np.float64)
    if per_rank.size == 0:
        raise ValueError("per_rank must hold at least one rank's cost, got none")
    bad = np.flatnonzero(~np.isfinite(per_rank) | (per_rank < 0))
    if bad.size:
        raise ValueError(f"per_rank costs must be finite and >= 0; rank {int(bad[0])} has {float(per_rank[bad[0]])!r}")
    mean = float(np.mean(per_rank))
    return float(np.max(per_rank)) / mean if mean > 0 else 1.0
