"""megatron-vlm-packing: exact, fast sequence packing for vision-language models on Megatron-Core.

Public entry points (stable names): `pack_batch`, `PackedBatch`, `cp_partition_index`.
"""

from megatron_vlm_packing.packing import PackedBatch, PackMultiples, PackPlan, make_pack_plan, pack_batch
from megatron_vlm_packing.parallel import cp_partition_index, dense_cp_partition_index

__version__ = "0.1.0"

__all__ = [
    "PackMultiples", "PackPlan", "PackedBatch", "cp_partition_index", "dense_cp_partition_index",
    "make_pack_plan", "pack_batch",
]
