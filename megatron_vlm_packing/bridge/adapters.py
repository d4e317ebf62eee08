"""Adapters for Megatron-Bridge's Qwen-VL models, as Bridge's providers build them.

- `Qwen3VLAdapter` (`Qwen3VLModel`, dense and MoE): full `input_ids` (the model places vision and
  deepstack embeddings and selects its CP tokens itself) and full [3, 1, T] mRoPE positions (the
  model CP-selects them with the same index; with 1D positions it computes mRoPE itself from the
  packed ids). It also CP-selects labels, so this rank's labels are handed back full length
  (-100 elsewhere): the model's selection returns exactly them.
- `Qwen25VLAdapter` (`Qwen25VLModel`): full `input_ids`; the model always recomputes its mRoPE
  positions (per packed sample) and takes the labels as they are. Bridge 0.6.2's Qwen2.5-VL has no
  context parallelism (it never selects CP tokens): refused with a ValueError.

`Qwen3VLAdapter` refuses, with a ValueError naming the patch, a layout whose Bridge defect is not
patched here (`patches.apply_bridge_patches()`): deepstack gradients under TP + SP, the TE-only THD
CP index.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.models.adapter import ModelAdapter
from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.micro_batch import MicroBatch, VisionInputs

IGNORE_INDEX = -100


def full_length(local: torch.Tensor, micro_batch: MicroBatch, fill: int) -> torch.Tensor:
    """[..., T/cp] this CP rank's values -> [..., T] with them at `cp_index` and `fill` elsewhere.

    Unchanged when the micro-batch was not CP-localized.
    """
    if micro_batch.cp_index is None:
        return local
    total = micro_batch.input_ids.shape[-1]
    out = local.new_full((*local.shape[:-1], total), fill)
    out[..., micro_batch.cp_index] = local
    return out


def _layout(model) -> tuple[int, int, bool]:
    """(tp, cp, sequence_parallel) of the model's language config."""
    config = model.config
    return (int(config.tensor_model_parallel_size or 1), int(config.context_parallel_size or 1),
            bool(config.sequence_parallel))


def _require_patch(active: bool, defect: bool, what: str, apply_name: str) -> None:
    if defect and not active:
        raise ValueError(f"{what}: call megatron_vlm_packing.patches.{apply_name}() (or apply_bridge_patches()) "
                         f"before training")


class Qwen3VLAdapter(ModelAdapter):
    """Megatron-Bridge `Qwen3VLModel` (Qwen3-VL dense and MoE)."""

    consumes = frozenset({"images", "videos"})
    needs = LocalizeNeeds(full_input_ids=True, full_position_ids=True)

    def __init__(self, model):
        super().__init__(model)
        from megatron_vlm_packing.patches import bridge_deepstack_sp, bridge_thd_cp_index

        tp, cp, sp = _layout(model)
        deepstack = bool(getattr(model.vision_transformer_config, "deepstack_visual_indexes", None))
        if tp > 1 and sp and deepstack:
            _require_patch("split" in bridge_deepstack_sp._ORIGINAL,
                           bridge_deepstack_sp.upstream_deepstack_split_is_plain_slice(),
                           "Bridge's Qwen3-VL deepstack embeddings get wrong vision gradients under TP + SP",
                           "apply_bridge_deepstack_sp")
        if cp > 1:
            _require_patch("fn" in bridge_thd_cp_index._ORIGINAL, not bridge_thd_cp_index.te_thd_partition_available(),
                           "Bridge's packed CP token selection needs Transformer Engine's thd_get_partitioned_indices",
                           "apply_bridge_thd_cp_index")

    def forward(self, model, micro_batch: MicroBatch):
        mb = micro_batch
        vision = mb.vision or VisionInputs()
        positions = mb.position_ids if mb.position_ids.dim() == 3 else None  # else the model computes mRoPE
        return model(input_ids=mb.input_ids, position_ids=positions, attention_mask=None,
                     labels=full_length(mb.labels, mb, IGNORE_INDEX), packed_seq_params=mb.packed_seq_params,
                     pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                     pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw)


class Qwen25VLAdapter(ModelAdapter):
    """Megatron-Bridge `Qwen25VLModel` (Qwen2.5-VL)."""

    consumes = frozenset({"images", "videos"})
    needs = LocalizeNeeds(full_input_ids=True, full_position_ids=True)

    def __init__(self, model):
        super().__init__(model)
        _, cp, _ = _layout(model)
        if cp > 1:
            raise ValueError(f"Bridge's Qwen25VLModel does not select context-parallel tokens: with "
                             f"context_parallel_size={cp} every CP rank would run the whole sequence; "
                             f"train it with CP = 1 (TP, SP and PP are supported)")

    def forward(self, model, micro_batch: MicroBatch):
        mb = micro_batch
        vision = mb.vision or VisionInputs()
        return model(input_ids=mb.input_ids, labels=mb.labels, packed_seq_params=mb.packed_seq_params,
                     pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                     pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw,
                     second_per_grid_ts=vision.second_per_grid_ts)
