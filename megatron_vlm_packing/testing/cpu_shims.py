"""Kept import path: the CPU shims are product code in `megatron_vlm_packing.runtime.cpu_shims`."""

from megatron_vlm_packing.runtime.cpu_shims import CudaToCpuMode, apply_cpu_shims, undo_cpu_shims, cpu_shims_applied

__all__ = ['CudaToCpuMode', 'apply_cpu_shims', 'undo_cpu_shims', 'cpu_shims_applied']
