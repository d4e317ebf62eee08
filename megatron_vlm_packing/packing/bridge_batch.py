"""Megatron-Bridge's collated VLM and Omni batches in this package's batch format (`from_bridge_batch`).

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
  no error), so a batch carrying `visual_inputs` (or a Bridge pack's boundaries, below) is refused unless
  `label_style="megatron"`;
- `position_ids` are one arange per row over the whole padded row: Bridge's Qwen-VL models discard them
  (`Qwen3VLModel` keeps only [3, B, S] mRoPE positions, `Qwen25VLModel` recomputes its own from the ids and
  grids). They pass through unchanged: the packers' check of [B, S] positions (0..n-1 on each row's real
  tokens, `positions.check_1d_positions`, a ValueError naming the token otherwise) holds them, and each
  sample's positions (mRoPE from the model's own config) are computed from the ids as for any batch;
- rows are right-padded to a multiple of 128 (`data.collators.sequence.prepare_sequence_batch`) with
  `attention_mask` 0, `loss_mask` 0 and labels -100 there: the real lengths come from the mask, as for any
  right-padded batch, so those slots are neither packed nor counted.

Qwen3-Omni's collate (`models.qwen_omni.data.collate_fn.qwen3_omni_collate_fn`) shifts labels and pads rows the
same way but keeps the processor's keys, with no `visual_inputs`; Bridge's Omni step hands them to the thinker by
name. Two name a field of this format otherwise, each the same quantity, read by the same rule (renamed here,
`BRIDGE_OMNI_NAMES`, no unit converted):
- `video_second_per_grid` [V]: seconds per temporal grid step of each video (the processor's temporal patch
  size / fps); Bridge's and this package's Qwen3-Omni indexes both place a video's t positions at
  `arange(t) * it * position_id_per_seconds`: `second_per_grid_ts`;
- `audio_feature_lengths` [A]: each clip's real mel frames, which the collate adds as
  `feature_attention_mask.sum(-1)` (the processor has no such key) and Bridge's thinker passes to its index as
  `audio_seqlens`: `audio_seqlens` (checked against `feature_attention_mask`, clip by clip, errors naming it so).
Nothing else marks an Omni batch as Bridge's (an image-only one has only the processor's keys), so either key
under `label_style="hf"` is a ValueError saying both readings (Bridge's shifted labels, or an HF-style batch to
rename): accepted silently, a Bridge batch with videos or audio would be shifted twice. An image-only Bridge
Omni batch holds neither key: under "hf" the packers' check of labels against ids (`label_style`) refuses it.
Bridge's collate never sets `use_audio_in_video` (its chat-template arguments are the tools only) and its
thinker never reads it.

Batches Bridge has already packed (`enable_in_batch_packing=True`: one THD row with `cu_seqlens_q` and the
other `PackedSeqParams` fields as batch keys, `data.packing.in_batch`) are cut back into the right-padded rows
they were packed from (`rows_of_bridge_pack`: each document's real tokens, `cu_seqlens_q`, read from its
physical start, `cu_seqlens_q_padded`; one host read of the boundaries), which the step then packs as any batch:
at real lengths, aligned for the model's layout, each sample's own mRoPE positions. Bridge's own alignment
padding is not kept, so `in_batch_packing_pad_to_multiple_of` changes nothing here.

Nothing here imports Bridge: the object is read through `normalized_for_model()`, the method Bridge's step
calls. Pure: the batch given is not changed.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.media import VISION_KEYS
from megatron_vlm_packing.packing.media_audio import AUDIO_KEYS

BRIDGE_VISUAL_KEY = "visual_inputs"
# What Bridge's in-batch packing (`pack_right_padded_sequence_batch_to_mcore_thd`) adds to a batch.
BRIDGE_PACKED_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                      "max_seqlen_q", "max_seqlen_kv", "total_tokens")
# Megatron-Bridge's Qwen3-Omni collate's keys (the processor's and its own) -> this format's name for the same field.
BRIDGE_OMNI_NAMES = {"video_second_per_grid": "second_per_grid_ts", "audio_feature_lengths": "audio_seqlens"}
_OMNI_KEY_ORIGIN = {
    "video_second_per_grid": "is the Qwen3-Omni processor's name for second_per_grid_ts, kept by Megatron-Bridge's "
                             "qwen3_omni_collate_fn",
    "audio_feature_lengths": "is Megatron-Bridge's qwen3_omni_collate_fn's key (the processor has none)",
}
# visual_inputs fields that are batch keys here (mm_token_type_ids: read by the mRoPE index).
_UNPACKED_FIELDS = frozenset(VISION_KEYS) | frozenset(AUDIO_KEYS) | {"mm_token_type_ids"}


def from_bridge_batch(batch, label_style: str):
    """`batch` with Bridge's `visual_inputs` unpacked into batch keys (and a Bridge pack cut back into its rows);
    any other batch returned as it is.

    Args:
        batch: a collated batch (a mapping). Bridge's: `input_ids` (or `tokens`), `attention_mask`, arange
            `position_ids`, next-token `labels`, float `loss_mask`, `visual_inputs`.
        label_style: the packer's ("megatron" or "hf"); a Bridge batch needs "megatron".

    Returns:
        a new dict without `visual_inputs` and with its non-None fields as keys (a Bridge batch; a Bridge pack as
        right-padded rows with an `attention_mask`), Bridge's Qwen3-Omni keys under this format's names
        (`BRIDGE_OMNI_NAMES`), else `batch`.

    Raises:
        ValueError: a Bridge batch read with `label_style="hf"` (a Qwen3-Omni one: by its `video_second_per_grid`
            or `audio_feature_lengths`); a Bridge pack's key without `cu_seqlens_q` or `visual_inputs` (a key of
            the user's own by that name, under either style); an Omni key given beside its name here; a pack whose
            boundaries do not describe its row (`rows_of_bridge_pack`); a `visual_inputs` without
            `normalized_for_model()`, one whose field no adapter consumes, or whose field is also a key of the batch
            (naming the field).
    """
    if not isinstance(batch, Mapping):  # the packers name what it is
        return batch
    markers = [key for key in (BRIDGE_VISUAL_KEY, *BRIDGE_PACKED_KEYS) if key in batch]
    if not markers:
        return _from_bridge_omni_names(batch, label_style)
    if BRIDGE_VISUAL_KEY not in batch and batch.get("cu_seqlens_q") is None:  # e.g. a total_tokens of the user's own
        raise _no_boundaries(batch)
    if label_style != "megatron":
        raise ValueError(
            f"this batch is Megatron-Bridge's collate output (it carries {markers}), whose labels are "
            f"already next-token targets (labels[t] = input_ids[t + 1], loss_mask shifted with them); "
            f"label_style={label_style!r} would shift them again and train every token on the one after its "
            f"target: use make_forward_step(label_style='megatron') (pack_batch / PackingCollator: "
            f"label_style='megatron'){_own_pack_hint(batch)}")
    if any(key in batch for key in BRIDGE_PACKED_KEYS):
        batch = rows_of_bridge_pack(batch)
    unpacked = {key: value for key, value in batch.items() if key != BRIDGE_VISUAL_KEY}
    for name, value in _visual_fields(batch.get(BRIDGE_VISUAL_KEY)).items():  # a text pack has none
        if unpacked.get(name) is not None:
            raise ValueError(f"{BRIDGE_VISUAL_KEY}.{name} is given and so is the batch key {name!r}: "
                             f"give it once")
        unpacked[name] = value
    return _from_bridge_omni_names(unpacked, label_style)


def _from_bridge_omni_names(batch: Mapping, label_style: str):
    """`batch` with Bridge's Qwen3-Omni keys under this format's names (`BRIDGE_OMNI_NAMES`); `batch` itself without
    them. A ValueError for either under label_style "hf", or given beside the field's own name."""
    given = [key for key in BRIDGE_OMNI_NAMES if key in batch]
    if not given:
        return batch
    if label_style != "megatron":
        key = given[-1]  # audio_feature_lengths when given: only Bridge's collate adds it, not the processor
        raise ValueError(
            f"batch key {key!r} {_OMNI_KEY_ORIGIN[key]}, whose labels are already next-token targets "
            f"(labels[t] = input_ids[t + 1]): label_style={label_style!r} would shift them again. Bridge's batch: "
            f"use label_style='megatron' (it is read as {BRIDGE_OMNI_NAMES[key]}); a batch with unshifted (Hugging "
            f"Face) labels: rename it {BRIDGE_OMNI_NAMES[key]}")
    renamed = {key: value for key, value in batch.items() if key not in BRIDGE_OMNI_NAMES}
    for key in given:
        ours = BRIDGE_OMNI_NAMES[key]
        if batch.get(ours) is not None:
            raise ValueError(f"{key} (Megatron-Bridge's name for {ours}) is given and so is the batch key "
                             f"{ours!r}: give it once")
        renamed[ours] = batch[key]
    return renamed


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


