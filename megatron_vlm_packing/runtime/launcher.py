"""Process groups and a multi-process launcher for Megatron-Core tests on CPU (gloo).

`run_distributed(fn, world_size, *args)` starts `world_size` processes; each initialises a gloo
process group, applies the CPU shims, and calls `fn(rank, world_size, *args)`. A failure in any
rank fails the caller with that rank's traceback. What rank 0 returns comes back to the caller.
Processes are forked from one fork server that imports Megatron-Core once (about 10 s of CPU,
paid by the first launch); a launch then costs well under a second, so launches stay cheap.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PORT_IN_USE = ("Address already in use", "EADDRINUSE")
_PORT_ATTEMPTS = 3  # free_port() releases the port before rank 0 binds it: another process may win


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int) -> None:
    """gloo on loopback; idempotent within a process."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )


def initialize_parallel(*, tp: int = 1, cp: int = 1, pp: int = 1, seed: int = 1234) -> None:
    """(Re)initialise Megatron-Core model parallelism over the current world and seed it.

    Seeds the CPU RNG with `seed` and Megatron's tensor-parallel RNG tracker (CPU-backed under the
    shim) through `model_parallel_cuda_manual_seed`, so the same seed gives the same weights.
    The remaining factor of the world size becomes data parallelism.

    Raises:
        ValueError: a size is < 1, or tp * cp * pp does not divide the world size.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random as tp_random

    for name, size in (("tp", tp), ("cp", cp), ("pp", pp)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise ValueError(f"tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    torch.manual_seed(seed)
    tp_random.get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(seed)


def _worker(rank, world_size, port, fn, args, tmp):
    from megatron_vlm_packing.runtime.cpu_shims import apply_cpu_shims

    torch.set_num_threads(1)  # N processes share the machine's cores
    try:
        apply_cpu_shims()
        init_process_group(rank, world_size, port)
        result = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(result, os.path.join(tmp, "rank0.pt"))
    except BaseException:
        # The full traceback, time-stamped: when one rank raises, its peers then fail in their
        # collectives, and the parent reports the earliest failure (the cause) first.
        message = f"rank {rank} of {world_size} failed:\n{traceback.format_exc()}"
        with open(os.path.join(tmp, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()!r}\n{message}")
        raise RuntimeError(message) from None
    finally:
        if dist.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


@contextlib.contextmanager
def _cuda_hidden():
    """Children start with no visible GPU (the CPU shim refuses to run where CUDA is available).

    Set only around the start and restored after it: the fork server (started by the first launch) and
    so every worker keep the environment it had then.
    """
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _rank_failures(tmp: str, world_size: int) -> str:
    """Every failed rank's traceback, earliest first ("" when no rank wrote one)."""
    failures = []
    for rank in range(world_size):
        path = os.path.join(tmp, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                stamp, message = f.read().split("\n", 1)
            failures.append((float(stamp), message))
    return "\n".join(message for _, message in sorted(failures))


# Imported once by the fork server, which every later process is forked from: importing
# Megatron-Core costs about 10 s of CPU per process on a CI core, more than most launches then run.
_PRELOAD = ("megatron_vlm_packing.runtime.launcher", "megatron_vlm_packing.runtime.cpu_shims", "megatron.core",
            "megatron.core.models.gpt", "megatron.core.pipeline_parallel", "transformers")


def _launch(fn, world_size, args, tmp, timeout_s):
    # "forkserver": each process is forked from one server that started clean (no threads, no
    # process group) and imported `_PRELOAD` once; like "spawn", nothing of this process is
    # inherited but its environment at the server's start (made here, with CUDA hidden). A module
    # that fails to import is skipped by the server and imported by the worker that needs it.
    mp.set_forkserver_preload(list(_PRELOAD))
    with _cuda_hidden():
        context = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, tmp),
                                     nprocs=world_size, join=False, start_method="forkserver")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if context.join(timeout=remaining):
            return
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:  # only the processes this launch started
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join()
            raise TimeoutError(f"run_distributed: {world_size} processes still running after {timeout_s} s")


def run_distributed(fn, world_size: int, *args, timeout_s: float | None = None):
    """Run `fn(rank, world_size, *args)` in `world_size` CPU processes (gloo), forked from one fork
    server: they see the environment of this process's first launch (the server's), not later changes.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes (>= 1).
        timeout_s: terminate every process and raise `TimeoutError` after this many seconds (None: wait).

    Returns:
        What rank 0's `fn` returned (must be `torch.save`-able).

    Raises:
        RuntimeError: a rank raised or died; the message holds every failed rank's traceback, the
            earliest (the cause; its peers then fail in their collectives) first.
        TimeoutError: still running after `timeout_s`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    for attempt in range(_PORT_ATTEMPTS):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                _launch(fn, world_size, args, tmp, timeout_s)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
                failures = _rank_failures(tmp, world_size) or str(err)
                if attempt + 1 < _PORT_ATTEMPTS and any(s in failures for s in _PORT_IN_USE):
                    continue
                raise RuntimeError(failures) from None
            result_path = os.path.join(tmp, "rank0.pt")
            return torch.load(result_path, weights_only=False) if os.path.exists(result_path) else None
