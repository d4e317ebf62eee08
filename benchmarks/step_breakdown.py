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
take less time than the step itself is host-bound), and the host's own ms per step (unprofiled: the time
until the step returns, before the final synchronize; about the wall time when the step is host-bound
or waits on the device inside).

Then, per mode and per step, what makes the host wait on the device (thd_step_syncs_desk_study.md):
host-blocking CUDA runtime calls (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `cudaEventSynchronize`,
synchronous `cudaMemcpy`) with the ms the host spent in them, device-to-host copies and copies from
pageable host memory (a stream sync before the copy), and the aten calls that sync when their input is on
the device (`aten::item` / `_local_scalar_dense`, `aten::equal`, `aten::nonzero`, `aten::is_nonzero`
(tensor truthiness), ...; on the CPU these are all there is to count, and on a GPU they also count calls on
CPU tensors, which do not sync). Each sync is named by its aten callers, and with `--stack` by the first
Python frame outside torch (file:line in Megatron-Core, Transformer Engine or ours). Last, the top ops by
self CPU time per step in each mode: where the host's time goes.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from step_pack_vs_pad import (  # benchmarks/step_pack_vs_pad.py (the script's folder is on sys.path)
    PRESETS, build_model, dense_step, lognormal_lengths, make_batch, on, ours_on, pack, packed_step,
)

LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
# CUDA runtime / driver calls that block the host until the device (or a stream, or an event) is done.
SYNC_RUNTIME_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                       "cudaMemcpy2D", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize",
                       "cuMemcpyDtoH_v2", "cuMemcpyDtoH")
# Device activities that imply a host wait: a copy to the host, or from pageable host memory.
SYNC_COPY_MARKERS = ("Memcpy DtoH", "Memcpy HtoD (Pageable")
# aten calls that read a device value on the host (or size an output by one): syncs when on the device.
# (Not `repeat_interleave`: it syncs only without `output_size`, which the trace does not show; on CUDA the
# runtime calls above catch it either way.)
SYNC_ATEN_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::equal", "aten::nonzero", "aten::is_nonzero",
                 "aten::masked_select", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
                 "aten::bincount", "aten::histc")


def is_sync_event(name: str) -> bool:
    return name in SYNC_RUNTIME_EVENTS or name in SYNC_ATEN_OPS or name.startswith(SYNC_COPY_MARKERS)


def _is_python(name: str) -> bool:
    return name.startswith("<built-in") or ".py(" in name


def _is_callers_frame(frame: str) -> bool:
    """A frame that says who called: not torch's, not this script's, not a `__torch_function__` hook."""
    return ".py(" in frame and "/torch/" not in frame and "step_breakdown.py" not in frame \
        and not frame.endswith("__torch_function__")


def python_frame(event) -> str | None:
    """The innermost Python frame outside torch that led to `event` (recorded only with `with_stack=True`: as
    the events' stacks, or as Python-function events among their parents)."""
    while event is not None:
        frames = [event.name] if _is_python(event.name) else list(event.stack or ())
        for frame in frames:
            if _is_callers_frame(frame):
                return frame.split("site-packages/")[-1]
        event = event.cpu_parent
    return None


def sync_site(event) -> str:
    """`event` named by its callers: up to 3 enclosing ops (innermost first), then its Python frame."""
    chain, parent = [event.name], event.cpu_parent
    while parent is not None and len(chain) < 4 and not parent.name.startswith("ProfilerStep"):
        if not _is_python(parent.name):
            chain.append(parent.name)
        parent = parent.cpu_parent
    frame = python_frame(event)
    return " < ".join(chain) + (f" @ {frame}" if frame else "")


