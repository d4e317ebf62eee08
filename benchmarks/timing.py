"""Wall-clock samples of a callable, synchronising CUDA around each call (shared by the benchmarks)."""

from __future__ import annotations

import time

import torch


def wall_ms(fn, *, device: str, repeats: int, warmup: int = 3) -> list[float]:
    """Milliseconds of `repeats` calls of `fn` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples
