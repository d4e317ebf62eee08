"""Per-token checks on targets: no loss on pad slots, no target crossing into the slots after a document.

Shape legend: T = physical packed slots, N = documents.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_vlm_packing.validate.documents import Documents
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation


def target_weights(inputs: PackedInputs) -> torch.Tensor | None:
    """[T] bool, True where a token is trained: loss weight != 0, else (no loss mask) a label is set."""
    if inputs.loss_mask is not None:
        return inputs.loss_mask != 0
    if inputs.labels is not None:
        return inputs.labels != inputs.ignore_index
    return None


def check_loss_on_pad(inputs: PackedInputs, docs: Documents) -> list[Violation]:
    """No loss weight at pad slots (contract item 1: only real tokens train)."""
    trained = target_weights(inputs)
    if trained is None:
        return []
    leak = (trained & ~docs.is_real).nonzero().flatten()
    if not leak.numel():
        return []
    affected = tuple(docs.doc_of_slot[leak].unique().tolist())
    return [Violation("loss_on_pad", f"{leak.numel()} pad slots carry loss, e.g. slots {leak[:8].tolist()}", affected)]


def _named_slots(check: str, what: str, slots: torch.Tensor, docs: Documents, name: str,
                 values: torch.Tensor) -> list[Violation]:
    """One violation of `check` naming the first `slots` ([K] long), their `values` ([T], called `name`) and
    their documents; none without slots."""
    if not slots.numel():
        return []
    affected = tuple(docs.doc_of_slot[slots].unique().tolist())
    return [Violation(check, f"{slots.numel()} slots {what}, e.g. slots {slots[:8].tolist()} ({name} "
                             f"{values[slots[:8]].tolist()})", affected)]


def check_loss_weights(inputs: PackedInputs, docs: Documents) -> list[Violation]:
    """Loss weights finite and >= 0 at every slot (the packers' rule, `packing.checks`): a NaN or inf weight
    makes the loss sum NaN or inf, a negative one trains away from its target."""
    if inputs.loss_mask is None or inputs.loss_mask.dtype == torch.bool:
        return []
    weights = inputs.loss_mask.double()
    bad = (~torch.isfinite(weights) | (weights < 0)).nonzero().flatten()
    return _named_slots("loss_weights", "with a loss weight not finite or negative", bad, docs, "weights", weights)


def check_loss_without_target(inputs: PackedInputs, docs: Documents) -> list[Violation]:
    """No real slot trained (loss weight != 0, or without a loss mask a label set) with a label that is the
    ignore index or negative: Megatron's loss sums every weighted slot whatever its label."""
    trained = target_weights(inputs)
    if trained is None or inputs.labels is None:
        return []
    labels = inputs.labels.long()
    no_target = (labels < 0) | (labels == inputs.ignore_index)
    bad = (trained & no_target & docs.is_real).nonzero().flatten()
    return _named_slots("loss_without_target", "trained with no target", bad, docs, "labels", labels)


class Crossings(NamedTuple):
    """Last real tokens trained on a token a shift after concatenation would give them (bug class 8).

    Attributes:
        found: (document, slot, label) where the document's source row has another target there, or, without one,
            where the labels were HF style (`PackedInputs.label_style`): an HF-style sample's last token has none.
        undecided: documents with such a label, no source row (with labels) matched to them and labels not said to
            be HF style. Their sample's own next token is not in the pack, and may be that very id (an EOS that is
            the next document's first token, or the pad id): a crossing and a correct pack hold the same numbers.
    """

    found: list[tuple[int, int, int]]
    undecided: list[int]


def _tokens_after(inputs: PackedInputs, docs: Documents, doc: int, is_real: torch.Tensor) -> dict[int, str]:
    """{id: what it is} a shift after concatenation gives document `doc`'s last real token: the next slot's (a pad
    of `doc`, or the next document's first: a shift over the physical slots) and the next document's first real
    token (a shift over the real tokens laid end to end). Empty after the pack's last slot. `is_real`: [T] bool,
    `docs.is_real` (made once by the caller)."""
    last = docs.bounds.starts[doc] + docs.real[doc] - 1
    after = {}
    if doc + 1 < docs.num_documents and docs.real[doc + 1]:
        after[int(inputs.input_ids[docs.bounds.starts[doc + 1]])] = f"document {doc + 1}'s first token"
    if last + 1 < inputs.total and not bool(is_real[last + 1]):
        after.setdefault(int(inputs.input_ids[last + 1]), "the pad slot after it")
    return after


def crossings(inputs: PackedInputs, docs: Documents) -> Crossings:
    """Documents whose last real token is trained on a token of the slots after it (`_tokens_after`): `found`
    where the source row has another target there or the labels were HF style, `undecided` otherwise."""
    trained = target_weights(inputs)
    if trained is None or inputs.labels is None:
        return Crossings([], [])
    found, undecided, is_real = [], [], docs.is_real
    for d in range(docs.num_documents):
        if docs.real[d] == 0:
            continue
        last = docs.bounds.starts[d] + docs.real[d] - 1
        label = int(inputs.labels[last])
        if not bool(trained[last]) or label not in _tokens_after(inputs, docs, d, is_real):
            continue
        own = _source_target(inputs, docs, d)
        if own is None and inputs.label_style == "hf":  # the sample has no target after its last token
            found.append((d, last, label))
        elif own is None:
            undecided.append(d)
        elif own != label:
            found.append((d, last, label))
    return Crossings(found, undecided)


def _source_target(inputs: PackedInputs, docs: Documents, doc: int) -> int | None:
    """The target of document `doc`'s last real token in its source row, or None without one to read."""
    if inputs.source is None or inputs.source.labels is None or docs.row_of_doc is None:
        return None
    row = docs.row_of_doc[doc]
    if row is None:
        return None
    from megatron_vlm_packing.validate.source import expected_targets

    expected, _ = expected_targets(inputs, row, docs.real[doc])
    return int(expected[-1])


def check_labels_cross_documents(inputs: PackedInputs, docs: Documents) -> tuple[list[Violation], str | None]:
    """The crossings the source rows decide (a violation), and why the undecided documents are not (or None)."""
    found, undecided = crossings(inputs, docs)
    why = None
    if undecided:
        why = (f"documents {undecided[:16]}{' ...' if len(undecided) > 16 else ''}: the last token is trained on "
               f"the id of the token after it in the pack (the next document's first, or a pad); without source "
               f"rows (with labels) matched to them, labels shifted after concatenation cannot be told from a "
               f"sample whose own next token that id is (an EOS that opens the next document, or is the pad id)"
               + ("" if inputs.label_style == "megatron" else "; label_style='hf' decides it when the samples' "
                  "labels were unshifted: an HF-style sample's last token has no target"))
    if not found:
        return [], why
    is_real = docs.is_real
    detail = [f"document {d} slot {s} learns {label} = {_tokens_after(inputs, docs, d, is_real)[label]}"
              for d, s, label in found[:6]]
    return [Violation("labels_cross_documents", "; ".join(detail), tuple(d for d, _, _ in found))], why
