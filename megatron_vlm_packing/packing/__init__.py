"""Real lengths, the pack plan, pack/unpack, `pack_batch` / `pad_batch` (one `MicroBatch`), dense padding helpers."""

from megatron_vlm_packing.packing.batch import IGNORE_INDEX, PackedBatch, make_packed_seq_params, pack_batch, shift_labels_within_rows
from megatron_vlm_packing.packing.dense_batch import pad_batch
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.micro_batch import AudioInputs, BatchStats, MicroBatch, VisionInputs
from megatron_vlm_packing.packing.dense import (
    dense_packed_seq_params, pad_or_truncate_attention_mask_4d, pad_or_truncate_keep_mask,
    pad_or_truncate_positions, pad_or_truncate_rows, padded_length,
)
from megatron_vlm_packing.packing.lengths import keep_mask_from_4d, lengths_from_keep_mask, real_lengths
from megatron_vlm_packing.packing.pack import pack_positions, pack_rows, segment_positions, unpack_rows
from megatron_vlm_packing.packing.indices import PackIndices, plan_indices
from megatron_vlm_packing.packing.plan import PackMultiples, PackPlan, make_pack_plan

__all__ = [
    "AudioInputs", "BatchStats", "MediaTokens", "MicroBatch", "VisionInputs", "pad_batch",
    "dense_packed_seq_params", "pad_or_truncate_attention_mask_4d", "pad_or_truncate_keep_mask",
    "pad_or_truncate_positions", "pad_or_truncate_rows", "padded_length",
    "IGNORE_INDEX", "PackIndices", "PackMultiples", "PackPlan", "PackedBatch", "keep_mask_from_4d",
    "lengths_from_keep_mask", "make_pack_plan", "make_packed_seq_params", "pack_batch", "pack_positions",
    "pack_rows", "plan_indices", "real_lengths", "segment_positions", "shift_labels_within_rows", "unpack_rows",
]
