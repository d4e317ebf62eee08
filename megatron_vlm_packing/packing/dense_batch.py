"""`pad_batch`: the dense path (packing off) producing the same `MicroBatch` as `pack_batch`.

Rows stay rows ([B, L]), right-padded to one length aligned for the parallel layout. Lengths,
labels, loss weights, positions (mRoPE included) and vision/audio inputs come from the same
`read_rows` as the packed path, so every check `pack_batch` makes is made here too.

Shape legend: B = rows, S = collated row length, L = dense row length.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.packing.bridge_batch import from_bridge_batch
from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.dense import pad_or_truncate_positions, pad_or_truncate_rows
from megatron_vlm_packing.packing.media_counts import checked_placeholders
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.micro_batch import BatchStats, MicroBatch
from megatron_vlm_packing.packing.plan import PackMultiples, round_up
from megatron_vlm_packing.packing.positions import positions_config
from megatron_vlm_packing.packing.rows import (
    IGNORE_INDEX, INT64_MAX, Rows, check_flags, check_pad_token_id, checked_extra_keys, read_rows,
)


def dense_row_length(row_length: int, longest: int, multiple: int, *, seq_length: int | None, truncate: bool) -> int:
    """L: `seq_length` when given (checked), else S rounded up to `multiple`.

    Raises:
        ValueError: `seq_length` not a positive multiple of `multiple`, or shorter than the longest
        row's real tokens without `truncate=True` (nothing is cut silently).
    """
    if seq_length is None:
        return round_up(row_length, multiple)
    if not is_int(seq_length) or seq_length < 1 or seq_length % multiple:
        raise ValueError(f"seq_length={seq_length!r} must be a positive multiple of {multiple} "
                         f"(the parallel layout's alignment)")
    if seq_length < longest and not truncate:
        raise ValueError(f"seq_length={seq_length} is shorter than the longest row's {longest} real tokens; "
                         f"pass truncate=True to cut rows, nothing is truncated silently")
    return int(seq_length)


def pad_positions_after_real(positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[C, B, S] positions with each row's pad slots set to row max + 1, + 2, ... (never a restart)."""
    floor = torch.finfo(positions.dtype).min if positions.is_floating_point() else torch.iinfo(positions.dtype).min
    row_max = torch.where(keep, positions, floor).amax(dim=(0, 2), keepdim=True)  # [1, B, 1]
    pad_rank = torch.cumsum(~keep, dim=1).to(positions.dtype)  # [B, S], 1, 2, ... at pads
    return torch.where(keep, positions, row_max + pad_rank)


def _cut_media_check(rows: Rows, length: int) -> None:
    if length >= max(rows.lengths):
        return
    if rows.vision is not None or rows.audio is not None:
        raise ValueError(f"truncate=True would cut rows to seq_length={length} below their real tokens "
                         f"(longest {max(rows.lengths)}), and the batch has vision/audio inputs whose "
                         f"placeholders cannot be cut")


def _refuse_documents(rows: Rows) -> None:
    """Dense rows hold one document each: causal attention over a row would join its documents."""
    if rows.document_rows is None:
        return
    counts = {}
    for row in rows.document_rows:
        counts[row] = counts.get(row, 0) + 1
    several = {row: n for row, n in counts.items() if n > 1}
    if several:
        row, n = next(iter(several.items()))
        raise ValueError(f"document_lengths gives row {row} {n} documents: dense rows attend causally across the "
                         f"whole row, so pad_batch cannot keep them apart; use pack_batch (each document its own "
                         f"THD segment)")


