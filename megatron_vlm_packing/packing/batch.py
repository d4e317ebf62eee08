"""`pack_batch`: a collated, right-padded micro-batch in; one exact THD micro-batch out.

Shape legend: B = rows, S = row length, T = physical packed tokens, N = documents.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.packing.lengths import real_lengths
from megatron_vlm_packing.packing.pack import pack_positions, pack_rows, segment_positions, unpack_rows
from megatron_vlm_packing.packing.plan import PackIndices, PackMultiples, PackPlan, make_pack_plan, plan_indices

IGNORE_INDEX = -100

# Per-sample (not per-token) inputs of vision and audio towers: passed through untouched.
PASSTHROUGH_KEYS = frozenset({
    "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
    "input_features", "feature_attention_mask", "audio_feature_lengths", "use_audio_in_video",
    "image_sizes", "num_image_tiles", "images", "video_second_per_grid",
})
_SEQUENCE_KEYS = frozenset({
    "input_ids", "tokens", "labels", "loss_mask", "attention_mask", "position_ids", "seq_lens",
})
# Keyword names that `get_rope_index` implementations take, and the batch keys that feed them.
_ROPE_INPUT_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                    "audio_seqlens", "feature_attention_mask", "use_audio_in_video")


@dataclass(frozen=True)
class PackedBatch:
    """One packed micro-batch.

    Attributes:
        input_ids: [1, T] long, pad slots hold `pad_token_id` (never read: the mask comes from the plan).
        labels: [1, T] long, next-token targets shifted inside each sample; -100 at pad slots.
        loss_mask: [1, T] float, 1 where a real token has a target.
        position_ids: [1, T] long (restart at 0 per document) or [3, 1, T] long (mRoPE, each
            document's positions as if it were alone).
        padding_mask: [1, T] bool, True exactly at physical pad slots.
        packed_seq_params: Megatron-Core `PackedSeqParams` (qkv_format="thd", real and padded
            boundaries, `max_seqlen_*` ints, `pad_between_seqs` set where the version has it).
        rope_cu_seqlens: [N+1] int32, real boundaries (where rotary positions restart).
        plan: the host-side `PackPlan`.
        indices: the device `PackIndices` (to unpack outputs).
        extras: other per-token tensors of the batch, packed to [1, T, ...] (pad 0).
        passthrough: per-sample inputs (pixel_values, image_grid_thw, ...) untouched.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    packed_seq_params: PackedSeqParams
    rope_cu_seqlens: torch.Tensor
    plan: PackPlan
    indices: PackIndices
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    passthrough: dict[str, Any] = field(default_factory=dict)

    @property
    def num_real_tokens(self) -> int:
        return self.plan.num_real_tokens

    @property
    def num_physical_tokens(self) -> int:
        return self.plan.total


def make_packed_seq_params(plan: PackPlan, indices: PackIndices) -> PackedSeqParams:
    """`PackedSeqParams` in THD format with both boundary sets.

    `pad_between_seqs` is set explicitly (True when any document has pad slots) on Megatron-Core
    versions whose `PackedSeqParams` has the field; older ones detect it in TE from the two sets.
    """
    kwargs = dict(
        qkv_format="thd",
        cu_seqlens_q=indices.cu_seqlens,
        cu_seqlens_kv=indices.cu_seqlens,
        cu_seqlens_q_padded=indices.cu_seqlens_padded,
        cu_seqlens_kv_padded=indices.cu_seqlens_padded,
        max_seqlen_q=plan.max_seqlen,
        max_seqlen_kv=plan.max_seqlen,
    )
    if "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        kwargs["pad_between_seqs"] = plan.real_lengths != plan.physical_lengths
    return PackedSeqParams(**kwargs)


def _input_ids(batch: dict) -> torch.Tensor:
    keys = [k for k in ("input_ids", "tokens") if batch.get(k) is not None]
    if len(keys) != 1:
        raise ValueError(f"the batch needs exactly one of 'input_ids' or 'tokens', found {keys or 'neither'}")
    input_ids = batch[keys[0]]
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"{keys[0]} must be a [B, S] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    return input_ids


def _check_rows(batch: dict, name: str, shape: tuple[int, int]) -> torch.Tensor | None:
    value = batch.get(name)
    if value is not None and tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)} but input_ids is {shape}")
    return value


