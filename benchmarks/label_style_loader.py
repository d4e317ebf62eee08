"""The label-style check's cost on the loader path and the step path: `pack_batch` on pack_vs_bridge's clean
batches (Megatron labels, declared "megatron"), median ms over interleaved rounds.

Run it with any checkout's package first on the path to compare two (the check alone changed between them):
`PYTHONPATH=<checkout> OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/label_style_loader.py`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from pack_vs_bridge import make_batch, ours  # benchmarks/ (the script's folder is on sys.path)


def median_ms(call, repeats: int) -> float:
    call()  # first use: imports, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    import megatron_vlm_packing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"package: {megatron_vlm_packing.__file__}")
    print("| B x S | loader ms | step path ms |\n|---|---|---|")
    for b in args.batches:
        for s in args.seqs:
            batch = make_batch(b, s)
            loader = median_ms(lambda: ours(batch, host_reads=True), args.repeats)
            step = median_ms(lambda: ours(batch, host_reads=False), args.repeats)
            print(f"| {b} x {s} | {loader:.3f} | {step:.3f} |", flush=True)


if __name__ == "__main__":
    main()