def pad_batch(
    batch: dict,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
    fp8: bool = False,
    seq_length: int | None = None,
    truncate: bool = False,
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
) -> MicroBatch:
    """Right-padded dense rows of one aligned length, as a `MicroBatch` (packed_seq_params None).

    Args: as `pack_batch`, plus
        seq_length: fixed row length L (static shapes); must be a multiple of the layout's alignment.
        truncate: allow `seq_length` to cut rows' real tokens (text only).

    `document_lengths` with one document per row is accepted; several documents in a row are a
    ValueError (dense causal attention would join them: pack them instead).

    Returns:
        MicroBatch with [B, L] fields (positions [B, L], or [3, B, L] for mRoPE; pad slots continue
        after each row's largest position), `padding_mask` True at pad slots.
    """
    check_flags(truncate=truncate, require_media_counts=require_media_counts)  # truncate="no" cut rows
    batch = from_bridge_batch(batch, label_style)  # Megatron-Bridge's collate output: visual_inputs unpacked
    media = MediaTokens.resolve(mrope, image_token_id=image_token_id, video_token_id=video_token_id,
                                audio_token_id=audio_token_id, spatial_merge_size=spatial_merge_size,
                                require_counts=require_media_counts)
    pad_token_id = check_pad_token_id(pad_token_id, vocab_size)
    media.refuse_pad_placeholder(pad_token_id)
    extra_keys = checked_extra_keys(extra_keys)
    rows = read_rows(batch, label_style=label_style, mrope=mrope, media=media, extra_keys=extra_keys,
                     vocab_size=vocab_size, position_layout=position_layout)
    _refuse_documents(rows)
    multiple = PackMultiples.for_parallel(tp_size=tp_size, cp_size=cp_size, sequence_parallel=sequence_parallel,
                                          fp8=fp8).total
    length = _checked_dense_length(rows, multiple, seq_length=seq_length, truncate=truncate)
    return _dense_micro_batch(rows, length, pad_token_id, batch, media, mrope_config=positions_config(mrope),
                              vocab_size=vocab_size)


def _checked_dense_length(rows: Rows, multiple: int, *, seq_length: int | None, truncate: bool) -> int:
    """L of `rows` (`dense_row_length`), checked: B * L slots torch can index, and no vision/audio rows cut."""
    batch_size, row_length = rows.input_ids.shape
    length = dense_row_length(row_length, max(rows.lengths), multiple, seq_length=seq_length, truncate=truncate)
    if batch_size * length > INT64_MAX:  # else a TypeError / RuntimeError from allocating the rows
        raise ValueError(f"{batch_size} rows of {length} slots: more than torch can index (int64); seq_length="
                         f"{seq_length}, the layout's row multiple {multiple}")
    _cut_media_check(rows, length)
    return length


def _dense_micro_batch(rows: Rows, length: int, pad_token_id: int, batch, media: MediaTokens, *,
                       mrope_config=None, vocab_size: int | None = None) -> MicroBatch:
    """`pad_batch`'s `MicroBatch` of `rows` padded (or cut, with `truncate`) to [B, L] (L = `length`);
    `mrope_config`: the `MRopeConfig` that made its positions (`positions.positions_config`); `vocab_size`:
    the bound the rows' read checked ids and labels below."""
    batch_size, row_length = rows.input_ids.shape
    keep = pad_or_truncate_rows(rows.keep, length, pad_value=False)
    if rows.positions is None:
        positions = torch.arange(length, device=keep.device).expand(batch_size, length)
    else:
        positions = pad_or_truncate_positions(pad_positions_after_real(rows.positions, rows.keep), length)
    labels = pad_or_truncate_rows(rows.labels, length, pad_value=IGNORE_INDEX)
    if length < row_length:  # truncated: the last kept token's target may lie beyond the cut, which is fine
        labels = torch.where(keep, labels, IGNORE_INDEX)
    real = int(keep.sum()) if length < max(rows.lengths) else sum(rows.lengths)
    # where, not * keep: a pad slot's weight is never checked, and NaN or inf times 0 is NaN (a NaN loss sum)
    loss_mask = torch.where(keep, pad_or_truncate_rows(rows.loss_weights, length), 0.0)
    input_ids = torch.where(keep, pad_or_truncate_rows(rows.input_ids, length), pad_token_id)
    return MicroBatch(
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        checked_loss_mask=loss_mask,  # its weights were checked in the rows' read
        position_ids=positions,
        checked_positions=positions,  # from each row's real length (or given, checked in the rows' read)
        padding_mask=~keep,
        packed_seq_params=None,
        rope_cu_seqlens=None,
        stats=BatchStats(real_tokens=real, physical_tokens=batch_size * length, row_tokens=rows.row_tokens),
        vision=rows.vision,
        audio=rows.audio,
        extras={key: pad_or_truncate_rows(value, length) for key, value in rows.extras.items()},
        placeholders_checked=checked_placeholders(batch, media),
        mrope_config=mrope_config,
        checked_media=(input_ids, rows.vision, rows.audio),  # what the marks above were checked on
        checked_labels=labels,  # checked in the rows' read (-100 or an id, below vocab_size when given)
        checked_vocab_size=vocab_size,
    )
