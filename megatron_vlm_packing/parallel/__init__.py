"""Context-parallel partitioning (pure index functions) and sequence-parallel helpers."""

from megatron_vlm_packing.parallel.cp import cp_partition_index, dense_cp_partition_index

__all__ = ["cp_partition_index", "dense_cp_partition_index"]