# The [1, T] sequence fields of a Bridge pack and the value at the slots after each document's real tokens.
_PACK_FIELD_FILLS = {"input_ids": 0, "tokens": 0, "labels": -100, "loss_mask": 0, "position_ids": 0,
                     "mm_token_type_ids": 0}
_BOUNDARY_KEYS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_LENGTH_KEYS = ("max_seqlen_q", "max_seqlen_kv", "total_tokens")
_BETWEEN = "targets between documents"  # the count `_pack_numbers` reads with the boundaries


def rows_of_bridge_pack(batch: Mapping) -> dict:
    """Bridge's in-batch pack (one [1, T] THD row, `cu_seqlens_q` and the other `PackedSeqParams` fields as keys)
    as the right-padded [N, L] rows it was packed from (L = the longest document), with an `attention_mask`.

    Each document's real tokens, `cu_seqlens_q[i + 1] - cu_seqlens_q[i]`, are read from its physical start
    (`cu_seqlens_q_padded[i]`, or `cu_seqlens_q[i]` without alignment padding) in every sequence field (ids,
    labels, loss mask, positions, `mm_token_type_ids`); the other keys are kept. Bridge cut labels and loss mask
    per row before packing, so each document's last label is its own. One host read (`_pack_numbers`).

    Raises:
        ValueError: naming the field and the numbers: no `cu_seqlens_q`; boundaries that are not [N + 1] integers
            (a tensor, list or tuple) from 0, rising by at least 1 (real) and by at least the real length
            (physical) and ending at T; _kv boundaries that differ from the _q ones, or `cu_seqlens_kv_padded`
            without `cu_seqlens_q_padded`; a `total_tokens` other than T, a `max_seqlen_q` / `_kv` below the
            longest document's slots; a target (loss_mask != 0, or without one a label) in the slots between
            documents, which no row keeps; a sequence field not [1, T]; an `attention_mask` beside the boundaries.
    """
    if batch.get("cu_seqlens_q") is None:
        raise _no_boundaries(batch)
    if batch.get("attention_mask") is not None:
        raise ValueError("a Bridge pack (cu_seqlens_q given) carries an attention_mask: its packer leaves it None; "
                         "the boundaries say where each document is")
    fields = {key: batch[key] for key in _PACK_FIELD_FILLS if batch.get(key) is not None}
    total = _pack_length(fields)
    numbers = _pack_numbers(batch, fields, total)
    real = numbers["cu_seqlens_q"]
    starts = numbers.get("cu_seqlens_q_padded", real)
    lengths = _checked_documents(numbers, total)
    if numbers.get(_BETWEEN):
        raise _targets_between_error(fields, real, starts, numbers[_BETWEEN])
    width = max(lengths)
    offsets = torch.arange(width)
    keep = offsets[None, :] < torch.tensor(lengths)[:, None]  # [N, L]
    slots = (torch.tensor(starts[:-1])[:, None] + offsets[None, :]).clamp(max=total - 1)  # [N, L] pack slots
    rows = {key: value for key, value in batch.items() if key not in BRIDGE_PACKED_KEYS}
    for key, value in fields.items():
        gathered = value[0][slots.to(value.device)]
        rows[key] = torch.where(keep.to(value.device), gathered, torch.full_like(gathered, _PACK_FIELD_FILLS[key]))
    rows["attention_mask"] = keep.long().to(next(iter(fields.values())).device)
    return rows