def shift_labels_within_rows(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels (unshifted) to next-token targets, shifted inside each row.

    Args:
        labels: [B, S] long, HF convention (target of position s is labels[s+1]; -100 = ignore).
        keep: [B, S] bool, True at real tokens (right-padded).

    Returns:
        [B, S] long: out[b, s] = labels[b, s+1] while s+1 is a real token of row b, else -100;
        so the last token of a sample never learns the first token of the next (bug class 8).
    """
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    next_is_real = torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    return torch.where(next_is_real, shifted, IGNORE_INDEX)


def _packed_labels_and_loss_mask(batch: dict, indices: PackIndices, shape: tuple[int, int], label_style: str):
    """Labels and loss mask packed to [1, T]; HF labels are shifted inside each sample.

    The shift is done while gathering (slot t takes the label of its source token + 1, only where
    that token is a real token of the same sample), so no [B, S] temporaries are needed.
    """
    labels = _check_rows(batch, "labels", shape)
    if labels is None:
        raise ValueError("the batch has no 'labels': pack_batch packs training micro-batches")
    if label_style == "hf":
        flat = labels.reshape(-1)
        following = (indices.source + 1).clamp(max=flat.numel() - 1)
        packed_labels = torch.where(indices.next_is_real, flat.index_select(0, following), IGNORE_INDEX)[None]
    elif label_style == "megatron":
        packed_labels = pack_rows(labels, indices, pad_value=IGNORE_INDEX)
    else:
        raise ValueError(f"label_style must be 'megatron' or 'hf', got {label_style!r}")
    valid = indices.is_real[None] & (packed_labels != IGNORE_INDEX)
    loss_mask = _check_rows(batch, "loss_mask", shape)
    if loss_mask is not None:
        valid = valid & (pack_rows(loss_mask, indices) != 0)
    return packed_labels, valid.float()


def _rope_positions(batch: dict, input_ids: torch.Tensor, keep: torch.Tensor, mrope) -> torch.Tensor:
    """[3, B, S] positions of each row alone, from an `MRopeConfig` or a callable."""
    if callable(mrope):
        fn: Callable = mrope
        params = inspect.signature(mrope).parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepted = set(_ROPE_INPUT_KEYS) | {"attention_mask"} if accepts_any else set(params)
    else:
        from megatron_vlm_packing.rope import MRopeConfig, get_rope_index  # imported only when used

        if not isinstance(mrope, MRopeConfig):
            raise ValueError(f"mrope must be an MRopeConfig or a callable, got {type(mrope).__name__}")
        fn = lambda ids, **kw: get_rope_index(ids, mrope, **kw)  # noqa: E731
        accepted = set(inspect.signature(get_rope_index).parameters)
    kwargs = {k: batch[k] for k in _ROPE_INPUT_KEYS if batch.get(k) is not None and k in accepted}
    result = fn(input_ids, attention_mask=keep.long(), **kwargs)
    positions = result[0] if isinstance(result, tuple) else result
    if positions.dim() != 3 or positions.shape[0] != 3 or tuple(positions.shape[1:]) != tuple(input_ids.shape):
        raise ValueError(f"mrope positions must be [3, B, S] = [3, {input_ids.shape[0]}, {input_ids.shape[1]}], "
                         f"got {tuple(positions.shape)}")
    return positions


def _positions(batch: dict, input_ids: torch.Tensor, indices: PackIndices, mrope):
    given = batch.get("position_ids")
    if mrope is not None:
        if given is not None and given.dim() == 3:
            raise ValueError("the batch has [3, B, S] position_ids and mrope= was given: pass one of them")
        keep = unpack_rows(indices.is_real[None], indices, batch_size=input_ids.shape[0],
                           row_length=input_ids.shape[1], pad_value=False)  # [B, S] bool, from the plan
        return pack_positions(_rope_positions(batch, input_ids, keep, mrope), indices)
    if given is not None and given.dim() == 3:
        if given.shape[0] != 3 or tuple(given.shape[1:]) != tuple(input_ids.shape):
            raise ValueError(f"position_ids has shape {tuple(given.shape)}; mRoPE positions must be "
                             f"[3, {input_ids.shape[0]}, {input_ids.shape[1]}]")
        return pack_positions(given, indices)
    # 1D positions are recomputed from the plan: each document restarts at 0 whatever the batch held.
    return segment_positions(indices)


def pack_batch(
    batch: dict,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
    fp8: bool = False,
    pad_to: int | None = None,
    label_style: str = "megatron",
    mrope=None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack a right-padded micro-batch into one THD sequence at real lengths.

    Args:
        batch: Megatron style (`tokens`/`input_ids`, `labels` already next-token aligned,
            optional `loss_mask`, `attention_mask`, `position_ids`) or Hugging Face style
            (`input_ids`, unshifted `labels` with -100, `attention_mask`; use label_style="hf").
            Real lengths come from `seq_lens` [B], `attention_mask` [B, S] (1 = real) or
            [B, 1, S, S] (True = masked), or, with neither, full rows. Other [B, S, ...] tensors are
            packed into `extras`; vision/audio inputs (`PASSTHROUGH_KEYS`) and anything not
            [B, S]-shaped pass through untouched.
        tp_size, cp_size, sequence_parallel, fp8: parallel layout the pack must be aligned for.
        pad_to: exact packed length T (static shapes); must fit the batch.
        label_style: "megatron" (labels already aligned) or "hf" (shift inside each sample).
        mrope: `rope.MRopeConfig` or a callable returning [3, B, S] positions (e.g. a model's
            own `get_rope_index`); each sample's positions are computed as if it were alone.
            [B, S] `position_ids` in the batch are then not used. Without it, [3, B, S]
            `position_ids` in the batch are packed, and otherwise 1D positions restart per sample.
        pad_token_id: value of `input_ids` at pad slots.

    Returns:
        PackedBatch.

    One host sync (reading the real lengths), plus whatever an mRoPE index needs.
    """
    input_ids = _input_ids(batch)
    batch_size, row_length = input_ids.shape
    lengths = real_lengths(
        batch_size=batch_size, row_length=row_length,
        attention_mask=batch.get("attention_mask"), seq_lens=batch.get("seq_lens"),
    )
    multiples = PackMultiples.for_parallel(
        tp_size=tp_size, cp_size=cp_size, sequence_parallel=sequence_parallel, fp8=fp8
    )
    plan = make_pack_plan(lengths, row_capacity=row_length, multiples=multiples, pad_to=pad_to)
    indices = plan_indices(plan, input_ids.device)
    labels, loss_mask = _packed_labels_and_loss_mask(batch, indices, (batch_size, row_length), label_style)
    extras, passthrough = {}, {}
    for key, value in batch.items():
        if key in _SEQUENCE_KEYS:
            continue
        is_per_token = (isinstance(value, torch.Tensor) and value.dim() >= 2
                        and tuple(value.shape[:2]) == (batch_size, row_length))
        if is_per_token and key not in PASSTHROUGH_KEYS:
            extras[key] = pack_rows(value, indices)
        else:
            passthrough[key] = value
    return PackedBatch(
        input_ids=pack_rows(input_ids, indices, pad_value=pad_token_id),
        labels=labels,
        loss_mask=loss_mask,
        position_ids=_positions(batch, input_ids, indices, mrope),
        padding_mask=~indices.is_real.unsqueeze(0),
        packed_seq_params=make_packed_seq_params(plan, indices),
        rope_cu_seqlens=indices.cu_seqlens,
        plan=plan,
        indices=indices,
        extras=extras,
        passthrough=passthrough,
    )
