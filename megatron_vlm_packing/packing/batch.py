"""`pack_batch`: a collated, right-padded micro-batch in; one exact THD micro-batch out.

Shape legend: B = rows, S = row length, T = physical packed tokens, N = documents.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.packing.packed_value_checks import check_packed_values, host_array
from megatron_vlm_packing.packing.host_tokens import pack_tokens_on_host, packs_on_host
from megatron_vlm_packing.packing.media_counts import checked_placeholders
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.micro_batch import BatchStats, MicroBatch, boundaries_mark
from megatron_vlm_packing.packing.plain_host import PlainPack, pack_plain_batch_on_host
from megatron_vlm_packing.packing.pack import pack_next_token_labels, pack_positions, pack_rows, segment_positions
from megatron_vlm_packing.packing.positions import (
    POSITION_LAYOUTS, check_1d_positions_on_host, check_position_layout, positions_config,
)
from megatron_vlm_packing.packing.indices import PackIndices, plan_indices
from megatron_vlm_packing.packing.plan import PackMultiples, PackPlan, checked_pad_to, make_pack_plan
from megatron_vlm_packing.packing.bridge_batch import from_bridge_batch
from megatron_vlm_packing.packing.rows import (  # noqa: F401
    IGNORE_INDEX, INT64_MAX, Rows, check_flags, check_pad_token_id, checked_extra_keys, loss_weights_of,
    raise_value_errors_first, read_rows, refuse_undense, shift_labels_within_rows,
)

# Kept for callers of the first `PackedBatch`: the one typed micro-batch now.
PackedBatch = MicroBatch


_HAS_PAD_BETWEEN_SEQS = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}


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
    if _HAS_PAD_BETWEEN_SEQS:
        kwargs["pad_between_seqs"] = plan.real_lengths != plan.physical_lengths
    return PackedSeqParams(**kwargs)


def padding_mask_of(indices: PackIndices) -> torch.Tensor:
    """[1, T] bool, True at pad slots (all False, in one op, when the plan has none)."""
    if not indices.has_pad_slots:
        if indices.device.type == "cpu":  # numpy: a fraction of torch's fixed cost per call
            return torch.from_numpy(np.zeros((1, indices.plan.total), dtype=np.bool_))
        return torch.zeros((1, indices.plan.total), dtype=torch.bool, device=indices.device)
    return ~indices.is_real.unsqueeze(0)


def pack_labels_and_weights(rows: Rows, indices: PackIndices, *,
                            packed_ids: torch.Tensor | None = None,
                            vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T] next-token labels and float loss weights, built over the packed tokens only.

    Hugging Face labels shift inside each document (`pack_next_token_labels`); Megatron labels are
    packed as they are. The same values as packing `rows.labels` / `rows.loss_weights`.

    Rows read without their value checks (`rows.unchecked_values`: `pack_batch(host_reads=True)`
    with a loss mask numpy cannot pack, bfloat16 or carrying autograd) are checked here, over the
    packed ids (`packed_ids`, [1, T]), labels and loss weights; `host_tokens.pack_tokens_on_host`
    packs all other such rows.
    """
    if rows.label_style == "hf":
        labels = pack_next_token_labels(rows.raw_labels, indices, ignore_index=IGNORE_INDEX)
    else:
        labels = pack_rows(rows.raw_labels, indices, pad_value=IGNORE_INDEX)
    values = None if rows.loss_values is None else pack_rows(rows.loss_values, indices)
    if rows.unchecked_values is not None:
        if packed_ids is None:
            raise ValueError("rows read without value checks need packed_ids= to be checked over the packed tokens")
        targets = host_array(labels[0])
        first_labels = host_array(rows.raw_labels[list(indices.plan.segment_rows), 0]) \
            if rows.label_style == "hf" else None
        check_packed_values(rows.unchecked_values, rows.label_style, vocab_size, ids=host_array(packed_ids[0]),
                            targets=targets, is_target=targets != IGNORE_INDEX, first_labels=first_labels,
                            loss_values=None if values is None else host_array(values[0]),
                            plan=indices.plan)
    return labels, loss_weights_of(labels, values)


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
    image_token_id: int | None = None,
    video_token_id: int | None = None,
    audio_token_id: int | None = None,
    spatial_merge_size: int | None = None,
    extra_keys: tuple[str, ...] = (),
    vocab_size: int | None = None,
    position_layout: str | None = None,
    require_media_counts: bool = True,
    host_reads: bool = False,
) -> MicroBatch:
    """Pack a right-padded micro-batch into one THD sequence at real lengths.

    Args:
        batch: a dict. Megatron style (`tokens`/`input_ids`, `labels` already next-token aligned,
            optional `loss_mask`, `attention_mask`, `position_ids`) or Hugging Face style
            (`input_ids`, unshifted `labels` with -100, `attention_mask`; use label_style="hf").
            Real lengths come from `seq_lens` [B], `attention_mask` [B, S] (1 = real) or
            [B, 1, S, S] (True = masked), or, with neither, full rows. A float `loss_mask` is a
            per-target weight, kept as given. Vision (`pixel_values`, `image_grid_thw`,
            `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`) and audio
            (`input_features`, `feature_attention_mask`) become the typed `vision` / `audio`
            fields. Any other key is a ValueError unless declared in `extra_keys`. Tensors must be
            dense (a sparse, nested or meta tensor is a ValueError); integer fields of dtype uint16 or
            uint32 are read as int64, uint64 is refused; an attention_mask holds only 0 and 1 (a bool
            mask only the bytes 0 and 1), any other value is a ValueError naming its row and column.
        tp_size, cp_size, sequence_parallel, fp8: parallel layout the pack must be aligned for.
        pad_to: exact packed length T (static shapes); must fit the batch.
        label_style: "megatron" (labels already aligned) or "hf" (shift inside each sample).
        mrope: `rope.MRopeConfig` or a callable returning [3, B, S] positions (e.g. a model's
            own `get_rope_index`); each sample's positions are computed as if it were alone.
            Without it, [3, B, S] `position_ids` in the batch are packed, and otherwise 1D
            positions restart per sample.
        pad_token_id: value of `input_ids` at pad slots.
        image_token_id, video_token_id, audio_token_id, spatial_merge_size: placeholder ids used to
            count images / videos / audio clips per sample (default: those of an `MRopeConfig`
            given as `mrope`; merge size 2). Media whose id is not known are a ValueError unless
            `require_media_counts=False` (their counts are then None: for a step whose model
            adapter refuses media it does not consume and passes the ids of those it does).
        extra_keys: per-token [B, S, ...] batch tensors to pack into `extras` (pad slots 0).
        vocab_size: when given, ids and labels outside [0, vocab_size) are a ValueError (labels
            may also be -100); negative ids / labels other than -100 always are.
        position_layout: "3BS" or "B3S" for 3D `position_ids` in the batch; needed only when B == 3
            makes the shape ambiguous.
        host_reads: the batch is on the CPU, where reading a value back costs no sync (a DataLoader
            worker: `PackingCollator` sets it). The real lengths are then read first and the value
            checks of ids, labels and loss weights run after packing, over the T packed tokens
            (`packed_value_checks.check_packed_values`), instead of riding the one read as screens over all B*S
            slots; the same errors for the same bad tokens. A batch on an accelerator is a ValueError.

    Pre-packed rows: `document_lengths` ([B, D] ints, see `packing.documents`) makes every document
    of every row its own THD segment (positions restart, HF labels shift inside each document,
    per-document mRoPE and media counts); the plan's rows are then the documents, in order.

    Returns:
        MicroBatch with [1, T] fields (positions [3, 1, T] for mRoPE), `plan` and `indices` set.
    """
    if type(host_reads) is not bool or type(require_media_counts) is not bool:  # "no" must not switch them on
        check_flags(host_reads=host_reads, require_media_counts=require_media_counts)
    batch = from_bridge_batch(batch, label_style)  # Megatron-Bridge's collate output: visual_inputs unpacked
    # A plain batch on the host first, before any option handling of the general path: in a DataLoader
    # worker every line run per micro-batch counts (`plain_host`; it defers anything it does not take).
    if host_reads and mrope is None and image_token_id is None and video_token_id is None \
            and audio_token_id is None and (spatial_merge_size is None or type(spatial_merge_size) is int
                                            and spatial_merge_size >= 1):
        plain = _pack_plain(batch, extra_keys=extra_keys, position_layout=position_layout, tp_size=tp_size,
                            cp_size=cp_size, sequence_parallel=sequence_parallel, fp8=fp8, pad_to=pad_to,
                            label_style=label_style, pad_token_id=pad_token_id, vocab_size=vocab_size)
        if plain is not None:
            return _packed_micro_batch(plain.plan, plain.indices, plain.input_ids, plain.labels, plain.loss_mask,
                                       plain.position_ids,
                                       row_tokens=len(plain.plan.row_lengths) * plain.plan.row_capacity,
                                       vocab_size=vocab_size)
    media = MediaTokens.resolve(mrope, image_token_id=image_token_id, video_token_id=video_token_id,
                                audio_token_id=audio_token_id, spatial_merge_size=spatial_merge_size,
                                require_counts=require_media_counts)
    pad_token_id = check_pad_token_id(pad_token_id, vocab_size)  # a numpy int as its int
    media.refuse_pad_placeholder(pad_token_id)
    pad_to = checked_pad_to(pad_to)  # an option error is named before any batch error
    extra_keys = checked_extra_keys(extra_keys)
    check_position_layout(position_layout)
    if host_reads:
        _check_on_host(batch)
    rows = read_rows(batch, label_style=label_style, mrope=mrope, media=media, extra_keys=extra_keys,
                     vocab_size=vocab_size, position_layout=position_layout, on_host=host_reads)
    batch_size, row_length = rows.input_ids.shape
    # host_reads: a bad value is named before a parallel option or a pad_to that does not fit, as the device
    # path (which has read the values by now) names it.
    try:
        multiples = PackMultiples.for_parallel(
            tp_size=tp_size, cp_size=cp_size, sequence_parallel=sequence_parallel, fp8=fp8
        )
        plan = make_pack_plan(rows.lengths, row_capacity=row_length, multiples=multiples, pad_to=pad_to)
    except ValueError:
        raise_value_errors_first(rows.unchecked_values, label_style, vocab_size, rows.unchecked_positions)
        raise
    indices = plan_indices(plan, rows.input_ids.device)
    positions = segment_positions(indices) if rows.positions is None else pack_positions(rows.positions, indices)
    if packs_on_host(rows):
        input_ids, labels, loss_mask = pack_tokens_on_host(rows, indices, pad_token_id=pad_token_id,
                                                           vocab_size=vocab_size)
    else:
        input_ids = pack_rows(rows.input_ids, indices, pad_value=pad_token_id)
        labels, loss_mask = pack_labels_and_weights(rows, indices, packed_ids=input_ids, vocab_size=vocab_size)
    if rows.unchecked_positions is not None:
        check_1d_positions_on_host(rows.unchecked_positions, indices, lambda: rows.keep, rows.unchecked_values.where)
    return _packed_micro_batch(plan, indices, input_ids, labels, loss_mask, positions, row_tokens=rows.row_tokens,
                               vision=rows.vision, audio=rows.audio,
                               extras={key: pack_rows(value, indices) for key, value in rows.extras.items()},
                               placeholders_checked=checked_placeholders(batch, media),
                               mrope_config=positions_config(mrope), vocab_size=vocab_size)