def _own_pack_hint(batch: Mapping) -> str:
    """For the error of a pack read with label_style "hf": how to give a pack of the user's own whose labels are
    unshifted (Hugging Face's DataCollatorWithFlattening under Megatron's key names), its document lengths read back
    (error path only); "" for a batch with `visual_inputs` or no `cu_seqlens_q` (no pack)."""
    if BRIDGE_VISUAL_KEY in batch or batch.get("cu_seqlens_q") is None:
        return ""
    value = batch["cu_seqlens_q"]
    values = value.tolist() if isinstance(value, (torch.Tensor, np.ndarray)) else value
    whole = isinstance(values, (list, tuple)) and all(is_int(v) for v in values)
    lengths = [int(b - a) for a, b in zip(values, values[1:])] if whole else "..."
    return (f". A pack of your own with unshifted labels (Hugging Face's): give it without the pack's keys, with "
            f"document_lengths [{lengths}] (each document's length, from cu_seqlens_q), and label_style='hf'")


def _no_boundaries(batch: Mapping) -> ValueError:
    """The error for a batch with some of `BRIDGE_PACKED_KEYS` but no `cu_seqlens_q`: no Bridge pack (a key of the
    user's own that shares a name with one of its fields, most likely)."""
    return ValueError(f"the batch carries {[k for k in BRIDGE_PACKED_KEYS if k in batch]}, the fields of a "
                      f"Megatron-Bridge in-batch pack, without its cu_seqlens_q (where each document is), so it is no "
                      f"Bridge pack: a key of your own by that name, rename it or leave it out (rows of your own "
                      f"pre-packed documents: give document_lengths, docs/batch_format.md)")


