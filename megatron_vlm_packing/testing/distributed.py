"""Process groups and a multi-process launcher for Megatron-Core tests on CPU (gloo).

`run_distributed(fn, world_size, *args)` spawns `world_size` processes; each initialises a gloo
process group, applies the CPU shims, and calls `fn(rank, world_size, *args)`. A failure in any
rank fails the caller with that rank's traceback. What rank 0 returns comes back to the caller.
Start-up costs a few seconds per launch (importing Megatron-Core), so batch cases into one launch.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
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

    Raises:
        ValueError: tp * cp * pp does not divide the world size.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise ValueError(f"tp*cp*pp = {tp}*{cp}*{pp} = {tp * cp * pp} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    torch.manual_seed(seed)
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(seed)


def _worker(rank, world_size, port, fn, args, result_path):
    from megatron_vlm_packing.testing.cpu_shims import apply_cpu_shims

    torch.set_num_threads(1)  # N processes share the machine's cores
    try:
        apply_cpu_shims()
        init_process_group(rank, world_size, port)
        result = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(result, result_path)
    except BaseException:
        # Re-raise with the full traceback in the message: mp.spawn only shows the last line otherwise.
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{traceback.format_exc()}") from None
    finally:
        if dist.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float | None = None):
    """Run `fn(rank, world_size, *args)` in `world_size` spawned CPU processes.

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.

    Returns:
        What rank 0's `fn` returned (must be `torch.save`-able).
    """
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "rank0.pt")
        mp.spawn(_worker, args=(world_size, free_port(), fn, args, result_path), nprocs=world_size, join=True)
        return torch.load(result_path, weights_only=False) if os.path.exists(result_path) else None
