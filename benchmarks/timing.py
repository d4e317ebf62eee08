"""Timing samples of a callable, shared by the benchmarks.

Wall time, with CUDA synchronised around each call. `clock="thread"` times this thread's CPU time
instead (`time.thread_time`): for a single-threaded CPU run (`torch.set_num_threads(1)`) that is
the wall time of an idle machine, and it stays honest on a shared one (other processes' load is
not counted).
"""

from __future__ import annotations

import time

import torch


def wall_ms(fn, *, device: str, repeats: int, warmup: int = 3, clock: str = "wall") -> list[float]:
    """Milliseconds of `repeats` calls of `fn` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    if clock == "thread" and device == "cuda":
        raise ValueError("clock='thread' times one CPU thread; CUDA work needs the wall clock")
    clock = time.thread_time if clock == "thread" else time.perf_counter
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = clock()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((clock() - start) * 1e3)
    return samples


def grid_table(header: list[str], batches: list[int], seqs: list[int], row, out: str | None = None) -> list[str]:
    """A markdown table over every B x S: `header` lines, then `row(b, s)` (one line, measured when
    called), each printed as soon as it is made; the whole table appended to `out` when given."""
    lines = list(header)
    print("\n".join(lines), flush=True)
    for b in batches:
        for s in seqs:
            lines.append(row(b, s))
            print(lines[-1], flush=True)
    if out:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return lines
