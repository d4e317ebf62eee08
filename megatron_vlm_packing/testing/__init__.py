"""CPU truth machine for Megatron-Core: CUDA shims, gloo process groups, a launcher, parity helpers.

Importable by users' own tests: their packing can be proved on a laptop.
"""

from megatron_vlm_packing.runtime.cpu_shims import apply_cpu_shims, cpu_shims_applied, undo_cpu_shims
from megatron_vlm_packing.runtime.launcher import initialize_parallel, init_process_group, run_distributed

__all__ = [
    "apply_cpu_shims", "cpu_shims_applied", "init_process_group", "initialize_parallel", "run_distributed",
    "undo_cpu_shims",
]