def sync_sites(events, device: str, steps: int) -> collections.Counter:
    """{site: syncs per step}. On CUDA a sync is a host-blocking runtime call; on the CPU (nothing blocks) an aten
    call that would sync on the device, counted once per call (not again for the aten calls it makes)."""
    sites = collections.Counter()
    for event in events:
        if device == "cuda":
            primary = event.name in SYNC_RUNTIME_EVENTS
        else:
            primary = event.name in SYNC_ATEN_OPS and not (event.cpu_parent and event.cpu_parent.name in SYNC_ATEN_OPS)
        if primary:
            sites[sync_site(event)] += 1 / steps
    return sites


def host_ms(step, device: str, steps: int) -> float:
    """Median ms from a step's call to its return, unprofiled, with the device idle at the call: the host's time
    to enqueue the step, plus whatever it waited for inside (the wall time of a host-bound step)."""
    samples = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        samples.append((time.perf_counter() - start) * 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return statistics.median(samples)


def profile_step(step, device: str, steps: int, *, stack: bool = False) -> dict:
    """Per-step totals of `steps` profiled calls of `step` (after 2 warm-ups): wall ms, kernel ms, launches,
    {op name: ms} (self device time on CUDA, self CPU time on the CPU), {op name: self CPU ms}, the sync events
    {name: (calls, ms)} (host ms in the call; device ms for copies) and the sync sites {site: syncs}; and the
    unprofiled host ms per step (`host_ms`)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    step()
    unprofiled_host_ms = host_ms(step, device, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities, with_stack=stack) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / steps
    by_op, cpu_by_op, syncs, launches = collections.Counter(), collections.Counter(), {}, 0
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep"):
            continue
        if event.key in LAUNCH_EVENTS:
            launches += event.count
        own = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if own > 0:
            by_op[event.key] += own / 1e3 / steps  # us -> ms per step
        if event.self_cpu_time_total > 0:
            cpu_by_op[event.key] += event.self_cpu_time_total / 1e3 / steps
        if is_sync_event(event.key):
            spent = event.device_time_total if event.key.startswith(SYNC_COPY_MARKERS) else event.cpu_time_total
            syncs[event.key] = (event.count / steps, spent / 1e3 / steps)
    kernel_ms = sum(by_op.values()) if device == "cuda" else float("nan")
    events = prof.events()
    return {"wall_ms": wall, "kernel_ms": kernel_ms, "launches": launches / steps, "by_op": by_op,
            "host_ms": unprofiled_host_ms, "cpu_by_op": cpu_by_op, "syncs": syncs,
            "sites": sync_sites(events, device, steps), "aten_calls": top_level_aten_calls(events) / steps}


def top_level_aten_calls(events) -> int:
    """aten ops called from Python (not from inside another aten op): the host's dispatches, a measure of its work
    that does not depend on the device."""
    return sum(1 for event in events if event.name.startswith("aten::")
               and not (event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::")))


def breakdown_lines(dense: dict, packed: dict, top: int, device: str) -> list[str]:
    what = "kernel" if device == "cuda" else "own CPU"
    lines = ["| mode | wall ms/step | host ms/step (unprofiled) | kernel ms/step | kernel ms / wall ms | "
             "kernel launches/step | aten calls/step (top level) |", "|---|---|---|---|---|---|---|"]
    for name, result in (("padded to batch max", dense), ("packed THD, ours", packed)):
        nan = result["kernel_ms"] != result["kernel_ms"]
        kernel = "-" if nan else f"{result['kernel_ms']:.1f}"
        busy = "-" if nan else f"{result['kernel_ms'] / result['wall_ms']:.2f}"
        lines.append(f"| {name} | {result['wall_ms']:.1f} | {result['host_ms']:.1f} | {kernel} | {busy} | "
                     f"{result['launches']:.0f} | {result['aten_calls']:.0f} |")
    ops = set(dense["by_op"]) | set(packed["by_op"])
    diffs = sorted(ops, key=lambda op: -abs(packed["by_op"][op] - dense["by_op"][op]))[:top]
    lines += ["", f"| op | {what} ms/step, padded to batch max | {what} ms/step, packed | packed - padded |",
              "|---|---|---|---|"]
    for op in diffs:
        a, b = dense["by_op"][op], packed["by_op"][op]
        lines.append(f"| `{op[:90]}` | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    return lines


def sync_lines(modes: dict, top: int, device: str) -> list[str]:
    """The sync events, the sync sites and the top ops by self CPU time of each mode ({name: profile_step's})."""
    kind = "host-blocking CUDA calls, copies to the host and aten calls that sync on the device" \
        if device == "cuda" else "aten calls that would sync on the device (nothing blocks on the CPU)"
    lines = ["", f"Sync events per step ({kind}; ms: host time in the call, device time for copies):", "",
             "| mode | event | calls/step | ms/step |", "|---|---|---|---|"]
    for name, result in modes.items():
        events = sorted(result["syncs"].items(), key=lambda item: -item[1][0])
        lines += [f"| {name} | `{event}` | {calls:.1f} | {ms:.3f} |" for event, (calls, ms) in events] or \
            [f"| {name} | none | 0 | 0 |"]
    lines += ["", "Where the syncs come from (the sync, then its callers; `--stack` adds the first Python frame "
              "outside torch):", "",
              "| mode | site | syncs/step |", "|---|---|---|"]
    for name, result in modes.items():
        sites = result["sites"].most_common(top)
        lines += [f"| {name} | `{site[:200]}` | {n:.1f} |" for site, n in sites] or [f"| {name} | none | 0 |"]
    lines += ["", "Top ops by self CPU time per step (where the host's time goes):", "",
              "| mode | op | self CPU ms/step |", "|---|---|---|"]
    for name, result in modes.items():
        lines += [f"| {name} | `{op[:90]}` | {ms:.3f} |" for op, ms in result["cpu_by_op"].most_common(top)]
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
    parser.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused"], default="auto",
                        help="with --backend te: TE's attention backend (Megatron-Core's config.attention_backend)")
    parser.add_argument("--stack", action="store_true",
                        help="record Python stacks: each sync site gets its file:line (slower profiled steps)")
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
    extra = {}
    if args.attention_backend != "auto":
        from megatron.core.transformer.enums import AttnBackend

        extra["attention_backend"] = AttnBackend[args.attention_backend]
    model = build_model(preset, args.rope, args.backend, device, seed=args.seed, extra=extra)
    lengths = lognormal_lengths(preset["batch"], seq, args.seed + seq)  # step_pack_vs_pad's batch for this S
    batch = on(device, make_batch(lengths, seq, preset["vocab_size"], mrope=args.rope == "mrope", seed=args.seed + seq))
    dense = profile_step(lambda: dense_step(model, batch, max(lengths)), device, args.steps, stack=args.stack)
    model.zero_grad(set_to_none=True)
    undo = ours_on(model, args.rope)
    prepacked = pack(batch)
    packed = profile_step(lambda: packed_step(model, packed=prepacked), device, args.steps, stack=args.stack)
    undo()
    header = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (1 thread)'}, torch "
              f"{torch.__version__}, preset {args.preset}, rope {args.rope}, backend {args.backend} (attention "
              f"backend {args.attention_backend}), S {seq}, batch {preset['batch']}: {len(lengths) * max(lengths)} "
              f"slots padded to the batch max, {sum(lengths)} real tokens packed; {args.steps} profiled steps each", ""]
    modes = {"padded to batch max": dense, "packed THD, ours": packed}
    text = "\n".join(header + breakdown_lines(dense, packed, args.top, device) + sync_lines(modes, args.top, device))
    print(text)
    if args.out:
        command = (f"python benchmarks/step_breakdown.py --preset {args.preset} --rope {args.rope} "
                   f"--backend {args.backend} --seq {seq} --steps {args.steps} --attention-backend "
                   f"{args.attention_backend}" + (" --stack" if args.stack else ""))
        with open(args.out, "w") as f:
            f.write(f"# Packed step vs padded to the batch max, op by op\n\n`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
