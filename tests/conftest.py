"""Hypothesis profiles: CI (`CI` set, as `.ci/run` does) draws the same examples on every run, so a
landing never depends on a lucky draw; local runs explore new random examples each time (a failure
prints the example to pin with `@example`). And `single_process_megatron`, for the few tests that
build a Megatron-Core model in the pytest process itself."""

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "explore")


@pytest.fixture(scope="module")
def single_process_megatron():
    """A one-process gloo group and Megatron-Core's parallel state in this process (`demo.main.setup_distributed`),
    torn down after the module: the group destroyed, the CPU shims it applied undone, and the environment it set (RANK, WORLD_SIZE,
    MASTER_ADDR / PORT, LOCAL_RANK) restored. Left in place, later tests that start a script as a subprocess
    would hand it RANK and a MASTER_PORT this process holds, and its own set-up would fail."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_vlm_packing.demo.main import setup_distributed

    from megatron_vlm_packing.runtime.cpu_shims import cpu_shims_applied, undo_cpu_shims

    saved, shims_were_on = dict(os.environ), cpu_shims_applied()
    setup_distributed("cpu", 1, 1, 0)
    yield
    if not shims_were_on:  # left on, a later test of the shims themselves finds them applied
        undo_cpu_shims()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
