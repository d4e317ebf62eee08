"""Checks against the unpacked source rows: every sample present, whole, with its own labels.

Documents are matched to source rows by content (a packer may reorder samples), so a dropped,
truncated or merged sample is named with its row.

Shape legend: T = physical packed slots, N = documents, B = source rows, S = source row length.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_vlm_packing.validate.documents import Documents, _tail_violation
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation


def _row_tokens(inputs: PackedInputs) -> dict[int, tuple[int, ...]]:
    src = inputs.source
    return {b: tuple(src.input_ids[b, :n].tolist()) for b, n in enumerate(src.lengths()) if n > 0}


def _find_prefix_row(toks: tuple, rows: dict[int, tuple], unused: set[int]) -> tuple[int | None, str]:
    """An unused row related to `toks` by a prefix: ('longer', the doc holds more) or ('truncated')."""
    for b in sorted(unused):
        row = rows[b]
        if len(row) < len(toks) and toks[:len(row)] == row:
            return b, "longer"
        if len(row) > len(toks) and row[:len(toks)] == toks:
            return b, "truncated"
    return None, ""


def match_source(inputs: PackedInputs, docs: Documents, *, trust_spans: bool) -> tuple[list[Violation], Documents]:
    """Match documents to source rows by their real tokens.

    Args:
        trust_spans: the padding mask already settled which slots are real; without it, a document
            holding a whole sample followed by one repeated id is a span with pad slots (bug class 4).
    """
    rows = _row_tokens(inputs)
    unused = set(rows)
    by_tokens: dict[tuple, list[int]] = {}
    for b, toks in rows.items():
        by_tokens.setdefault(toks, []).append(b)
    row_of_doc = _rows_with_targets(inputs, docs, by_tokens, unused)
    out, tails, altered = [], [], []
    for d in range(docs.num_documents):
        if docs.real[d] == 0 or row_of_doc[d] is not None:  # an empty segment: its own violation (zero_length_segment)
            continue
        toks = tuple(inputs.input_ids[docs.real_slots(d)].tolist())
        exact = [b for b in by_tokens.get(toks, []) if b in unused]
        if exact:
            row_of_doc[d] = exact[0]
            unused.discard(exact[0])
            continue
        b, relation = _find_prefix_row(toks, rows, unused)
        if b is None:
            altered.append((d, f"document {d} ({len(toks)} tokens) matches no source row"))
            continue
        unused.discard(b)  # the row is accounted for (reported below unless the tail is padding)
        extra = toks[len(rows[b]):]
        separate = docs.bounds.separate_sets and docs.bounds.real[d] != docs.bounds.physical[d]
        if relation == "longer" and not trust_spans and not separate and len(set(extra)) == 1:
            row_of_doc[d] = b
            tails.append((d, len(extra)))
        elif relation == "longer":
            altered.append((d, f"document {d} holds row {b} ({len(rows[b])} tokens) and {len(extra)} more tokens"))
        else:
            altered.append((d, f"document {d} has only {len(toks)} of row {b}'s {len(rows[b])} tokens (truncated)"))
    for d, k in tails:
        docs = docs.with_real(d, docs.real[d] - k)
    if tails:
        out.append(_tail_violation(docs, tails, "the source rows"))
    if altered:
        out.append(Violation("tokens_vs_source", "; ".join(m for _, m in altered[:6]), tuple(d for d, _ in altered)))
    if unused:
        lengths = [(b, len(rows[b])) for b in sorted(unused)]
        out.append(Violation("tokens_vs_source", f"source rows in no document (dropped): (row, length) {lengths[:8]}"))
    return out, replace(docs, row_of_doc=tuple(row_of_doc))


def _rows_with_targets(inputs: PackedInputs, docs: Documents, by_tokens: dict[tuple, list[int]],
                       unused: set[int]) -> list[int | None]:
    """Documents matched to a row with their tokens and their targets (rows taken out of `unused`); None for the
    rest. Samples with the same tokens and different labels may be packed in any order: matching by tokens
    alone gave each document the first such row, and a correct pack was reported labels_vs_source."""
    row_of_doc: list[int | None] = [None] * docs.num_documents
    if inputs.source.labels is None or inputs.labels is None:
        return row_of_doc
    for d in range(docs.num_documents):
        if docs.real[d] == 0:
            continue
        slots = docs.real_slots(d)
        same = [b for b in by_tokens.get(tuple(inputs.input_ids[slots].tolist()), []) if b in unused]
        row = next((b for b in same if not bool(_target_differences(inputs, slots, b)[0].any())), None)
        if row is not None:
            row_of_doc[d] = row
            unused.discard(row)
    return row_of_doc


def _target_differences(inputs: PackedInputs, slots: torch.Tensor, row: int):
    """([L] bool, True where the targets / weights at `slots` ([L] long, a document's real slots) differ from
    source row `row`'s shifted inside it; expected labels; expected trained; packed labels; packed trained)."""
    expected, weights = expected_targets(inputs, row, slots.numel())
    want = expected != inputs.ignore_index
    if weights is not None:
        want &= weights != 0
    got_label = inputs.labels[slots]
    got = (inputs.loss_mask[slots] != 0) if inputs.loss_mask is not None else got_label != inputs.ignore_index
    wrong = (want != got) | (want & (got_label != expected))
    if weights is not None and inputs.loss_mask is not None:
        wrong |= want & (inputs.loss_mask[slots].float() != weights)
    return wrong, expected, want, got_label, got


def expected_targets(inputs: PackedInputs, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[length] next-token targets of source row `row` (shifted inside it), and its loss weights.

    HF style: token k learns labels[k+1] while k+1 < the row's real length, else nothing.
    Megatron style: token k learns labels[k] (weights from source loss_mask when given).
    """
    src = inputs.source
    n = src.lengths()[row]
    labels = src.labels[row].cpu()
    if src.label_style == "hf":
        k = torch.arange(length)
        shifted = torch.where(k + 1 < n, labels[(k + 1).clamp(max=labels.numel() - 1)], inputs.ignore_index)
        return shifted, None
    weights = None if src.loss_mask is None else src.loss_mask[row, :length].cpu().float()
    return labels[:length], weights


def check_labels_vs_source(inputs: PackedInputs, docs: Documents, skip_slots: set[int]) -> list[Violation]:
    """Packed targets and weights equal the source sample's, shifted inside the sample (contract item 1)."""
    if inputs.source.labels is None or inputs.labels is None or docs.row_of_doc is None:
        return []
    bad = []
    for d, row in enumerate(docs.row_of_doc):
        if row is None:
            continue
        slots = docs.real_slots(d)
        wrong, expected, want, got_label, got = _target_differences(inputs, slots, row)
        offsets = [k for k in wrong.nonzero().flatten().tolist() if int(slots[k]) not in skip_slots]
        if offsets:
            k = offsets[0]
            bad.append((d, f"document {d} (row {row}): {len(offsets)} slots differ, first at offset {k}: label "
                           f"{int(got_label[k])} (weight {bool(got[k])}) where the sample has {int(expected[k])} "
                           f"(weight {bool(want[k])})"))
    return [Violation("labels_vs_source", "; ".join(m for _, m in bad[:4]), tuple(d for d, _ in bad))] if bad else []
