"""`megatron-vlm-packing plan`: per-rank cost of a synthetic epoch with and without balancing."""

from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_vlm_packing.cli import add_plan_arguments  # noqa: F401 (its home was here)
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.planner.bins import BinLayout
from megatron_vlm_packing.planner.epoch_plan import EpochPlan, PlannerConfig
from megatron_vlm_packing.planner.schedule import plan_epoch
from megatron_vlm_packing.planner.synthetic import synthetic_table


def _summary(plan: EpochPlan) -> tuple[float, float, float]:
    ratios = [step.imbalance for step in plan.steps]
    return plan.fill(), float(np.mean(ratios)), float(np.max(ratios))


def run_plan(args: argparse.Namespace) -> int:
    """Plan one epoch both ways and print fill, max/mean per-rank cost and a few steps' rank costs."""
    multiples = PackMultiples.for_parallel(tp_size=args.tp, cp_size=args.cp, sequence_parallel=args.sp, fp8=args.fp8)
    layout = BinLayout(capacity=args.capacity, multiples=multiples, oversize="own_bin")
    table = synthetic_table(args.samples, seed=args.seed)
    plans = {}
    for name, balance in (("unbalanced", False), ("balanced", True)):
        config = PlannerConfig(layout=layout, dp_size=args.dp, micro_batches_per_rank=args.micro_batches,
                               balance=balance, seed=args.seed)
        start = time.process_time()
        plans[name] = (plan_epoch(table, config, progress=args.progress), time.process_time() - start)
        if not plans[name][0].steps:  # else numpy's "zero-size array to reduction operation maximum"
            raise ValueError(f"the epoch has no full step: its {args.samples} samples fill fewer bins than a step's "
                             f"{args.dp * args.micro_batches} (--dp {args.dp} x --micro-batches {args.micro_batches}): "
                             f"raise --samples or lower --dp / --micro-batches")
    print(f"planner: {args.samples} synthetic samples (lognormal text, 0-8 images, videos, audio); bins of "
          f"{args.capacity} tokens (segment {multiples.segment}, total {multiples.total}); DP {args.dp} x "
          f"{args.micro_batches} micro-batch(es) per step; cost model Qwen2.5-VL-7B FLOPs")
    print(f"{'':12s} {'steps':>6s} {'fill':>7s} {'max/mean (mean)':>16s} {'worst step':>11s} {'CPU s':>6s}")
    for name, (plan, seconds) in plans.items():
        fill, mean, worst = _summary(plan)
        print(f"{name:12s} {len(plan.steps):6d} {fill:7.4f} {mean:16.4f} {worst:11.4f} {seconds:6.2f}")
    for name, (plan, _) in plans.items():
        for s, step in enumerate(plan.steps[:args.steps_shown]):
            costs = step.rank_costs() / 1e15
            shown = " ".join(f"{c:.3f}" for c in costs[:16]) + (" ..." if len(costs) > 16 else "")
            print(f"{name:12s} step {s} per-rank cost (PFLOP): {shown}  max/mean {step.imbalance:.4f}")
    return 0


def plan_args_from(args: argparse.Namespace) -> argparse.Namespace:
    """`plan`'s defaults, with the parallel layout and seed of another command's `args` (the demo's)."""
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    plan_args = parser.parse_args([])
    for name in ("tp", "cp", "sp", "fp8", "seed"):
        if hasattr(args, name):
            setattr(plan_args, name, getattr(args, name))
    return plan_args
