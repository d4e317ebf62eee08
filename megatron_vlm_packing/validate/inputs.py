"""What the validator reads: a packed micro-batch from any packer, normalised to flat tensors.

`build_inputs(...)` takes a `MicroBatch`, our `PackedBatch`, a mapping with the saved-batch
keys (see `SAVED_KEYS`), or keywords, and flattens every sequence-aligned tensor to [T] ([3, T] for
mRoPE positions) on the host (each loose value made a tensor, int or bool by `validate.coerce`, or a
ValueError naming it). Nothing here judges the data; the checks do.

The values come from `raw_inputs.gathered`; the dataclasses built here are `packed_inputs.PackedInputs`
and `SourceRows`.

Shape legend: T = physical packed slots, N = documents, B = source rows, S = source row length.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Mapping

import torch

from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.packing.media_tokens import given_or_config
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.packing.row_fields import check_label_style, check_mrope, check_pad_token_id
from megatron_vlm_packing.validate.coerce import bool_field, count_field, dense_tensor, flat_tokens, int_field
from megatron_vlm_packing.validate.packed_inputs import PackedInputs, SourceRows  # noqa: F401 (SourceRows: as before)
from megatron_vlm_packing.validate.raw_inputs import gathered
from megatron_vlm_packing.validate.saved_keys import SAVED_KEYS  # noqa: F401 (its home is saved_keys; as before)


def _defaults_from_mrope(values: dict) -> None:
    """Placeholder ids, merge size and audio window not given: the `MRopeConfig`'s (the model's own ids), so
    the grids and audio lengths can be split per document for its index. A callable names none.

    Raises:
        ValueError: a value given (or carried by the micro-batch) that is not an int (`int_field`, checked
            first), or that contradicts the config's: the placeholders would be counted with one value and
            the index asked with the other.
    """
    from megatron_vlm_packing.rope import MRopeConfig

    config = values.get("mrope")
    if not isinstance(config, MRopeConfig):
        return
    names = ("image_token_id", "video_token_id", "audio_token_id", "spatial_merge_size", "audio_n_window")
    values.update(given_or_config(
        {name: values.get(name) for name in names}, {name: getattr(config, name, None) for name in names},
        read=lambda name, given: int_field(given, name, dict(_INT_FIELDS)[name]),  # a [2] tensor: no truth value
        show=repr, why=": the placeholders would be counted with one and the model's index asked with the other"))


_SEQUENCE_FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")
_TENSOR_FIELDS = ("cu_seqlens", "cu_seqlens_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded", "image_grid_thw",
                  "video_grid_thw", "cp_index", "second_per_grid_ts", "audio_seqlens")
_COUNT_FIELDS = ("images_per_document", "videos_per_document", "audios_per_document")
# scalars a check divides by, compares with or indexes by: ints (>= the minimum, when one), or a ValueError naming them
_INT_FIELDS = (("image_token_id", None), ("video_token_id", None), ("pad_token_id", None), ("ignore_index", None),
               ("cp_rank", 0), ("spatial_merge_size", 1), ("audio_token_id", None), ("audio_n_window", 1))


def _layout_values(values: dict) -> dict:
    """`values` with the layout (`layout=ParallelLayout`, or `tp_size`, `cp_size`, `sequence_parallel`, `fp8`;
    `fp8` is also read beside a layout) replaced by the alignment `multiples` and `cp_size` it implies, and
    `cp_rank` a layout's unless given. Without any layout value, `values` unchanged (a copy).

    Raises:
        ValueError: a layout value that is not an int (sizes) or a bool (flags).
    """
    values = dict(values)
    layout = values.pop("layout", None)
    layout_keys = {k: values.pop(k) for k in ("tp_size", "cp_size", "sequence_parallel", "fp8") if k in values}
    if layout is not None:
        layout_keys = dict(tp_size=layout.tp_size, cp_size=layout.cp_size,
                           sequence_parallel=layout.sequence_parallel, fp8=layout_keys.get("fp8", False))
        values.setdefault("cp_rank", layout.cp_rank)
    if layout_keys:
        # int_field: int(2.5) would check a cp_size of 2 silently
        layout_keys = {k: (bool_field(v, k) if k in ("sequence_parallel", "fp8") else int_field(v, k))
                       for k, v in layout_keys.items()}
        values["multiples"] = PackMultiples.for_parallel(**layout_keys)
        values["cp_size"] = layout_keys.get("cp_size", 1)
    return values


def _paired_max_seqlen(values: dict) -> dict:
    """`values` with a single `max_seqlen` made the (q, kv) pair, kv from `max_seqlen_kv` (taken out) or q;
    `max_seqlen_kv` alone makes (None, kv) (it was left in as an unknown input)."""
    if values.get("max_seqlen") is None and "max_seqlen_kv" in values:
        values = dict(values)
        kv = values.pop("max_seqlen_kv")
        return {**values, "max_seqlen": (None, kv)} if kv is not None else values
    if values.get("max_seqlen") is None or isinstance(values["max_seqlen"], tuple):
        return values
    values = dict(values)
    values["max_seqlen"] = (values["max_seqlen"], values.pop("max_seqlen_kv", values["max_seqlen"]))
    return values


def _flat_sequences(values: dict) -> dict:
    """The five sequence fields flattened (`flat_tokens`: [T], positions [T] or [3, T]; None when not given).

    Raises:
        ValueError: no `input_ids`, or a field that is not a tensor of a packed batch's shape.
    """
    if values.get("input_ids") is None:
        raise ValueError("the packed batch needs input_ids (or tokens)")
    return {name: flat_tokens(values.get(name), name) for name in _SEQUENCE_FIELDS}


def _tensor_values(values: dict) -> dict:
    """Boundaries, grids, `cp_index`, seconds and audio lengths given, as dense CPU tensors (`dense_tensor`)."""
    return {name: dense_tensor(values[name], name) for name in _TENSOR_FIELDS if values.get(name) is not None}


def _localized_total(values: dict) -> dict:
    """`localized_total` (T) from `cu_seqlens_padded`'s last entry when a `cp_index` is given without it: the
    batch was localized to one CP rank, so its sequence fields hold T/cp slots (input_ids may be full or not).
    Nothing when that set is missing, or not a 1-D integer tensor ending above 0 (`check_boundaries` names it)."""
    if values.get("cp_index") is None or values.get("localized_total") is not None:
        return {}
    physical = values.get("cu_seqlens_padded")  # without it T is input_ids' (full ids are then checked against it)
    if physical is None or physical.dim() != 1 or not physical.numel() or not is_integer_tensor(physical):
        return {}
    total = int(physical[-1])
    return {"localized_total": total} if total > 0 else {}


def _count_values(values: dict) -> dict:
    """The images / videos / audios per document given, as tuples of ints (`count_field`)."""
    return {name: count_field(values[name], name) for name in _COUNT_FIELDS if values.get(name) is not None}


def _scalar_values(values: dict) -> dict:
    """The int fields given (`_INT_FIELDS`, each checked against its minimum) and `use_audio_in_video` as a bool."""
    out = {name: int_field(values[name], name, minimum)
           for name, minimum in _INT_FIELDS if values.get(name) is not None}
    if "pad_token_id" in out:  # an id no slot can hold (-1, 2**70) left the checks reading it inert: the packers' rule
        out["pad_token_id"] = check_pad_token_id(out["pad_token_id"])
    if values.get("use_audio_in_video") is not None:
        out["use_audio_in_video"] = bool_field(values["use_audio_in_video"], "use_audio_in_video")
    return out


def _label_style_value(values: dict) -> dict:
    """{"label_style": ...} as given (the packers' rule); {} when not given: `SourceRows`' default style is not
    the caller's word on the labels.

    Raises:
        ValueError: a style other than "hf" / "megatron", or one contradicting the style the source rows' labels
            are read by (each would judge the last tokens by another rule).
    """
    given, source = values.get("label_style"), values.get("source")
    if given is None:
        return {}
    check_label_style(given)
    if source is not None and source.labels is not None and source.label_style != given:
        raise ValueError(f"label_style={given!r} contradicts the source rows' label_style={source.label_style!r}")
    return {"label_style": given}


def _cp_ranks_value(ranks) -> dict[int, dict[str, torch.Tensor]]:
    """{rank: {name: tensor}} with int ranks and dense CPU tensors (None entries left out).

    Raises:
        ValueError: `ranks` is not a mapping of mappings, a rank is not an int, or an entry not a tensor.
    """
    if not isinstance(ranks, Mapping) or not all(isinstance(r, Mapping) for r in ranks.values()):
        raise ValueError(f"cp_ranks must be {{rank: {{'cp_index': ..., 'labels': ..., ...}}}} (a dict of tensors "
                         f"per rank), got {str(ranks)[:80]}")
    for r, received in ranks.items():  # a tensor under another name would be ignored: what the rank got, unchecked
        unknown = sorted(set(received) - set(_CP_RANK_FIELDS), key=repr)
        if unknown:
            raise ValueError(f"unknown cp_ranks[{r}] fields {unknown}; known: {list(_CP_RANK_FIELDS)}")
    return {int_field(r, "a cp_ranks rank"): {k: dense_tensor(v, f"cp_ranks[{r}][{k!r}]")
                                              for k, v in received.items() if v is not None}
            for r, received in ranks.items()}


# What a CP rank may be given in `cp_ranks` (validate.cp compares each with the full batch at TE's index).
_CP_RANK_FIELDS = ("cp_index", "input_ids", "labels", "loss_mask", "padding_mask", "position_ids")


def _check_known(values: dict) -> None:
    """Every key of `values` is a `PackedInputs` field; ValueError naming the others and the known ones."""
    known = {f.name for f in fields(PackedInputs)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown inputs {unknown}; known: {sorted(known)}")


def build_inputs(batch=None, **overrides) -> PackedInputs:
    """Normalise `batch` (MicroBatch / PackedBatch / mapping / None) plus keyword overrides.

    Layout keywords: `tp_size`, `cp_size`, `sequence_parallel`, `fp8` (or `layout=ParallelLayout`),
    from which the alignment multiples are derived; without any, the batch's own plan multiples (if it
    has a plan) are checked, else no alignment.

    Raises:
        ValueError: no input_ids, an unknown key, or a tensor whose shape cannot be a packed batch.
    """
    values = _layout_values(gathered(batch, overrides))
    values = _paired_max_seqlen(values)
    values.update(_flat_sequences(values))
    _defaults_from_mrope(values)
    values.update(_tensor_values(values))
    values.update(_localized_total(values))
    values.update(_count_values(values))
    values.update(_scalar_values(values))
    values.update(_label_style_value(values))
    if values.get("cp_ranks") is not None:
        values["cp_ranks"] = _cp_ranks_value(values["cp_ranks"])
    check_mrope(values.get("mrope"))  # the packers' rule: None, an MRopeConfig or the model's index callable
    _check_known(values)
    return PackedInputs(**values)
