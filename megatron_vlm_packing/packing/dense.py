"""Padding helpers for the dense (unpacked) path: packing off, and dense context parallelism.

Shape legend: B = rows, S = current row length, L = target row length.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.plan import check_int32_total, round_up


def padded_length(seq_len: int, multiple: int = 1, *, seq_length: int | None = None) -> int:
    """Row length for the dense path.

    Args:
        seq_len: current row length S.
        multiple: what the length must divide by (e.g. `PackMultiples.total`).
        seq_length: a forced length (static shapes). Shorter than `seq_len` truncates: that is the
            caller asking for it.

    Returns:
        `seq_length` if given, else `seq_len` rounded up to `multiple`.

    Raises:
        ValueError: a forced length that `multiple` does not divide, or non-positive inputs.
    """
    if multiple < 1 or seq_len < 0:
        raise ValueError(f"need multiple >= 1 and seq_len >= 0, got multiple={multiple}, seq_len={seq_len}")
    if seq_length is None:
        return round_up(seq_len, multiple)
    if seq_length < 1 or seq_length % multiple:
        raise ValueError(f"seq_length={seq_length} must be a positive multiple of {multiple}")
    return seq_length


def pad_or_truncate_rows(x: torch.Tensor, length: int, *, pad_value=0) -> torch.Tensor:
    """[B, S, ...] -> [B, L, ...]: right-pad with `pad_value` or cut the tail."""
    if x.shape[1] >= length:
        return x[:, :length]
    pad = x.new_full((x.shape[0], length - x.shape[1], *x.shape[2:]), pad_value)
    return torch.cat([x, pad], dim=1)


def pad_or_truncate_positions(positions: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S] or [C, B, S] positions -> [..., L]; new slots continue each row's arange.

    New slots hold max(row) + 1, + 2, ... on every channel, so they never restart at 0.
    """
    if positions.shape[-1] >= length:
        return positions[..., :length]
    extra = length - positions.shape[-1]
    start = positions.amax(dim=(0, -1) if positions.dim() == 3 else -1, keepdim=True)  # [1,B,1] / [B,1]
    tail = start + 1 + torch.arange(extra, device=positions.device)
    if positions.dim() == 3:
        tail = tail.expand(positions.shape[0], -1, -1)
    return torch.cat([positions, tail.to(positions.dtype)], dim=-1)


def pad_or_truncate_keep_mask(mask: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S] keep-mask (1 = real) -> [B, L]; new slots are pad (0)."""
    return pad_or_truncate_rows(mask, length, pad_value=0)


def pad_or_truncate_attention_mask_4d(mask: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, S, S] bool (True = masked) -> [B, 1, L, L]; new rows and columns are masked."""
    if mask.shape[-1] >= length:
        return mask[..., :length, :length]
    out = mask.new_ones((*mask.shape[:2], length, length))
    out[..., : mask.shape[-2], : mask.shape[-1]] = mask
    return out


def dense_packed_seq_params(batch_size: int, seq_length: int, *, device=None) -> PackedSeqParams:
    """THD `PackedSeqParams` for B dense rows of L slots each: cu_seqlens = [0, L, 2L, ...].

    Only for rows that are really full: with padded rows these boundaries make attention pay for
    every pad token (bug class 4); use `pack_batch` instead. The fields they go with are the B rows
    laid end to end as one [1, B*L] row: THD is one row (`localize` refuses a packed [B, L] field).
    """
    batch_size, seq_length = _int_sizes(batch_size, seq_length)
    if batch_size < 1 or seq_length < 1:
        raise ValueError(f"need batch_size >= 1 and seq_length >= 1, got {batch_size}, {seq_length}")
    check_int32_total(batch_size * seq_length)  # else the int32 arange wraps: [0, 2**30, -2**31]
    cu = torch.arange(0, (batch_size + 1) * seq_length, seq_length, dtype=torch.int32, device=device)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu, max_seqlen_q=seq_length, max_seqlen_kv=seq_length,
    )


def _int_sizes(batch_size, seq_length) -> tuple[int, int]:
    """Both sizes as Python ints (`bounds.is_int`: a numpy int is read as its int).

    Raises:
        ValueError: a bool, float, tensor or other non-integer size (naming both).
    """
    if not (is_int(batch_size) and is_int(seq_length)):
        tensors = isinstance(batch_size, torch.Tensor) or isinstance(seq_length, torch.Tensor)
        raise ValueError(f"dense_packed_seq_params needs int batch_size and seq_length, got batch_size={batch_size!r}, "
                         f"seq_length={seq_length!r}{'; pass Python ints (int(...)), not tensors' if tensors else ''}")
    return int(batch_size), int(seq_length)


def right_pad_samples(samples, row_length: int, pad_token_id: int = 0):
    """Samples' `input_ids` / `labels` (1D each) as right-padded rows.

    Returns:
        (ids [B, L] long, pad_token_id at pads; labels [B, L] long, -100 at pads; attention mask [B, L]
        long, 1 at real tokens). The caller checks every sample fits in `row_length` = L.
    """
    ids = torch.full((len(samples), row_length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), row_length), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), row_length, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    return ids, labels, mask
