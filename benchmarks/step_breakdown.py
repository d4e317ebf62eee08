"""Where a packed step's time goes: padded to the batch max vs packed THD (our rotary), op by op.

    python benchmarks/step_breakdown.py --preset h100 --rope mrope --backend te --seq 2048 \\
        --out benchmarks/results/step_breakdown_mrope_h100.md
    python benchmarks/step_breakdown.py --preset smoke --backend reference --seq 64   # seconds, CPU

Why: on the H100 (step_pack_vs_pad_mrope_h100.md) packing reached 0.59 of the token-ideal speedup at
S = 2048 and 0.91 at 4096. A line through the two dense points at 2048 (padded to S: 16384 slots,
108.5 ms; padded to the batch max: 13216 slots, 89.7 ms) predicts about 38 ms for the packed step's
4565 tokens; it took 52.6 ms. This script finds the difference: it profiles `--steps` forward +
backward steps of each mode (the same model and micro-batch as step_pack_vs_pad.py) with
torch.profiler and tabulates, per op, the time per step in each mode and the difference, largest
difference first: device (kernel) time on a GPU, the op's own CPU time on the CPU. The header gives
each mode's wall ms per step, kernel ms per step and kernel launches per step (a step whose kernels
take less time than the step itself is host-bound).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from step_pack_vs_pad import (  # benchmarks/step_pack_vs_pad.py (the script's folder is on sys.path)
    PRESETS, build_model, dense_step, lognormal_lengths, make_batch, on, ours_on, pack, packed_step,
)

LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def profile_step(step, device: str, steps: int) -> dict:
    """Per-step totals of `steps` profiled calls of `step` (after 2 warm-ups): wall ms, kernel ms,
    launches, and {op name: ms} (self device time on CUDA, self CPU time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / steps
    by_op, launches = collections.Counter(), 0
    for event in prof.key_averages():
        if event.key in LAUNCH_EVENTS:
            launches += event.count
        own = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if own > 0 and not event.key.startswith("ProfilerStep"):
            by_op[event.key] += own / 1e3 / steps  # us -> ms per step
    kernel_ms = sum(by_op.values()) if device == "cuda" else float("nan")
    return {"wall_ms": wall, "kernel_ms": kernel_ms, "launches": launches / steps, "by_op": by_op}


def breakdown_lines(dense: dict, packed: dict, top: int, device: str) -> list[str]:
    what = "kernel" if device == "cuda" else "own CPU"
    lines = ["| mode | wall ms/step | kernel ms/step | kernel launches/step |", "|---|---|---|---|"]
    for name, result in (("padded to batch max", dense), ("packed THD, ours", packed)):
        kernel = "-" if result["kernel_ms"] != result["kernel_ms"] else f"{result['kernel_ms']:.1f}"
        lines.append(f"| {name} | {result['wall_ms']:.1f} | {kernel} | {result['launches']:.0f} |")
    ops = set(dense["by_op"]) | set(packed["by_op"])
    diffs = sorted(ops, key=lambda op: -abs(packed["by_op"][op] - dense["by_op"][op]))[:top]
    lines += ["", f"| op | {what} ms/step, padded to batch max | {what} ms/step, packed | packed - padded |",
              "|---|---|---|---|"]
    for op in diffs:
        a, b = dense["by_op"][op], packed["by_op"][op]
        lines.append(f"| `{op[:90]}` | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--rope", choices=["mrope", "1d"], default="mrope")
    parser.add_argument("--backend", default="reference", help="core attention: reference, torch or te")
    parser.add_argument("--seq", type=int, help="one of the preset's sequence lengths (default: its first)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="ops listed, largest difference first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    seq = args.seq or preset["seq_lengths"][0]
    if seq not in preset["seq_lengths"]:
        raise ValueError(f"--seq {seq} is not one of preset {args.preset}'s lengths {preset['seq_lengths']}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)

    from megatron_vlm_packing.demo.main import setup_distributed

    setup_distributed(device, 1, 1, args.seed)
    model = build_model(preset, args.rope, args.backend, device, seed=args.seed)
    lengths = lognormal_lengths(preset["batch"], seq, args.seed + seq)  # step_pack_vs_pad's batch for this S
    batch = on(device, make_batch(lengths, seq, preset["vocab_size"], mrope=args.rope == "mrope", seed=args.seed + seq))
    dense = profile_step(lambda: dense_step(model, batch, max(lengths)), device, args.steps)
    model.zero_grad(set_to_none=True)
    undo = ours_on(model, args.rope)
    prepacked = pack(batch)
    packed = profile_step(lambda: packed_step(model, packed=prepacked), device, args.steps)
    undo()
    header = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (1 thread)'}, torch "
              f"{torch.__version__}, preset {args.preset}, rope {args.rope}, backend {args.backend}, S {seq}, batch "
              f"{preset['batch']}: {len(lengths) * max(lengths)} slots padded to the batch max, {sum(lengths)} real "
              f"tokens packed; {args.steps} profiled steps each", ""]
    text = "\n".join(header + breakdown_lines(dense, packed, args.top, device))
    print(text)
    if args.out:
        command = (f"python benchmarks/step_breakdown.py --preset {args.preset} --rope {args.rope} "
                   f"--backend {args.backend} --seq {seq} --steps {args.steps}")
        with open(args.out, "w") as f:
            f.write(f"# Packed step vs padded to the batch max, op by op\n\n`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
