"""Pre-packed rows: a batch whose rows already hold several documents keeps every document.

Format (one, checked): `document_lengths`, a [B, D] integer tensor (or B lists of ints) giving the
real length of each document of each row, in order, padded with trailing zeros; each row's
lengths sum to that row's real length (from `attention_mask` / `seq_lens`, or the full row). This
is what packed-SFT datasets give as per-row `cu_seqlens` (take `diff`) or `seq_lens` lists.

`split_documents` turns such a batch into one row per document ([N, S], right-padded): every
sequence-aligned tensor is gathered (rows of the same length S), so the rest of the pipeline treats each document as a sample
of its own: positions restart, HF labels shift inside each document, mRoPE positions and media
counts are per document, and `pack_batch` makes each document its own THD segment.

Shape legend: B = rows, S = row length, D = most documents in a row, N = documents.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Mapping

import torch

from megatron_vlm_packing.packing.bounds import int_entries
from megatron_vlm_packing.packing.lengths import real_lengths

DOCUMENT_KEY = "document_lengths"


def document_table(value, lengths: list[int]) -> list[list[int]]:
    """Per-row document lengths as host ints, checked against the rows' real lengths.

    Raises:
        ValueError: not integers (numpy ints are), a negative or zero length before the row's last document, or a
        row whose documents do not sum to its real length (naming the row and numbers).
    """
    if isinstance(value, torch.Tensor):
        if value.dim() != 2 or value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(f"{DOCUMENT_KEY} must be a [B, D] integer tensor (or B lists of ints), got "
                             f"shape {tuple(value.shape)} {value.dtype}")
        rows = value.tolist()
    elif isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in value):
        # numpy ints as Python ints (a numpy-based dataset yields them); a bool, float or string refused
        rows = [int_entries(r, f"{DOCUMENT_KEY} row {b}", "document lengths") for b, r in enumerate(value)]
    else:
        raise ValueError(f"{DOCUMENT_KEY} must be a [B, D] integer tensor or B lists of ints, got {type(value).__name__}")
    if len(rows) != len(lengths):
        raise ValueError(f"{DOCUMENT_KEY} has {len(rows)} rows but input_ids has {len(lengths)}")
    table = []
    for b, (row, real) in enumerate(zip(rows, lengths)):
        while row and row[-1] == 0:
            row = row[:-1]
        if any(n < 1 for n in row):
            raise ValueError(f"{DOCUMENT_KEY} row {b} is {rows[b]}: document lengths must be >= 1 "
                             f"(zeros only as trailing padding)")
        if sum(row) != real:
            raise ValueError(f"{DOCUMENT_KEY} row {b} sums to {sum(row)} tokens ({row}) but the row has {real} "
                             f"real tokens")
        table.append(row)
    return table


def _gather_index(table: list[list[int]], row_length: int, device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """[N, S] flat source index b*S + s of every document slot, [N, S] bool real mask, N lengths."""
    starts, doc_lengths = [], []
    for b, row in enumerate(table):
        offset = 0
        for n in row:
            starts.append(b * row_length + offset)
            doc_lengths.append(n)
            offset += n
    arange = torch.arange(row_length, device=device)  # documents keep the row length S (each fits in its row)
    start_t = torch.tensor(starts, device=device)
    length_t = torch.tensor(doc_lengths, device=device)
    valid = arange[None] < length_t[:, None]
    index = torch.where(valid, start_t[:, None] + arange[None], 0)
    return index, valid, doc_lengths


def _gather_rows(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, fill) -> torch.Tensor:
    """[B, S, ...] -> [N, Ld, ...] following `index`; `fill` outside each document."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    out = flat.index_select(0, index.reshape(-1)).reshape(*index.shape, *x.shape[2:])
    keep = valid.view(*valid.shape, *([1] * (x.dim() - 2)))
    return torch.where(keep, out, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


@dataclass(frozen=True)
class DocumentPlaces:
    """Where each row split from pre-packed documents came from, so that errors name a token where the
    user's batch has it.

    Attributes:
        rows: N source rows, one per document, in order.
        starts: N positions in its source row where each document starts.
        ordinals: N, each document's index among its row's documents.
    """

    rows: tuple[int, ...]
    starts: tuple[int, ...]
    ordinals: tuple[int, ...]

    @classmethod
    def of(cls, table: list[list[int]]) -> "DocumentPlaces":
        """The places of a `document_table` (per-row document lengths, host ints)."""
        rows, starts, ordinals = [], [], []
        for row, lengths in enumerate(table):
            start = 0
            for ordinal, length in enumerate(lengths):
                rows.append(row)
                starts.append(start)
                ordinals.append(ordinal)
                start += length
        return cls(tuple(rows), tuple(starts), tuple(ordinals))

    def row_name(self, document: int) -> str:
        """Split row `document` named in the batch as given (`media_counts.row_label`)."""
        return f"row {self.rows[document]} document {self.ordinals[document]}"

    def where(self, document: int, position: int) -> str:
        """A token of split row `document` at `position` in the batch as given (`checks.token_place`)."""
        row, start = self.rows[document], self.starts[document]
        return (f"row {row} position {start + position} (document {self.ordinals[document]} of row {row}, "
                f"its position {position})")


def split_documents(batch: Mapping, input_ids_key: str, extra_keys=()) -> tuple[dict, DocumentPlaces]:
    """One row per document (see the module docstring).

    Returns:
        (new batch with [N, S] sequence tensors and `seq_lens` = document lengths, where each
        document came from).

    Raises:
        ValueError: a bad `document_lengths` (see `document_table`), or a 4D attention mask (give
        either the document lengths or a mask, the lengths are the format).
    """
    ids = batch[input_ids_key]
    mask = batch.get("attention_mask")
    if mask is not None and isinstance(mask, torch.Tensor) and mask.dim() == 4:
        raise ValueError(f"{DOCUMENT_KEY} goes with a 2D attention_mask or seq_lens, not a 4D attention_mask")
    lengths = real_lengths(batch_size=ids.shape[0], row_length=ids.shape[1], attention_mask=mask,
                           seq_lens=batch.get("seq_lens"))
    # A row with no real tokens declares no document but stays one (empty) row, as it is without
    # document_lengths: pad_batch keeps B rows, and a batch of empty rows gets the plan's "no real tokens"
    # error, not an index_select of no documents at all.
    table = [row or [0] for row in document_table(batch[DOCUMENT_KEY], lengths)]
    index, valid, doc_lengths = _gather_index(table, ids.shape[1], ids.device)
    out = {k: v for k, v in batch.items() if k not in (DOCUMENT_KEY, "attention_mask", "seq_lens")}
    out["seq_lens"] = doc_lengths
    fills = {input_ids_key: 0, "labels": -100, "loss_mask": 0}
    # mm_token_type_ids (transformers 5 processors return it) is per token too: left [B, S], the mRoPE
    # index of the [N, S] documents indexed past it (an IndexError).
    for key in (input_ids_key, "labels", "loss_mask", "mm_token_type_ids", *extra_keys):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(ids.shape):
            out[key] = _gather_rows(value, index, valid, fills.get(key, 0))
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and tuple(positions.shape) == tuple(ids.shape):
        out["position_ids"] = _gather_rows(positions, index, valid, 0)
    elif isinstance(positions, torch.Tensor) and positions.dim() == 3 and positions.shape[0] == 3 \
            and tuple(positions.shape[1:]) == tuple(ids.shape):
        out["position_ids"] = torch.stack([_gather_rows(p, index, valid, 0) for p in positions])
    return out, DocumentPlaces.of(table)