def _packed_micro_batch(plan: PackPlan, indices: PackIndices, input_ids: torch.Tensor, labels: torch.Tensor,
                        loss_mask: torch.Tensor, positions: torch.Tensor, *, row_tokens: int, vision=None, audio=None,
                        extras=None, placeholders_checked=(), mrope_config=None,
                        vocab_size: int | None = None) -> MicroBatch:
    """The `MicroBatch` of a pack (both of `pack_batch`'s paths): [1, T] fields, boundaries, stats."""
    params = make_packed_seq_params(plan, indices)
    return MicroBatch(
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        checked_loss_mask=loss_mask,  # its weights were checked in the read (or over the packed tokens)
        position_ids=positions,
        checked_positions=positions,  # restarting per document of the plan (given ones checked in the read)
        padding_mask=padding_mask_of(indices),
        packed_seq_params=params,
        checked_boundaries=boundaries_mark(params),  # the plan's: what the positions, padding mask and CP index were made from
        rope_cu_seqlens=indices.cu_seqlens,
        stats=BatchStats(real_tokens=plan.num_real_tokens, physical_tokens=plan.total, row_tokens=row_tokens),
        vision=vision,
        audio=audio,
        extras={} if extras is None else extras,
        plan=plan,
        indices=indices,
        placeholders_checked=placeholders_checked,
        mrope_config=mrope_config,
        checked_media=(input_ids, vision, audio),  # what the marks above were checked on
        checked_labels=labels,  # checked in the read (-100 or an id, below vocab_size when given)
        checked_vocab_size=vocab_size,
    )