def _pack_numbers(batch: Mapping, fields: dict, total: int) -> dict:
    """The pack's numbers on the host, in one read (the boundaries may be on an accelerator): every boundary given
    (`_BOUNDARY_KEYS`, lists of ints), `max_seqlen_q` / `_kv` and `total_tokens` (ints), and the count of targets
    in the slots between documents (`_BETWEEN`, when `cu_seqlens_q_padded` leaves such slots)."""
    device = next(iter(fields.values())).device
    parts = {key: _boundary_tensor(batch[key], key, device) for key in _BOUNDARY_KEYS if batch.get(key) is not None}
    parts.update({key: _length_tensor(batch[key], key, device) for key in _LENGTH_KEYS if batch.get(key) is not None})
    padded = parts.get("cu_seqlens_q_padded")
    if padded is not None and padded.shape == parts["cu_seqlens_q"].shape:
        parts[_BETWEEN] = _targets_between(fields, parts["cu_seqlens_q"], padded, total).reshape(1)
    flat = torch.cat(list(parts.values())).tolist()  # the one host read
    numbers, at = {}, 0
    for key, part in parts.items():
        values, at = flat[at:at + part.numel()], at + part.numel()
        numbers[key] = values if key in _BOUNDARY_KEYS else values[0]
    return numbers


def _boundary_tensor(value, key: str, device: torch.device) -> torch.Tensor:
    """[N + 1] int64 on `device` of a boundary key (a 1-D integer tensor or numpy array, or a list or tuple of ints,
    numpy ints included), not read."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        value = torch.from_numpy(value)
    if isinstance(value, torch.Tensor):
        if value.dim() == 1 and value.numel() >= 2 and _integer_dtype(value):
            return value.to(device=device, dtype=torch.int64)
    elif isinstance(value, (list, tuple)) and len(value) >= 2 and all(is_int(v) for v in value):
        return torch.tensor([int(v) for v in value], dtype=torch.int64, device=device)
    raise ValueError(f"{key} must be [N + 1] int boundaries from 0 (a Bridge pack's: a 1-D integer tensor or "
                     f"array, or a list of ints), got {_described(value)}")


def _length_tensor(value, key: str, device: torch.device) -> torch.Tensor:
    """[1] int64 on `device` of `max_seqlen_q` / `_kv` / `total_tokens` (an int, numpy's too, or a 0-dim integer
    tensor), not read."""
    if is_int(value):
        return torch.tensor([int(value)], dtype=torch.int64, device=device)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _integer_dtype(value):
        return value.reshape(1).to(device=device, dtype=torch.int64)
    raise ValueError(f"{key} must be an int (or a 0-dim integer tensor), got {_described(value)}")


def _integer_dtype(value: torch.Tensor) -> bool:
    return not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool


def _described(value) -> str:
    """A tensor's or array's dtype and shape (its values are not read), else the value's repr."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(value, torch.Tensor) else "array"
        return f"a {value.dtype} {kind} of shape {tuple(value.shape)}"
    return repr(value)


def _targets_between(fields: dict, real: torch.Tensor, starts: torch.Tensor, total: int) -> torch.Tensor:
    """0-dim int64, not read: the slots between documents (after a document's real tokens, `real`, before the next
    one's physical start, `starts`: [N + 1] each) that are targets: `loss_mask` != 0, or without one a label."""
    target = fields.get("loss_mask")
    target = target[0] != 0 if target is not None else fields["labels"][0] != -100 if "labels" in fields else None
    if target is None:
        return torch.zeros((), dtype=torch.int64, device=starts.device)
    slot = torch.arange(total, device=starts.device)
    # each slot's document; clamped: boundaries not yet checked must index in range (they are checked before use)
    document = (torch.searchsorted(starts, slot, right=True) - 1).clamp(0, starts.numel() - 2)
    between = slot - starts[document] >= real[1:][document] - real[:-1][document]
    return (between & target.to(starts.device)).sum()


