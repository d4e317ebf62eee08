"""The raw values the validator is given, by source: a `MicroBatch` (or `PackedBatch`), a mapping with the
saved-batch keys (`saved_keys.SAVED_KEYS`), and keyword overrides (`gathered`).

Read as given, with the boundaries of a `packed_seq_params` split into their fields and a `source`
mapping made `SourceRows`; a key no source knows, or boundaries given two ways, is a ValueError naming
it. Nothing is converted or judged here: `inputs.build_inputs` normalises what this returns.

Shape legend: T = physical packed slots, N = documents.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Mapping

import torch

from megatron_vlm_packing.validate.packed_inputs import SourceRows
from megatron_vlm_packing.validate.saved_keys import SAVED_KEYS


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


def gathered(batch, overrides: dict) -> dict:
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