def _pack_plain(batch, *, extra_keys, position_layout, tp_size, cp_size, sequence_parallel, fp8, pad_to, label_style,
                pad_token_id, vocab_size) -> PlainPack | None:
    """`plain_host.pack_plain_batch_on_host` when the options are ones the general path accepts and ask for
    nothing but the batch's own keys (the caller checked: no mRoPE, no media ids), else None."""
    # extra_keys: only an empty tuple or list (None or 0 is the general path's ValueError, checked_extra_keys).
    # pad_token_id, pad_to, vocab_size: plain ints the general path's checks pass (else it names the error).
    if type(extra_keys) not in (tuple, list) or extra_keys \
            or position_layout is not None and position_layout not in POSITION_LAYOUTS \
            or type(pad_token_id) is not int or not 0 <= pad_token_id <= INT64_MAX \
            or not (pad_to is None or type(pad_to) is int) \
            or (type(vocab_size) is int and not pad_token_id < vocab_size <= INT64_MAX):
        return None
    try:
        multiples = PackMultiples.for_parallel(tp_size=tp_size, cp_size=cp_size, sequence_parallel=sequence_parallel,
                                               fp8=fp8)
    except ValueError:  # named by the general path, after any error of the batch
        return None
    return pack_plain_batch_on_host(batch, multiples=multiples, pad_to=pad_to, label_style=label_style,
                                    pad_token_id=pad_token_id, vocab_size=vocab_size)


