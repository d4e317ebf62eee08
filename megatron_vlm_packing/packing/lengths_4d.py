"""The 4D-mask rules of `lengths`: a Megatron [B, 1, S, S] bool mask's keep-mask and its checks.

A token is real when it may attend to itself (the mask's diagonal); between real tokens the mask must
be plain causal, and it must hold bytes 0 and 1 only (not a `.view(torch.bool)` of other bytes). Also
the two device reductions these checks ride on (`any_true`, `largest_byte`), which other checks share.
Every public name here is importable from `lengths` as well.

Shape legend: B = rows, S = row length (padded).
"""

from __future__ import annotations

import torch


def keep_mask_from_4d(mask: torch.Tensor) -> torch.Tensor:
    """Keep-mask of a Megatron 4D attention mask: a token is real when it may attend to itself.

    Args:
        mask: [B, 1, S, S] bool, True = masked (Megatron convention).

    Returns:
        keep: [B, S] bool, True = real token.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise ValueError(f"4D attention_mask must be [B, 1, S, S], got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"4D attention_mask must be bool with True = masked (Megatron convention), got {mask.dtype}"
        )
    # Bytes compared with 0, not `~`: 0/1 whatever a kernel makes of `~2` (other bytes are refused, not read).
    return torch.diagonal(mask.view(torch.uint8)[:, 0], dim1=-2, dim2=-1) == 0


def largest_byte(mask: torch.Tensor) -> torch.Tensor:
    """0-dim uint8: the largest byte of a bool tensor (0 or 1 unless it was viewed from other bytes); no host read."""
    if mask.numel() == 0:
        return torch.zeros((), dtype=torch.uint8, device=mask.device)
    return mask.view(torch.uint8).amax()


def any_true(flags: torch.Tensor) -> torch.Tensor:
    """0-dim: 1 when any element of a bool tensor is True (a uint8 max, which CPUs vectorise; no host read)."""
    if flags.numel() == 0:
        return torch.zeros((), dtype=torch.uint8, device=flags.device)
    return flags.view(torch.uint8).amax()


def _raise_4d_not_binary(mask: torch.Tensor) -> None:
    """The ValueError of a [B, 1, S, S] bool mask holding a byte other than 0 and 1, naming the first one's row,
    (query, key) and byte (error path only)."""
    values = mask.view(torch.uint8)
    b, _, i, j = torch.nonzero(values > 1)[0].tolist()
    raise ValueError(f"4D attention_mask row {b} has values other than 0 and 1: byte {int(values[b, 0, i, j])} at "
                     f"(query {i}, key {j}) of a torch.bool tensor (made by .view(torch.bool) of other bytes?); "
                     f"pass a bool mask")


def check_4d_is_causal(mask: torch.Tensor, keep: torch.Tensor) -> None:
    """A 4D bool mask holds bytes 0 and 1 only (not a .view(torch.bool) of others), and between real tokens
    it is plain causal (row i sees columns 0..i). One host read.

    A block-diagonal mask (several documents in a row) or any other pattern would be replaced by
    causal attention per row without a word; documents are declared with `document_lengths`.

    Raises:
        ValueError: naming the row and the first byte other than 0/1 with its (query, key), else the
        first real (query, key) pair that differs.
    """
    if mask.shape[-1] != keep.shape[-1]:
        return  # the shape check in real_lengths reports this
    size = mask.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=mask.device).tril()
    real_pair = keep[:, :, None] & keep[:, None, :]  # [B, S, S]
    bad = real_pair & (~mask[:, 0] != causal)
    top, non_causal = torch.stack([largest_byte(mask), any_true(bad)]).tolist()  # the one host read
    if top > 1:
        _raise_4d_not_binary(mask)
    if non_causal:
        b, i, j = torch.nonzero(bad)[0].tolist()
        what = "masks" if j <= i else "lets"
        raise ValueError(
            f"4D attention_mask row {b} {what} real token {i} {'from' if j <= i else 'see'} real token {j}: between "
            f"real tokens it must be causal; several documents in a row are declared with document_lengths"
        )


def deferred_4d_failure(mask: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """0-dim, no host read: nonzero when a [B, 1, S, S] bool mask is not plain causal between the real tokens
    of `keep` ([B, S] bool, its diagonal) or holds a byte other than 0/1 (`check_4d_is_causal`'s test, deferred
    to the caller's one read)."""
    size = mask.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=mask.device).tril()
    # A byte other than 0/1 fails too: one more reduction (the mask's largest byte) on the same read.
    return any_true(keep[:, :, None] & keep[:, None, :] & (~mask[:, 0] != causal)) | (largest_byte(mask) > 1)
