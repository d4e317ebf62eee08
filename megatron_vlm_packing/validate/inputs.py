"""What the validator reads: a packed micro-batch from any packer, normalised to flat tensors.

`build_inputs(...)` takes a `MicroBatch`, our `PackedBatch`, a mapping with the saved-batch
keys (see `SAVED_KEYS`), or keywords, and flattens every sequence-aligned tensor to [T] ([3, T] for
mRoPE positions) on the host (each loose value made a tensor, int or bool by `validate.coerce`, or a
ValueError naming it). Nothing here judges the data; the checks do.

Shape legend: T = physical packed slots, N = documents, B = source rows, S = source row length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.packing.lengths import lengths_from_keep_mask, widened_unsigned
from megatron_vlm_packing.packing.media_tokens import given_or_config
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.packing.row_fields import check_label_style, check_mrope, check_pad_token_id
from megatron_vlm_packing.validate.coerce import bool_field, count_field, dense_tensor, flat_tokens, int_field
from megatron_vlm_packing.validate.saved_keys import SAVED_KEYS


@dataclass(frozen=True)
class SourceRows:
    """The unpacked, right-padded rows a pack was made from.

    Attributes:
        input_ids: [B, S] long.
        attention_mask: [B, S], 1 at real tokens; None = every row full.
        labels: [B, S] long, -100 = no target; None = not compared.
        loss_mask: [B, S] float weights (Megatron style), optional.
        label_style: "hf" (labels unshifted: token s learns labels[s+1]) or "megatron" (token s learns labels[s]).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    label_style: str = "hf"

    def __post_init__(self) -> None:
        """Each row field a dense CPU tensor (uint16 / uint32 read as int64) of input_ids' [B, S], the mask
        right-padded 0/1 (the packers' rule, `lengths_from_keep_mask`): the rows are the reference a pack is
        judged against, so one that cannot be read as rows is a ValueError naming it (`source_<field>`)."""
        check_label_style(self.label_style)  # the packers' rule and message
        for name in ("input_ids", "attention_mask", "labels", "loss_mask"):
            value = getattr(self, name)
            if value is not None:
                value = widened_unsigned(dense_tensor(value, f"source_{name}"), f"source_{name}")
                object.__setattr__(self, name, value)  # frozen: the checked tensor replaces what was given
        if self.input_ids.dim() != 2:
            raise ValueError(f"source_input_ids must be [B, S], got shape {tuple(self.input_ids.shape)}")
        for name in ("attention_mask", "labels", "loss_mask"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(f"source_{name} must be [B, S] like source_input_ids {tuple(self.input_ids.shape)}, "
                                 f"got shape {tuple(value.shape)}")
        if self.attention_mask is not None:
            lengths_from_keep_mask(self.attention_mask, field="source_attention_mask")

    def lengths(self) -> list[int]:
        """Real length of each row (the count of 1s in its right-padded mask, checked when made)."""
        if self.attention_mask is None:
            return [self.input_ids.shape[1]] * self.input_ids.shape[0]
        return (self.attention_mask != 0).sum(dim=1).tolist()


@dataclass(frozen=True)
class PackedInputs:
    """A packed micro-batch, flattened. Every tensor on the CPU.

    Attributes:
        input_ids: [T] long.
        labels, loss_mask, padding_mask: [T] or None.
        position_ids: [T] or [3, T] or None.
        cu_seqlens, cu_seqlens_padded: [N+1] as given (any dtype), or None; `cu_seqlens_kv*` likewise.
        max_seqlen: (q, kv) as given.
        multiples: alignment the layout needs; cp_size: for the CP partition check.
        cp_index: [T/cp] when the batch was already localized to one CP rank.
        cp_rank: the rank `cp_index` belongs to, when known.
        second_per_grid_ts: [V] float seconds per video temporal grid step, or None.
        audio_seqlens: [A] long raw audio lengths per clip (token order), or None; audio_token_id,
            audios_per_document and audio_n_window (None: the mrope config's, else 50) split them per document.
        use_audio_in_video: given to an mrope callable that takes it; None = told per document.
        label_style: how the samples' labels were given before packing: "hf" (unshifted: a sample's last token
            has no target, so in a correct pack every document's last real token is untrained) or "megatron"
            (already next-token); None = not said (the source rows' style reads their labels only).
        mrope: an `MRopeConfig` or callable(ids [1, L], image_grid_thw=, video_grid_thw=, ...) -> [3, 1, L]
            (a callable gets the inputs its signature names: second_per_grid_ts / second_per_grids,
            audio_seqlens, use_audio_in_video, and mm_token_type_ids read from the placeholder ids). With an `MRopeConfig`, placeholder ids and the merge size
            not given are the config's.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen: tuple[Any, Any] | None = None
    has_packed_seq_params: bool = False
    image_grid_thw: torch.Tensor | None = None
    image_token_id: int | None = None
    video_grid_thw: torch.Tensor | None = None
    video_token_id: int | None = None
    spatial_merge_size: int = 2
    images_per_document: tuple[int, ...] | None = None
    videos_per_document: tuple[int, ...] | None = None
    second_per_grid_ts: torch.Tensor | None = None
    audio_seqlens: torch.Tensor | None = None
    audio_token_id: int | None = None
    audios_per_document: tuple[int, ...] | None = None
    audio_n_window: int | None = None
    use_audio_in_video: bool | None = None
    source: SourceRows | None = None
    multiples: PackMultiples = PackMultiples()
    cp_size: int = 1
    cp_ranks: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    cp_index: torch.Tensor | None = None
    cp_rank: int | None = None
    pad_token_id: int | None = None
    mrope: Any = None
    ignore_index: int = -100
    localized_total: int | None = None
    label_style: str | None = None

    @property
    def total(self) -> int:
        """T: the physical slots of the whole pack (a localized batch holds T/cp of them)."""
        return self.localized_total if self.localized_total is not None else self.input_ids.numel()


# PackedSeqParams' fields over the megatron-core versions we run on (0.16: the first 9; later ones add the rest)
_PARAMS_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                  "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group", "total_tokens", "seq_idx",
                  "tokens_per_sample", "pad_between_seqs")


def _params_fields(params) -> dict:
    """cu_seqlens sets and max_seqlen from a PackedSeqParams (or a dict with its field names).

    Raises:
        ValueError: `params` is neither (a string or list was read as "no cu_seqlens"), or a dict with a key that
            is no field of it (a misspelt cu_seqlens_q_padded was dropped without a word).
    """
    if isinstance(params, Mapping):
        unknown = sorted(set(params) - set(_PARAMS_FIELDS), key=repr)
        if unknown:
            raise ValueError(f"unknown packed_seq_params fields {unknown}; known: {list(_PARAMS_FIELDS)}")
    elif not hasattr(params, "cu_seqlens_q"):
        raise ValueError(f"packed_seq_params must be a PackedSeqParams or a mapping of its fields, got "
                         f"{type(params).__name__}")
    get = params.get if isinstance(params, Mapping) else (lambda k, d=None: getattr(params, k, d))
    q, q_pad = get("cu_seqlens_q"), get("cu_seqlens_q_padded")
    return dict(cu_seqlens=q, cu_seqlens_padded=q_pad, cu_seqlens_kv=get("cu_seqlens_kv"),
                cu_seqlens_kv_padded=get("cu_seqlens_kv_padded"),
                max_seqlen=(get("max_seqlen_q"), get("max_seqlen_kv")), has_packed_seq_params=True)


def _from_micro_batch(batch) -> dict:
    """Fields of a `MicroBatch` (or our older `PackedBatch`), by attribute."""
    out = {k: getattr(batch, k) for k in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")}
    if getattr(batch, "packed_seq_params", None) is not None:
        out.update(_params_fields(batch.packed_seq_params))
    vision = getattr(batch, "vision", None)
    rows = getattr(getattr(batch, "plan", None), "segment_rows", None)  # empty rows make no document

    def per_document(per_row):
        return None if per_row is None or rows is None else tuple(per_row[r] for r in rows if r < len(per_row))

    if vision is not None:
        out.update(image_grid_thw=vision.image_grid_thw, video_grid_thw=vision.video_grid_thw,
                   second_per_grid_ts=vision.second_per_grid_ts,
                   images_per_document=per_document(vision.images_per_sample),
                   videos_per_document=per_document(vision.videos_per_sample))
        if getattr(vision, "spatial_merge_size", None) is not None:  # what packing counted the grids with
            out["spatial_merge_size"] = vision.spatial_merge_size
    audio = getattr(batch, "audio", None)
    if audio is not None:  # the clips' real frames: what the mRoPE index read as audio_seqlens
        out.update(audio_seqlens=torch.tensor(audio.audio_lengths, dtype=torch.long),
                   audios_per_document=per_document(audio.audios_per_sample))
    # the ids packing checked the placeholders of (kind "image" / "video" / "audio")
    out.update({f"{kind}_token_id": token for kind, token in getattr(batch, "placeholders_checked", ())})
    passthrough = getattr(batch, "passthrough", None) or {}
    for key in ("image_grid_thw", "video_grid_thw"):
        if passthrough.get(key) is not None:
            out[key] = passthrough[key]
    plan = getattr(batch, "plan", None)
    if plan is not None and getattr(plan, "multiples", None) is not None:
        out["multiples"] = plan.multiples
    if getattr(batch, "cp_index", None) is not None:
        out["cp_index"] = batch.cp_index
    return out


def _from_mapping(batch: Mapping) -> dict:
    # key=repr: a saved dict may hold non-str keys (ints, tuples) that do not sort among strs
    unknown = sorted(set(batch) - set(SAVED_KEYS) - {"tokens", "cu_seqlens_kv", "cu_seqlens_kv_padded",
                                                     "max_seqlen_kv", "ignore_index", "mrope"}, key=repr)
    if unknown:
        raise ValueError(f"unknown keys in the batch: {unknown}; known keys: {sorted(SAVED_KEYS)}")
    out = {k: v for k, v in batch.items() if not k.startswith("source_")}
    if out.get("tokens") is not None and out.get("input_ids") is not None:  # one was judged, the other ignored
        raise ValueError("the batch has both input_ids and tokens: give the token ids once")
    if "tokens" in out:
        tokens = out.pop("tokens")
        out["input_ids"] = tokens if tokens is not None else out.get("input_ids")
    if out.get("packed_seq_params") is not None:
        # Both forms of the boundaries: one would be checked and the other ignored without a word.
        both = sorted(k for k in ("cu_seqlens", "cu_seqlens_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded",
                                  "max_seqlen", "max_seqlen_kv") if out.get(k) is not None)
        if both:
            raise ValueError(f"the batch has packed_seq_params and {both}: give the boundaries one way")
        out.update(_params_fields(out.pop("packed_seq_params")))
    else:
        out.pop("packed_seq_params", None)
    if "max_seqlen" in out and not isinstance(out["max_seqlen"], tuple):
        out["max_seqlen"] = (out["max_seqlen"], out.pop("max_seqlen_kv", out["max_seqlen"]))
    if batch.get("source_input_ids") is not None:
        # the source rows are the reference the pack is judged against: every one must be the
        # [B, S] of source_input_ids, or the per-row comparisons index out of range
        rows = {k: batch[f"source_{k}"] for k in ("input_ids", "attention_mask", "labels", "loss_mask")
                if batch.get(f"source_{k}") is not None}
        out["source"] = SourceRows(**rows, label_style=batch.get("label_style") or "hf")  # checks every row field
    return out


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


def _gathered(batch, overrides: dict) -> dict:
    """The raw values: `batch`'s (a mapping of saved keys, or a micro-batch's attributes), then every override
    that is not None; `packed_seq_params` split into its boundary fields, a `source` mapping made `SourceRows`."""
    values: dict = {}
    if isinstance(batch, Mapping):
        values.update(_from_mapping(batch))
    elif batch is not None:
        values.update(_from_micro_batch(batch))
    values.update({k: v for k, v in overrides.items() if v is not None})
    if values.get("packed_seq_params") is not None:
        values.update(_params_fields(values.pop("packed_seq_params")))
    values.pop("packed_seq_params", None)
    if isinstance(values.get("source"), Mapping):
        unknown = sorted(set(values["source"]) - {f.name for f in fields(SourceRows)}, key=repr)
        if unknown:  # was SourceRows' TypeError
            raise ValueError(f"unknown source fields {unknown}; known: {[f.name for f in fields(SourceRows)]}")
        values["source"] = SourceRows(**values["source"])
    elif values.get("source") is not None and not isinstance(values["source"], SourceRows):
        raise ValueError(f"source must be a SourceRows or a mapping of its fields, got {type(values['source']).__name__}")
    return values


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
    values = _layout_values(_gathered(batch, overrides))
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
