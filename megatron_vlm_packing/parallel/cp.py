"""Context-parallel partition indices: TransformerEngine's load-balanced zigzag, in pure torch.

Under context parallelism (CP) with causal attention, a sequence is cut into 2*cp equal chunks and
rank r keeps chunks r and 2*cp-1-r, so every rank gets one early (cheap) and one late (expensive)
chunk. For packed THD batches TransformerEngine applies this rule to *each document* separately,
which is why every physical document length must be a multiple of 2*cp.

One index from here is applied to every sequence-aligned tensor (labels, loss mask, positions,
padding mask, merged embeddings), so they can never disagree about which token lives where.

Shape legend: T = physical packed tokens, N = documents, S = dense row length.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


def _is_int(value) -> bool:
    """A Python int that is not a bool (True would pass as 1: cp_size=True ran as CP=1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if not _is_int(cp_size) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if not _is_int(cp_rank) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def check_boundary_tensor(name: str, cu: torch.Tensor) -> None:
    """A boundary set's type, shape and dtype: [N+1], N >= 1, integer. Metadata only (no host read).

    A float tensor was cast with `.long()` / `.int()`, silently truncating 8.5 to 8; a bool one
    counted True as 1.

    Raises:
        ValueError: not a tensor, not one-dimensional with at least two entries, or not integer.
    """
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be an [N+1] integer tensor, got {type(cu).__name__}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be [N+1] with N >= 1, got shape {tuple(cu.shape)}")
    if cu.dtype == torch.bool or cu.dtype.is_floating_point or cu.dtype.is_complex:
        raise ValueError(f"{name} must be an integer tensor (int32), got {cu.dtype}")


def cp_partition_index(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Indices of the packed tokens that CP rank `cp_rank` keeps, document by document.

    Args:
        cu_seqlens_padded: [N+1] int, cumulative physical document lengths, starts at 0.
        cp_size: context-parallel world size.
        cp_rank: this rank, in [0, cp_size).

    Returns:
        index: [T // cp_size] long, on the device of `cu_seqlens_padded`, ascending within each
        chunk; documents in order; for each document chunk r then chunk 2*cp-1-r.

    Example:
        cu_seqlens_padded = [0, 8, 16], cp_size = 2:
        rank 0 -> [0, 1, 6, 7, 8, 9, 14, 15]; rank 1 -> [2, 3, 4, 5, 10, 11, 12, 13]

    Raises:
        ValueError: a document length that is not a positive multiple of 2*cp_size, or
        `cu_seqlens_padded` that does not start at 0, is not one-dimensional or is not integer.

    One host sync (validation and the output size together).
    """
    _check_cp(cp_size, cp_rank)
    check_boundary_tensor("cu_seqlens_padded", cu_seqlens_padded)
    cu = cu_seqlens_padded.long()
    lengths = cu[1:] - cu[:-1]
    # With cp_size = 1 there is nothing to balance: documents need no alignment.
    two_cp = 2 * cp_size if cp_size > 1 else 1
    bad = (lengths <= 0) | (lengths % two_cp != 0)
    # The single host sync: validity and the total length come back together.
    first, total, num_bad = torch.stack([cu[0], cu[-1], bad.sum()]).tolist()
    if first != 0 or num_bad:
        raise ValueError(
            f"cu_seqlens_padded must start at 0 and every document length must be a positive "
            f"multiple of 2*cp_size={two_cp}; got cu_seqlens_padded={cu.tolist()}"
        )
    if cp_size == 1:
        return torch.arange(total, device=cu.device)
    return zigzag_index(cu, cp_size, cp_rank, local_total=total // cp_size).index


class ZigzagIndex(NamedTuple):
    """This CP rank's tokens of a packed sequence, as device tensors.

    Attributes:
        index: [Tl] long, packed slot of every local token (what `cp_partition_index` returns).
        document_start: [Tl] long, first packed slot of the document each local token belongs to.
    """

    index: torch.Tensor
    document_start: torch.Tensor


def zigzag_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, *, local_total: int) -> ZigzagIndex:
    """TransformerEngine's per-document zigzag with no host sync and no check (the caller vouches).

    Args:
        cu_seqlens_padded: [N+1] int, physical boundaries on any device; every document length a
            multiple of 2*cp_size when cp_size > 1 (not checked: checking would read it on the host).
        cp_size, cp_rank: the context-parallel layout.
        local_total: Tl = T // cp_size, a host int (from the plan, or the local tensor's length).

    Returns:
        `ZigzagIndex` on the device of `cu_seqlens_padded`; about ten kernels, none reads a value
        back to the host (the output sizes are given).
    """
    cu = cu_seqlens_padded.long()
    lengths = cu[1:] - cu[:-1]  # [N]
    local_lengths = lengths // cp_size  # [N], each document's tokens on this rank
    doc = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), local_lengths,
                                  output_size=local_total)  # [Tl]
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths  # [N]
    offset = torch.arange(local_total, device=cu.device) - local_starts[doc]  # [Tl], offset within the local document
    document_start = cu[:-1][doc]  # [Tl]
    if cp_size == 1:
        return ZigzagIndex(document_start + offset, document_start)
    chunk = (local_lengths // 2)[doc]  # [Tl], a document's chunk length (it is cut in 2*cp chunks)
    first_chunk_start = cp_rank * chunk
    second_chunk_start = (2 * cp_size - 1 - cp_rank) * chunk - chunk  # minus the first half
    within = offset + torch.where(offset < chunk, first_chunk_start, second_chunk_start)
    return ZigzagIndex(document_start + within, document_start)


def cp_partition_index_from_lengths(
    physical_lengths: Sequence[int], cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """`cp_partition_index` from the plan's host ints: checked on the host, built with no host sync.

    Args:
        physical_lengths: N host ints, every document's physical length (`PackPlan.physical_lengths`).
        cp_size, cp_rank: the context-parallel layout.
        device: where the index is built (N+1 ints cross to it in one copy).

    Returns:
        [T // cp_size] long, equal to `cp_partition_index(cumsum([0] + physical_lengths), cp_size, cp_rank)`.

    Raises:
        ValueError: no documents, a length that is not an int (a float gave a float index, a numpy
            array an ambiguous truth value), or not a positive multiple of 2*cp_size (cp > 1).
    """
    _check_cp(cp_size, cp_rank)
    not_ints = [(i, n) for i, n in enumerate(physical_lengths) if not _is_int(n)]
    if not_ints:
        raise ValueError(f"physical_lengths must be Python ints, got (document, value) {not_ints[:8]}")
    two_cp = 2 * cp_size if cp_size > 1 else 1
    bad = [(i, n) for i, n in enumerate(physical_lengths) if n <= 0 or n % two_cp]
    if len(physical_lengths) == 0 or bad:
        raise ValueError(f"physical_lengths must be N >= 1 positive multiples of 2*cp_size={two_cp}; "
                         f"got {len(physical_lengths)} lengths, (document, length) {bad[:8]} misfit")
    cu = [0]
    for n in physical_lengths:
        cu.append(cu[-1] + n)
    if cp_size == 1:
        return torch.arange(cu[-1], device=device)
    cu_t = torch.tensor(cu, dtype=torch.long)
    cu_t = cu_t.to(device, non_blocking=True) if device is not None else cu_t
    return zigzag_index(cu_t, cp_size, cp_rank, local_total=cu[-1] // cp_size).index


def dense_cp_partition_index(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The same zigzag over one dense row of length `seq_len` (apply it on the sequence dim).

    Returns:
        index: [seq_len // cp_size] long. Example: seq_len=8, cp_size=2, rank 1 -> [2, 3, 4, 5].

    Raises:
        ValueError: `seq_len` not an int (a float gave a float index, a tensor a host read), or not a
            positive multiple of 2*cp_size.
    """
    _check_cp(cp_size, cp_rank)
    if not _is_int(seq_len):
        raise ValueError(f"seq_len must be a Python int, got {type(seq_len).__name__} {seq_len!r}")
    if seq_len <= 0 or seq_len % (2 * cp_size):
        raise ValueError(
            f"seq_len={seq_len} must be a positive multiple of 2*cp_size={2 * cp_size} for the "
            f"context-parallel zigzag"
        )
    chunk = seq_len // (2 * cp_size)
    ar = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + ar, (2 * cp_size - 1 - cp_rank) * chunk + ar])