def _checked_documents(numbers: dict, total: int) -> list[int]:
    """The [N] real lengths of a pack's documents, after checking its boundaries and lengths (`_pack_numbers`)."""
    for key in _BOUNDARY_KEYS:
        values = numbers.get(key)
        if values is not None and (values[0] != 0 or any(b < a for a, b in zip(values, values[1:]))):
            raise ValueError(f"{key} must be [N + 1] non-decreasing int boundaries from 0 (a Bridge pack's), "
                             f"got {values}")
    if "cu_seqlens_kv_padded" in numbers and "cu_seqlens_q_padded" not in numbers:
        raise ValueError(f"cu_seqlens_kv_padded is given without cu_seqlens_q_padded (cu_seqlens_q "
                         f"{numbers['cu_seqlens_q']}, cu_seqlens_kv_padded {numbers['cu_seqlens_kv_padded']}): a "
                         f"Bridge pack sets both or neither; give cu_seqlens_q_padded, where each document starts")
    for q_key, kv_key in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        if kv_key in numbers and numbers[kv_key] != numbers[q_key]:
            raise ValueError(f"{kv_key} {numbers[kv_key]} differs from {q_key} {numbers[q_key]}: a Bridge pack "
                             f"attends within the same documents")
    real = numbers["cu_seqlens_q"]
    starts = numbers.get("cu_seqlens_q_padded", real)
    lengths = [b - a for a, b in zip(real, real[1:])]
    physical = [b - a for a, b in zip(starts, starts[1:])]
    if len(starts) != len(real) or starts[-1] != total or min(lengths) < 1 or \
            any(n > room for n, room in zip(lengths, physical)):
        raise ValueError(f"the Bridge pack's boundaries do not describe its {total} slots: cu_seqlens_q {real}, "
                         f"cu_seqlens_q_padded {numbers.get('cu_seqlens_q_padded')} (documents of at least 1 token, "
                         f"each within its physical slots, the last ending at {total})")
    if numbers.get("total_tokens", total) != total:
        raise ValueError(f"total_tokens {numbers['total_tokens']} differs from the Bridge pack's {total} slots (its "
                         f"[1, T] fields and the last boundary)")
    for key in ("max_seqlen_q", "max_seqlen_kv"):  # an upper bound may be larger (Megatron's convention)
        if numbers.get(key, max(physical)) < max(physical):
            raise ValueError(f"{key} {numbers[key]} is below the Bridge pack's longest document, {max(physical)} "
                             f"slots (cu_seqlens_q_padded, else cu_seqlens_q {real})")
    return lengths


def _targets_between_error(fields: dict, real: list[int], starts: list[int], count: int) -> ValueError:
    """The error for `count` targets between documents, naming the first (its slot, value and document); reads the
    fields back: error path only."""
    name = "loss_mask" if "loss_mask" in fields else "labels"
    target = fields[name][0] != 0 if name == "loss_mask" else fields[name][0] != -100
    for doc, (start, end, length) in enumerate(zip(starts, starts[1:], (b - a for a, b in zip(real, real[1:])))):
        hits = torch.nonzero(target[start + length:end]).flatten().tolist()
        if hits:
            slot = start + length + hits[0]
            break
    what = "loss_mask != 0" if name == "loss_mask" else "a label other than -100, no loss_mask given"
    return ValueError(
        f"{count} target{'s' if count > 1 else ''} ({what}) {'lies' if count == 1 else 'lie'} between documents of the "
        f"Bridge pack: first at slot {slot}, {name} {fields[name][0, slot].item()}, after document {doc}'s {length} "
        f"real tokens (cu_seqlens_q {real}) and before the next physical start {end} (cu_seqlens_q_padded "
        f"{starts}). Bridge's loss counts it; the rows cut back from the pack have no slot for it: give those slots "
        f"loss_mask 0 and label -100, or boundaries that include them")


def _pack_length(fields: dict) -> int:
    """T of a Bridge pack's [1, T] sequence fields, each checked to be [1, T]."""
    if not fields or not any(key in fields for key in ("input_ids", "tokens")):
        raise ValueError("a Bridge pack (cu_seqlens_q given) needs its [1, T] input_ids (or tokens)")
    shapes = {key: tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
              for key, value in fields.items()}
    first = next(iter(shapes.values()))
    if len(set(shapes.values())) != 1 or len(first) != 2 or first[0] != 1:
        raise ValueError(f"a Bridge pack's sequence fields must all be one [1, T] row, got {shapes}")
    return first[1]
