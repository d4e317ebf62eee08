"""Megatron-Bridge's collated VLM batches in this package's batch format (`from_bridge_batch`).

Bridge's dataset providers collate with model-owned functions (`megatron.bridge.data.collators.registry`;
Qwen2.5-VL and Qwen3-VL: `models.qwen_vl.data.collate_fn.qwen2_5_collate_fn`) whose batches differ from a
processor's output in four ways, each read here as Bridge's own `vlm_step` reads it:

- the vision tensors sit in one `visual_inputs` object (`training.utils.visual_inputs.GenericVisualInputs`);
  Bridge's step hands the model `visual_inputs.normalized_for_model()`, its non-None fields by name. They
  become batch keys of the same names; a field no adapter here consumes (`image_sizes`, `image_position_ids`:
  Gemma / Pixtral fields) is a ValueError naming it, never dropped;
- `labels` are already next-token targets (`labels[t] = input_ids[t + 1]`, -100 where the float `loss_mask`,
  shifted with them, is 0; the row's last slot -100): Megatron's convention. Read with `label_style="hf"` they
  would be shifted a second time (every token trained on the one after its target, one target per row lost,
  no error), so a batch carrying `visual_inputs` is refused unless `label_style="megatron"`;
- `position_ids` are one arange per row over the whole padded row: Bridge's Qwen-VL models discard them
  (`Qwen3VLModel` keeps only [3, B, S] mRoPE positions, `Qwen25VLModel` recomputes its own from the ids and
  grids). They pass through unchanged: the packers' check of [B, S] positions (0..n-1 on each row's real
  tokens, `positions.check_1d_positions`, a ValueError naming the token otherwise) holds them, and each
  sample's positions (mRoPE from the model's own config) are computed from the ids as for any batch;
- rows are right-padded to a multiple of 128 (`data.collators.sequence.prepare_sequence_batch`) with
  `attention_mask` 0, `loss_mask` 0 and labels -100 there: the real lengths come from the mask, as for any
  right-padded batch, so those slots are neither packed nor counted.

Batches Bridge has already packed (`enable_in_batch_packing=True`: one THD row with `cu_seqlens_q` and the
other `PackedSeqParams` fields as batch keys, `data.packing.in_batch`) are refused with a ValueError saying
to turn that packing off: the step packs itself, at real lengths and with the layout's alignment.

Nothing here imports Bridge: the object is read through `normalized_for_model()`, the method Bridge's step
calls. Pure: the batch given is not changed.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_vlm_packing.packing.media import VISION_KEYS
from megatron_vlm_packing.packing.media_audio import AUDIO_KEYS

BRIDGE_VISUAL_KEY = "visual_inputs"
# What Bridge's in-batch packing (`pack_right_padded_sequence_batch_to_mcore_thd`) adds to a batch.
BRIDGE_PACKED_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                      "max_seqlen_q", "max_seqlen_kv", "total_tokens")
# visual_inputs fields that are batch keys here (mm_token_type_ids: read by the mRoPE index).
_UNPACKED_FIELDS = frozenset(VISION_KEYS) | frozenset(AUDIO_KEYS) | {"mm_token_type_ids"}


def is_bridge_batch(batch) -> bool:
    """True when `batch` is a mapping carrying Bridge's `visual_inputs` key (its VLM collators always set it)."""
    return isinstance(batch, Mapping) and BRIDGE_VISUAL_KEY in batch


def from_bridge_batch(batch, label_style: str):
    """`batch` with Bridge's `visual_inputs` unpacked into batch keys; any other batch returned as it is.

    Args:
        batch: a collated batch (a mapping). Bridge's: `input_ids` (or `tokens`), `attention_mask`, arange
            `position_ids`, next-token `labels`, float `loss_mask`, `visual_inputs`.
        label_style: the packer's ("megatron" or "hf"); a Bridge batch needs "megatron".

    Returns:
        a new dict without `visual_inputs` and with its non-None fields as keys (a Bridge batch), else `batch`.

    Raises:
        ValueError: a batch Bridge already packed (names the keys and `enable_in_batch_packing`); a Bridge
            batch read with `label_style="hf"`; a `visual_inputs` without `normalized_for_model()`, one whose
            field no adapter consumes, or whose field is also a key of the batch (naming the field).
    """
    if not isinstance(batch, Mapping):  # the packers name what it is
        return batch
    packed = [key for key in BRIDGE_PACKED_KEYS if key in batch]
    if packed:
        raise ValueError(
            f"this batch was already packed by Megatron-Bridge's in-batch packing (it carries {packed}: one THD row "
            f"whose boundaries the collator chose): set enable_in_batch_packing=False in Bridge's dataset config; "
            f"the step packs each micro-batch itself, at real lengths, aligned for the model's TP / CP / SP layout, "
            f"with each sample's own mRoPE positions")
    if BRIDGE_VISUAL_KEY not in batch:
        return batch
    if label_style != "megatron":
        raise ValueError(
            f"this batch is Megatron-Bridge's collate output (it carries {BRIDGE_VISUAL_KEY!r}), whose labels are "
            f"already next-token targets (labels[t] = input_ids[t + 1], loss_mask shifted with them); "
            f"label_style={label_style!r} would shift them again and train every token on the one after its "
            f"target: use make_forward_step(label_style='megatron') (pack_batch / PackingCollator: "
            f"label_style='megatron')")
    unpacked = {key: value for key, value in batch.items() if key != BRIDGE_VISUAL_KEY}
    for name, value in _visual_fields(batch[BRIDGE_VISUAL_KEY]).items():
        if unpacked.get(name) is not None:
            raise ValueError(f"{BRIDGE_VISUAL_KEY}.{name} is given and so is the batch key {name!r}: "
                             f"give it once")
        unpacked[name] = value
    return unpacked


def _visual_fields(visual_inputs) -> dict:
    """The non-None fields of Bridge's visual inputs object, as Bridge's `vlm_step` hands them to the model."""
    if visual_inputs is None:  # Bridge's step takes None too: no media
        return {}
    normalized = getattr(visual_inputs, "normalized_for_model", None)
    if not callable(normalized):
        raise ValueError(f"{BRIDGE_VISUAL_KEY} must be Megatron-Bridge's visual inputs object (with "
                         f"normalized_for_model(), e.g. GenericVisualInputs), got {type(visual_inputs).__name__}")
    fields = {name: value for name, value in normalized().items() if value is not None}
    unread = sorted(set(fields) - _UNPACKED_FIELDS)
    if unread:
        shapes = {name: tuple(fields[name].shape) if isinstance(fields[name], torch.Tensor)
                  else type(fields[name]).__name__ for name in unread}
        raise ValueError(f"{BRIDGE_VISUAL_KEY} carries {shapes}, which no model adapter here consumes (they would "
                         f"be dropped): the step takes {sorted(_UNPACKED_FIELDS)}")
    return fields