def check_pack_options(options: dict, owner: str, taken: tuple[str, ...] = (), *, also_for: str | None = None,
                       also: tuple[str, ...] = ()) -> None:
    """`options` (a collator's extra keywords for `pack_batch`) name only `pack_batch` keywords that
    `owner` does not set itself (`taken`): caught when the collator is built, not as a TypeError in a
    DataLoader worker at the first batch. `also`: the keywords of `also_for`, another callee `owner`
    passes the options to (`with_parity_probe`: `parity_probe`'s), accepted too.

    Raises:
        ValueError: naming the keys that clash or that `pack_batch` does not take.
    """
    if not isinstance(options, dict):
        raise ValueError(f"{owner}'s options must be a dict of pack_batch keywords, got {type(options).__name__}")
    clash = sorted(set(options) & set(taken))
    if clash:
        raise ValueError(f"{owner} sets {clash} itself: give {clash[0]}= to {owner}, not in its pack_batch options")
    known = (set(_PACK_BATCH_KEYWORDS) | set(also)) - set(taken)
    unknown = sorted(set(options) - known)
    if unknown:
        callees = "pack_batch" if also_for is None else f"{also_for} / pack_batch"
        raise ValueError(f"{unknown} are not {callees} keywords; {owner} passes on any of {sorted(known)}")


def tensor_off_host(batch) -> str | None:
    """The key of the first tensor of a batch dict that is not on the CPU, else None (also for a
    batch that is not a mapping: read_rows names what it is)."""
    # Any mapping, as read_rows takes (a BatchFeature is a UserDict): else its tensors went unchecked.
    if not isinstance(batch, Mapping):
        return None
    return next((key for key, value in batch.items() if isinstance(value, torch.Tensor) and not value.is_cpu), None)


def _check_on_host(batch: dict) -> None:
    """host_reads=True packs on the CPU: a tensor elsewhere (a meta tensor included) would make every read a host
    sync. A sparse or nested tensor is refused as on the step path (`rows.check_dense_tensors`): the plain path
    reads every tensor with numpy."""
    if not isinstance(batch, Mapping):  # read_rows names what it is
        return
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.layout is not torch.strided or value.is_nested:
            refuse_undense(key, value)
        if not value.is_cpu:
            raise ValueError(f"host_reads=True packs a batch on the CPU (a DataLoader worker), but {key!r} is on "
                             f"{value.device}: leave host_reads False for a batch on an accelerator")


_PACK_BATCH_KEYWORDS = tuple(name for name in inspect.signature(pack_batch).parameters if name != "batch")
