"""megatron-vlm-packing: exact, fast sequence packing for vision-language models on Megatron-Core.

Public entry points (stable names): `pack_batch`, `PackedBatch`, `cp_partition_index`,
`make_forward_step`, `rope.MRopeConfig`, `rope.get_rope_index`.

The names below are imported on first use (`lazy.lazy_exports`, PEP 562): `from megatron_vlm_packing import
pack_batch` works as ever, while importing the package alone (as the `megatron-vlm-packing` command line does for
`--help`) leaves Megatron-Core, which every packer imports, unloaded: seconds and its Transformer Engine / Apex
warnings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_vlm_packing.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time `__getattr__` imports each name on first use
    from megatron_vlm_packing.packing import (
        MicroBatch, PackedBatch, PackMultiples, PackPlan, make_pack_plan, pack_batch, pad_batch,
    )
    from megatron_vlm_packing.parallel import cp_partition_index, dense_cp_partition_index
    from megatron_vlm_packing.planner import PackedBatchSampler, PlannerConfig, plan_epoch
    from megatron_vlm_packing.step import loss_func, make_forward_step
    from megatron_vlm_packing.validate import validate_packed_batch

__version__ = "0.1.0"

# Each public name and the module that defines it (the TYPE_CHECKING imports above, as a table).
_SOURCES = {
    **dict.fromkeys(("MicroBatch", "PackMultiples", "PackPlan", "PackedBatch", "make_pack_plan", "pack_batch",
                     "pad_batch"), "megatron_vlm_packing.packing"),
    **dict.fromkeys(("cp_partition_index", "dense_cp_partition_index"), "megatron_vlm_packing.parallel"),
    **dict.fromkeys(("PackedBatchSampler", "PlannerConfig", "plan_epoch"), "megatron_vlm_packing.planner"),
    **dict.fromkeys(("loss_func", "make_forward_step"), "megatron_vlm_packing.step"),
    "validate_packed_batch": "megatron_vlm_packing.validate",
}

__all__ = [
    "MicroBatch", "PackMultiples", "PackPlan", "PackedBatch", "cp_partition_index", "dense_cp_partition_index",
    "PackedBatchSampler", "PlannerConfig", "plan_epoch",
    "loss_func", "make_forward_step", "make_pack_plan", "pack_batch", "pad_batch", "validate_packed_batch",
]


__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
