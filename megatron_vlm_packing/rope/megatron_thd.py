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

The same rule, written with no host sync and no per-document loop (`thd_rope_rows`), is what
`patches.thd_rotary` runs instead of the installed function, whose per-document loop reads
`cu_seqlens` on the host in every layer, for queries and keys (bug class 14);
`thd_rope_host_syncs()` counts those reads on the installed function.

Shape legend: T = packed physical tokens, Tl = T / cp (this rank's tokens), N = documents.
"""

from __future__ import annotations

import inspect

import torch

from megatron_vlm_packing.parallel.cp import cp_partition_index, zigzag_index


class CpLocalFreqs(torch.Tensor):
    """A rotary table `[Tl, 1, 1, D]` whose row j rotates this CP rank's local token j (THD).

    A tensor subclass (not an attribute) so the mark survives `detach()` in activation recompute;
    `patches.thd_rotary` recognises it and applies it as one op. Made with `CpLocalFreqs.mark(table)`.
    """

    @staticmethod
    def mark(table: torch.Tensor) -> "CpLocalFreqs":
        return table.as_subclass(CpLocalFreqs)


def thd_boundaries(packed_seq_params) -> torch.Tensor:
    """The boundaries THD attention rotates queries with: the padded ones when present (Megatron-Core's choice)."""
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    return padded if padded is not None else packed_seq_params.cu_seqlens_q


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


def thd_rope_rows(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, *, local_tokens: int,
                  table_rows: int) -> torch.Tensor:
    """The row of a frequency table Megatron-Core's THD rope rotates each local token with: no sync.

    Megatron-Core's rule (`_apply_rotary_pos_emb_thd`): a table of exactly T = cu_seqlens[-1] rows
    holds every packed token (row = the token's packed slot); any other table is indexed from 0 in
    every document (row = the token's offset within its document, the 1D-rope case). Under CP the
    local tokens are each document's zigzag chunks. The case is chosen on the device
    (`torch.where`), so nothing is read back to the host.

    Args:
        cu_seqlens: [N+1] int, the boundaries attention rotates with (padded ones when present);
            every document a multiple of 2*cp_size when cp_size > 1 (as Megatron-Core assumes).
        cp_size, cp_rank: the context-parallel layout.
        local_tokens: Tl, this rank's token count (the rotated tensor's length).
        table_rows: the frequency table's length.

    Returns:
        [Tl] long rows.
    """
    local = zigzag_index(cu_seqlens, cp_size, cp_rank, local_total=local_tokens)
    whole_pack_table = cu_seqlens[-1] == table_rows  # 0-d bool on the device
    return torch.where(whole_pack_table, local.index, local.index - local.document_start)


def thd_rope_host_syncs(apply_thd=None) -> int:
    """Host syncs (testing.sync_counter) of one THD rope call on 3 documents at CP 2.

    Args:
        apply_thd: the function to count; default: the installed
            `rope_utils._apply_rotary_pos_emb_thd` (whatever is there now, patched or not).

    Returns:
        0 for a loop-free implementation; Megatron-Core 0.16.1 and 0.19.2 read `cu_seqlens` back
        (`.tolist()`, then one `.item()` per document, or a tensor compared in an `if`).
    """
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    apply_thd = apply_thd or rope_utils._apply_rotary_pos_emb_thd
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    tokens, freqs = torch.ones(16, 1, 4), torch.ones(32, 1, 1, 4)
    with count_host_syncs() as syncs:
        apply_thd(tokens, cu, freqs, cp_group=_RankOf(2, 0))
    return syncs.total
