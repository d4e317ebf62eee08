"""Which key each query may attend to, from the two boundary sets (pure functions).

Shape legend: T = physical packed tokens, Tq = local queries, N = documents, S = dense row length.
"""

from __future__ import annotations

import torch


def slot_documents(positions: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor):
    """Document, offset and realness of physical slots.

    Args:
        positions: [P] long, physical slot indices in [0, T).
        cu_seqlens: [N+1] int, real boundaries; cu_seqlens_padded: [N+1] int, physical boundaries.

    Returns:
        (document [P] long, offset [P] long, is_real [P] bool): the slot's document, its offset from
        the document's physical start, and whether it holds a real token (offset < real length).
    """
    cu_padded = cu_seqlens_padded.long()
    document = torch.searchsorted(cu_padded, positions, right=True) - 1
    offset = positions - cu_padded[document]
    real_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return document, offset, offset < real_lengths[document]


def packed_attention_mask(
    q_positions: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    causal: bool,
    total: int | None = None,
) -> torch.Tensor:
    """[Tq, T] bool, True where query slot i may attend to key slot j.

    Allowed exactly when both are real tokens of the same document and (causal) the key does not
    come after the query. Pad-slot queries attend to nothing (their output is zero). `total` is T
    when the caller has it on the host (else it is read from `cu_seqlens_padded[-1]`).
    """
    total = int(cu_seqlens_padded[-1]) if total is None else total
    k_positions = torch.arange(total, device=q_positions.device)
    q_doc, q_off, q_real = slot_documents(q_positions, cu_seqlens, cu_seqlens_padded)
    k_doc, k_off, k_real = slot_documents(k_positions, cu_seqlens, cu_seqlens_padded)
    allowed = (q_doc[:, None] == k_doc[None, :]) & q_real[:, None] & k_real[None, :]
    if causal:
        allowed &= k_off[None, :] <= q_off[:, None]
    return allowed


def dense_attention_mask(
    q_positions: torch.Tensor, seq_len: int, *, causal: bool, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[B or 1, Sq, S] bool, True = may attend, for dense rows.

    Args:
        q_positions: [Sq] long, global positions of the local queries (the CP zigzag, or arange).
        attention_mask: optional [B, 1, Sq, S] bool, True = masked (Megatron convention).
    """
    k_positions = torch.arange(seq_len, device=q_positions.device)
    allowed = torch.ones(q_positions.numel(), seq_len, dtype=torch.bool, device=q_positions.device)
    if causal:
        allowed = k_positions[None, :] <= q_positions[:, None]
    allowed = allowed[None]
    if attention_mask is not None:
        allowed = allowed & ~attention_mask[:, 0]
    return allowed
