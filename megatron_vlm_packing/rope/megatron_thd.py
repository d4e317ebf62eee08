"""Does Megatron-Core's unfused THD rope take each document's CP chunks from a full packed table?

Our mRoPE rotary returns, in THD mode, frequencies for the whole packed sequence `[T, 1, 1, D]`
(T = `cu_seqlens_padded[-1]`) and leaves the CP selection to Megatron-Core's
`rope_utils._apply_rotary_pos_emb_thd`. That is only right if, given a table of exactly T rows,
it takes for each document d the zigzag chunks of rows `[cu[d], cu[d+1])` (TransformerEngine's
rule, our `cp_partition_index`). Older releases restarted every document at row 0 of the
table, which would rotate every document after the first with the first one's positions.

`thd_rope_takes_document_chunks()` checks the installed function by running it (it recovers
the row each output token was rotated with), so nothing here depends on a version string.
It holds on megatron-core 0.16.1 and 0.19.2; `use_packed_mrope` refuses to run where it does not.
"""

from __future__ import annotations

import inspect

import torch

from megatron_vlm_packing.parallel.cp import cp_partition_index


class _RankOf:
    """The two methods `_apply_rotary_pos_emb_thd` asks of its `cp_group`: size() and rank()."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def rows_used_by_thd_rope(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor | None:
    """Which row of a full `[T, 1, 1, 2]` table Megatron-Core's THD rope applies to each local token.

    Args:
        cu_seqlens_padded: [N+1] int32, physical boundaries; T = cu_seqlens_padded[-1].
        cp_size, cp_rank: the context-parallel layout to ask about.

    Returns:
        [T // cp_size] long row per local token, or None where the installed function cannot be
        called with an explicit `cp_group` (it then reads global state we do not set up here).
    """
    from megatron.core.models.common.embeddings import rope_utils

    apply_thd = rope_utils._apply_rotary_pos_emb_thd
    if "cp_group" not in inspect.signature(apply_thd).parameters:
        return None
    total = int(cu_seqlens_padded[-1])
    step = 1e-3  # angle per row: small enough that atan2 recovers the row exactly after rounding
    freqs = (torch.arange(total, dtype=torch.float64) * step).view(total, 1, 1, 1).expand(-1, 1, 1, 2)
    tokens = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(total // cp_size, 1, 2)  # [t, h, d]
    # d = 2, non-interleaved: out = (cos a, sin a) for the input (1, 0), so a = atan2(out[1], out[0]).
    out = apply_thd(tokens, cu_seqlens_padded, freqs.contiguous(), cp_group=_RankOf(cp_size, cp_rank))
    return torch.round(torch.atan2(out[:, 0, 1], out[:, 0, 0]) / step).long()


def thd_rope_takes_document_chunks() -> bool:
    """True when the installed THD rope uses rows `cp_partition_index(cu, cp, rank)` of a full table.

    Checked on uneven documents (lengths 8, 16, 8) at CP 1, 2 and 4, every rank.
    """
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    for cp_size in (1, 2, 4):
        for cp_rank in range(cp_size):
            rows = rows_used_by_thd_rope(cu, cp_size, cp_rank)
            if rows is None or not torch.equal(rows, cp_partition_index(cu, cp_size, cp_rank)):
                return False
    return True
