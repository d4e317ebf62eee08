"""megatron-vlm-packing: exact, fast sequence packing for vision-language models on Megatron-Core.

Public entry points (stable names): `pack_batch`, `PackedBatch`, `cp_partition_index`,
`make_forward_step`, `rope.MRopeConfig`, `rope.get_rope_index`.
"""

from megatron_vlm_packing.packing import MicroBatch, PackedBatch, PackMultiples, PackPlan, make_pack_plan, pack_batch, pad_batch
from megatron_vlm_packing.parallel import cp_partition_index, dense_cp_partition_index
from megatron_vlm_packing.planner import PackedBatchSampler, PlannerConfig, plan_epoch
from megatron_vlm_packing.step import loss_func, make_forward_step
from megatron_vlm_packing.validate import validate_packed_batch

__version__ = "0.1.0"

__all__ = [
    "MicroBatch", "PackMultiples", "PackPlan", "PackedBatch", "cp_partition_index", "dense_cp_partition_index",
    "PackedBatchSampler", "PlannerConfig", "plan_epoch",
    "loss_func", "make_forward_step", "make_pack_plan", "pack_batch", "pad_batch", "validate_packed_batch",
]
