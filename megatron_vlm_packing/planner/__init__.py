"""Dataset-level packing: bins of a physical capacity, balanced over micro-batches and DP ranks.

From per-sample metadata only (text tokens, image/video grids, audio lengths), the planner packs
samples into bins that `pack_batch(..., pad_to=capacity)` turns into exactly the plan the bin
describes, groups bins into steps and splits each step over data-parallel ranks so that the
per-rank cost (language model attention and GEMMs, vision and audio encoders) is balanced.

Plug it in with `PackedBatchSampler` (a PyTorch batch sampler) or `EnergonPackingHooks`
(`select_samples_to_pack` / `pack_selected_samples` for a Megatron-Energon task encoder).
"""

from megatron_vlm_packing.planner.balance import assign_to_ranks, imbalance
from megatron_vlm_packing.planner.bins import Bin, BinLayout, best_fit_decreasing
from megatron_vlm_packing.planner.cost import CostModel, TransformerShape
from megatron_vlm_packing.planner.metadata import SampleMetadata, SampleTable, TokenCounter, llava_tokens
from megatron_vlm_packing.planner.energon import EnergonPackingHooks, PlannedPackingMixin
from megatron_vlm_packing.planner.sampler import PackedBatchSampler
from megatron_vlm_packing.planner.epoch_plan import EpochPlan, PlannerConfig, Step
from megatron_vlm_packing.planner.schedule import plan_epoch

__all__ = [
    "Bin", "BinLayout", "CostModel", "EnergonPackingHooks", "EpochPlan", "PackedBatchSampler",
    "PlannedPackingMixin", "PlannerConfig", "SampleMetadata", "SampleTable", "Step",
    "TokenCounter", "TransformerShape", "assign_to_ranks", "best_fit_decreasing", "imbalance", "llava_tokens",
    "plan_epoch",
]
