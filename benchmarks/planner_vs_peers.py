"""The dataset planner against peers' packing algorithms, reimplemented from their descriptions.

Distribution (`planner.synthetic.SyntheticMix`): lognormal text (median 400, sigma 1), 0-8 images
of 4x4..64x64 patches (40% text only), videos for 10% of samples, audio for 10%. Bins of 32768
physical tokens aligned for TP=2 x CP=2 with SP (segment 4, total 4); static shapes (pad_to=capacity)
unless --dynamic. Every algorithm's bins are scored with the same cost model (Qwen2.5-VL-7B FLOPs:
LM GEMMs per physical token, causal attention per document, ViT, audio encoder).

Peers:
- ffd: first-fit decreasing per buffer, bins to ranks in order (Megatron-Bridge packing).
- greedy_knapsack: each bin repeatedly takes the largest remaining item that fits (LLaMA-Factory).
- kk_text: per step, Karmarkar-Karp (largest differencing) of the step's samples into R groups on
  text cost a*s^2 + b*s (verl's balanced partitions); no capacity in the partitioning, so groups
  over the capacity are counted.
- sort_vision: first-fit decreasing bins, sorted by vision tokens within a window and cut into
  steps (NeMo Automodel's vision-aware ordering).
- planner: ours with balance off / on; tail="carry" hands the epoch's last samples (less than one
  step) to the next epoch, tail="short_step" runs them as one shorter step (its bins less full).

Fill = real tokens / physical tokens over all bins. Imbalance = max/mean per-rank cost over the
full steps (each rank runs one micro-batch per step), mean over steps and worst step. Time = CPU
seconds (process time) per 100k samples, so other load on the machine does not count.

Run: python benchmarks/planner_vs_peers.py --samples 100000 --out benchmarks/results/planner_vs_peers.md
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import sys
import time

import numpy as np

from megatron_vlm_packing.packing import PackMultiples
from megatron_vlm_packing.planner import BinLayout, CostModel, PlannerConfig, TokenCounter, plan_epoch
from megatron_vlm_packing.planner.synthetic import synthetic_table


def first_fit_decreasing(slots: np.ndarray, capacity: int) -> list[list[int]]:
    """Each item, largest first, into the first (lowest-numbered) bin with room."""
    order = np.argsort(-slots, kind="stable").tolist()
    sizes = slots.tolist()
    free: list[int] = []
    bins: list[list[int]] = []
    for i in order:
        for b, room in enumerate(free):
            if room >= sizes[i]:
                free[b] -= sizes[i]
                bins[b].append(i)
                break
        else:
            free.append(capacity - sizes[i])
            bins.append([i])
    return bins


def greedy_knapsack(slots: np.ndarray, capacity: int) -> list[list[int]]:
    """Fill one bin at a time with the largest remaining item that still fits."""
    order = np.argsort(slots, kind="stable").tolist()
    sizes = [int(slots[i]) for i in order]
    bins = []
    while order:
        room, members = capacity, []
        while True:
            at = bisect.bisect_right(sizes, room) - 1
            if at < 0:
                break
            room -= sizes.pop(at)
            members.append(order.pop(at))
        bins.append(members)
    return bins


def karmarkar_karp(costs: np.ndarray, k: int) -> list[list[int]]:
    """k-way largest differencing: merge the two partitions with the largest spread, big with small."""
    heap = []
    for i, c in enumerate(costs.tolist()):
        sets = [(c, [i])] + [(0.0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-c, i, sets))
    tie = len(costs)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a.sort(key=lambda s: s[0])
        b.sort(key=lambda s: -s[0])
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b)]
        loads = [m[0] for m in merged]
        tie += 1
        heapq.heappush(heap, (-(max(loads) - min(loads)), tie, merged))
    return [members for _, members in heap[0][2]] if heap else []


def windows(slots: np.ndarray, budget: int) -> list[np.ndarray]:
    """Consecutive positions whose slots add up to about `budget` each."""
    cut = np.searchsorted(np.cumsum(slots), np.arange(budget, int(slots.sum()) + budget, budget), side="right")
    return [w for w in np.split(np.arange(len(slots)), cut) if len(w)]


def score(bins: list[list[int]], steps: list[list[list[int]]], cols: dict, layout: BinLayout) -> dict:
    """Fill over all bins and per-rank imbalance over full steps (steps[s][r] = bins of rank r)."""
    slots, tokens, extra, cost = cols["slots"], cols["tokens"], cols["extra"], cols["cost"]
    physical = lambda b: layout.physical(int(slots[b].sum()))  # noqa: E731
    real = sum(int(tokens[b].sum()) for b in bins)
    phys = sum(physical(b) for b in bins)
    over = sum(1 for b in bins if int(slots[b].sum()) > layout.capacity)
    ratios = []
    for step in steps:
        per_rank = [sum(float(cost.bin_cost(physical(b), extra[b].sum())) for b in rank) for rank in step]
        ratios.append(max(per_rank) / np.mean(per_rank))
    return {"fill": real / phys, "over": over, "mean": float(np.mean(ratios)), "worst": float(np.max(ratios))}


def in_order_steps(bins: list[list[int]], dp: int) -> list[list[list[int]]]:
    """Full steps of dp consecutive bins, bin j of a step to rank j."""
    return [[[b] for b in bins[i:i + dp]] for i in range(0, len(bins) - dp + 1, dp)]


def run_peer(name: str, cols: dict, layout: BinLayout, dp: int, rng) -> tuple[dict, float]:
    slots, capacity = cols["slots"], layout.capacity
    order = rng.permutation(len(slots))
    start = time.process_time()
    window_budget = 8 * dp * capacity
    bins = []
    if name in ("ffd", "greedy_knapsack", "sort_vision"):
        packer = first_fit_decreasing if name != "greedy_knapsack" else greedy_knapsack
        for w in windows(slots[order], window_budget):
            packed = [[int(order[w[p]]) for p in b] for b in packer(slots[order[w]], capacity)]
            if name == "sort_vision":
                packed.sort(key=lambda b: -int(cols["vision"][b].sum()))
            bins.extend(packed)
        steps = in_order_steps(bins, dp)
    elif name == "kk_text":
        steps = []
        text_cost = cols["cost"].lm_linear * cols["tokens"] + cols["cost"].lm_attention * cols["tokens"] ** 2.0
        for w in windows(slots[order], dp * capacity):
            ids = order[w]
            groups = [[int(ids[p]) for p in g] for g in karmarkar_karp(text_cost[ids], dp) if g]
            bins.extend(groups)
            if len(groups) == dp:
                steps.append([[g] for g in groups])
    else:
        raise ValueError(name)
    elapsed = time.process_time() - start
    return score(bins, steps, cols, layout), elapsed


def run_planner(table, cols: dict, layout: BinLayout, dp: int, balance: bool, tail: str) -> tuple[dict, float]:
    config = PlannerConfig(layout=layout, dp_size=dp, balance=balance, seed=0, tail=tail)
    start = time.process_time()
    plan = plan_epoch(table, config)
    elapsed = time.process_time() - start
    bins = [list(b.samples) for b in plan.bins()]
    steps = [[[list(b.samples) for b in rank] for rank in step.ranks] for step in plan.steps]
    return {**score(bins, steps, cols, layout), "carried": len(plan.carried)}, elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--capacity", type=int, default=32768)
    parser.add_argument("--dp", type=str, default="8,64")
    parser.add_argument("--dynamic", action="store_true", help="bins at their aligned length (no pad_to)")
    parser.add_argument("--peers", type=str, default="ffd,greedy_knapsack,kk_text,sort_vision")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args(argv)

    multiples = PackMultiples.for_parallel(tp_size=2, cp_size=2, sequence_parallel=True)
    layout = BinLayout(capacity=args.capacity, multiples=multiples, static_shapes=not args.dynamic, oversize="own_bin")
    table = synthetic_table(args.samples, seed=0)
    cost = CostModel.qwen2_5_vl_7b()
    tokens = TokenCounter()(table)
    vision = sum(table.per_sample_sum(np.prod(g, axis=1) // 4, owner)  # LM tokens of images and videos
                 for g, owner in ((table.image_grids, table.image_owner), (table.video_grids, table.video_owner)))
    cols = {"tokens": tokens, "slots": layout.slot_sizes(tokens), "extra": cost.extra_costs(table, tokens),
            "cost": cost, "vision": vision}
    rows = []
    for dp in (int(x) for x in args.dp.split(",")):
        for name in args.peers.split(","):
            result, seconds = run_peer(name, cols, layout, dp, np.random.default_rng(0))
            rows.append((name, dp, result, seconds))
            print(f"{name:18s} dp={dp:3d} {result} {seconds:.2f}s", file=sys.stderr)
        for balance, tail in ((False, "carry"), (True, "carry"), (True, "short_step")):
            result, seconds = run_planner(table, cols, layout, dp, balance, tail)
            name = f"planner{'' if balance else ' unbalanced'}, tail={tail}, {result['carried']} carried"
            rows.append((name, dp, result, seconds))
            print(f"{name:18s} dp={dp:3d} {result} {seconds:.2f}s", file=sys.stderr)
    scale = 100_000 / args.samples
    lines = [
        f"# Planner vs peers ({args.samples} samples, capacity {args.capacity}, "
        f"{'dynamic' if args.dynamic else 'static'} shapes, segment {multiples.segment} / total {multiples.total})",
        "",
        f"Command: `python benchmarks/planner_vs_peers.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| algorithm | DP | fill | bins over capacity | max/mean per rank (mean over steps) | worst step | CPU s per 100k |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, dp, r, seconds in rows:
        lines.append(f"| {name} | {dp} | {r['fill']:.4f} | {r['over']} | {r['mean']:.4f} | {r['worst']:.4f} | "
                     f"{seconds * scale:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
