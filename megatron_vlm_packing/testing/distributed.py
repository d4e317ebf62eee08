"""Kept import path: the launcher is product code in `megatron_vlm_packing.runtime.launcher`."""

from megatron_vlm_packing.runtime.launcher import free_port, init_process_group, initialize_parallel, run_distributed

__all__ = ["free_port", "init_process_group", "initialize_parallel", "run_distributed"]
