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

import torch


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


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
        `cu_seqlens_padded` that does not start at 0 or is not one-dimensional.

    One host sync (validation and the output size together).
    """
    _check_cp(cp_size, cp_rank)
    if cu_seqlens_padded.dim() != 1 or cu_seqlens_padded.numel() < 2:
        raise ValueError(
            f"cu_seqlens_padded must be [N+1] with N >= 1, got shape {tuple(cu_seqlens_padded.shape)}"
        )
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
    chunk = lengths // two_cp  # [N]
    local_lengths = 2 * chunk  # [N], tokens of each document on this rank
    local_total = total // cp_size
    doc = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu.device), local_lengths, output_size=local_total
    )  # [T/cp]
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths  # [N]
    offset = torch.arange(local_total, device=cu.device) - local_starts[doc]  # [T/cp]
    doc_chunk = chunk[doc]
    in_first = offset < doc_chunk
    first_chunk_start = cp_rank * doc_chunk
    second_chunk_start = (two_cp - 1 - cp_rank) * doc_chunk - doc_chunk  # minus the first half
    return cu[:-1][doc] + offset + torch.where(in_first, first_chunk_start, second_chunk_start)


def dense_cp_partition_index(
    seq_len: int, cp_size: int, cp_rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The same zigzag over one dense row of length `seq_len` (apply it on the sequence dim).

    Returns:
        index: [seq_len // cp_size] long. Example: seq_len=8, cp_size=2, rank 1 -> [2, 3, 4, 5].

    Raises:
        ValueError: `seq_len` not a positive multiple of 2*cp_size.
    """
    _check_cp(cp_size, cp_rank)
    if seq_len <= 0 or seq_len % (2 * cp_size):
        raise ValueError(
            f"seq_len={seq_len} must be a positive multiple of 2*cp_size={2 * cp_size} for the "
            f"context-parallel zigzag"
        )
    chunk = seq_len // (2 * cp_size)
    ar = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + ar, (2 * cp_size - 1 - cp_rank) * chunk + ar])
