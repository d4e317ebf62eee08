"""Per-token checks on targets: no loss on pad slots, no target crossing into the next document.

Shape legend: T = physical packed slots, N = documents.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.validate.documents import Documents
from megatron_vlm_packing.validate.inputs import PackedInputs
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


def crossing_slots(inputs: PackedInputs, docs: Documents) -> list[tuple[int, int, int]]:
    """(document, slot, label) where the last real token of a document is trained on the first token
    of the next document (bug class 8), unless the source sample has that very target."""
    trained = target_weights(inputs)
    if trained is None or inputs.labels is None:
        return []
    found = []
    for d in range(docs.num_documents - 1):
        if docs.real[d] == 0 or docs.real[d + 1] == 0:
            continue
        last = docs.bounds.starts[d] + docs.real[d] - 1
        first_next = docs.bounds.starts[d + 1]
        label = int(inputs.labels[last])
        if bool(trained[last]) and label == int(inputs.input_ids[first_next]) and not _source_has(inputs, docs, d, label):
            found.append((d, last, label))
    return found


def _source_has(inputs: PackedInputs, docs: Documents, doc: int, label: int) -> bool:
    if inputs.source is None or inputs.source.labels is None or docs.row_of_doc is None:
        return False
    row = docs.row_of_doc[doc]
    if row is None:
        return False
    from megatron_vlm_packing.validate.source import expected_targets

    expected, _ = expected_targets(inputs, row, docs.real[doc])
    return int(expected[-1]) == label


def check_labels_cross_documents(inputs: PackedInputs, docs: Documents) -> list[Violation]:
    found = crossing_slots(inputs, docs)
    if not found:
        return []
    detail = [f"document {d} slot {s} learns {label} = document {d + 1}'s first token" for d, s, label in found[:6]]
    return [Violation("labels_cross_documents", "; ".join(detail), tuple(d for d, _, _ in found))]
