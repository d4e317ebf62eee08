"""The CPU runtime for Megatron-Core: explicit CUDA shims, gloo process groups and a multi-process
launcher. Product code: the demo runs on it, and users prove their own packing setups with it on a
laptop (`run_distributed(fn, world_size)` runs `fn(rank, world_size)` in CPU processes forked from
one fork server that imported Megatron-Core once).
"""

from megatron_vlm_packing.runtime.cpu_shims import apply_cpu_shims, cpu_shims_applied, undo_cpu_shims
from megatron_vlm_packing.runtime.launcher import free_port, init_process_group, initialize_parallel, run_distributed

__all__ = [
    "apply_cpu_shims", "cpu_shims_applied", "free_port", "init_process_group", "initialize_parallel",
    "run_distributed", "undo_cpu_shims",
]
