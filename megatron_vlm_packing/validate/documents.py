"""Which slots of each document are real: the boundaries, corrected by evidence, and the checks
that compare the two (uniform / wrong boundaries, the padding mask).

Evidence that a slot inside a real span is padding comes, in this order, from the padding mask,
from the source rows (`source.py`), or, with neither, from `pad_token_id` (then only "suspected").
When the pad slots inside a document's real span are its tail and the packer gave no separate real
set for it, the boundaries are wrong (bug class 4); anywhere else, the padding mask is.

Shape legend: T = physical packed slots, N = documents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_vlm_packing.validate.boundaries import Boundaries
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation


@dataclass(frozen=True)
class Documents:
    """Documents as the validator understands them.

    Attributes:
        bounds: the boundary sets as given.
        real: N effective real lengths (<= bounds.real[i] when pads were found inside a real span).
        doc_of_slot: [T] long, physical document of every slot.
        offset: [T] long, slot offset within its document.
        row_of_doc: N matched source rows (None = unmatched), or None without source rows.
    """

    bounds: Boundaries
    real: tuple[int, ...]
    doc_of_slot: torch.Tensor
    offset: torch.Tensor
    row_of_doc: tuple[int | None, ...] | None = None

    @property
    def num_documents(self) -> int:
        return len(self.real)

    @property
    def is_real(self) -> torch.Tensor:
        """[T] bool, True at effective real slots."""
        return self.offset < torch.tensor(self.real, dtype=torch.long)[self.doc_of_slot]

    def real_slots(self, doc: int) -> torch.Tensor:
        start = self.bounds.starts[doc]
        return torch.arange(start, start + self.real[doc])

    def with_real(self, doc: int, length: int) -> "Documents":
        real = list(self.real)
        real[doc] = length
        return replace(self, real=tuple(real))


def make_documents(bounds: Boundaries, total: int) -> Documents:
    """The slot -> document view; the boundaries must cover exactly `total` slots (checked before)."""
    doc = torch.repeat_interleave(torch.arange(bounds.num_documents), torch.tensor(bounds.physical))
    offset = torch.arange(total) - torch.tensor(bounds.starts, dtype=torch.long)[doc]
    return Documents(bounds=bounds, real=bounds.real, doc_of_slot=doc, offset=offset)


def _pad_id(inputs: PackedInputs, pad_slots: torch.Tensor) -> int | None:
    """The given pad id, else the one id every true pad slot holds (if they agree)."""
    if inputs.pad_token_id is not None:
        return inputs.pad_token_id
    values = inputs.input_ids[pad_slots].unique()
    return int(values[0]) if values.numel() == 1 else None


def check_padding_mask(inputs: PackedInputs, docs: Documents) -> tuple[list[Violation], Documents]:
    """Compare the padding mask with the real spans; pad tails inside spans shrink the documents."""
    mask = inputs.padding_mask
    if mask.shape != inputs.input_ids.shape:
        return [Violation("shapes", f"padding_mask has {tuple(mask.shape)} slots, input_ids {tuple(inputs.input_ids.shape)}")], docs
    mask = mask.bool()
    in_span = docs.is_real
    inside = mask & in_span
    out, tails, wrong_mask = [], [], []
    for d in docs.doc_of_slot[inside].unique().tolist():
        start, real = docs.bounds.starts[d], docs.real[d]
        masked = inside[start:start + real]
        k = int(masked.sum())
        is_tail = bool(masked[real - k:].all())
        no_real_set = not docs.bounds.separate_sets or docs.bounds.real[d] == docs.bounds.physical[d]
        if is_tail and no_real_set:
            tails.append((d, k))
        else:
            wrong_mask.append((d, (masked.nonzero().flatten() + start).tolist()))
    for d, k in tails:
        docs = docs.with_real(d, docs.real[d] - k)
    if tails:
        out.append(_tail_violation(docs, tails, "the padding mask"))
    if wrong_mask:
        slots = [s for _, ss in wrong_mask for s in ss]
        pad_id = _pad_id(inputs, mask & ~in_span)
        from_values = pad_id is not None and bool((inputs.input_ids[slots] == pad_id).all())
        name = "padding_from_token_values" if from_values else "padding_mask"
        extra = f"; they hold the pad id {pad_id}" if from_values else ""
        out.append(Violation(name, f"{len(slots)} real slots marked as padding, e.g. slots {slots[:8]}{extra}",
                             tuple(d for d, _ in wrong_mask)))
    unmarked = (~mask & ~docs.is_real).nonzero().flatten()
    if unmarked.numel():
        affected = tuple(docs.doc_of_slot[unmarked].unique().tolist())
        out.append(Violation("padding_mask", f"{unmarked.numel()} pad slots not marked as padding, e.g. slots "
                             f"{unmarked[:8].tolist()}", affected))
    return out, docs


def _tail_violation(docs: Documents, tails: list[tuple[int, int]], evidence: str, suspected: bool = False) -> Violation:
    physical = docs.bounds.physical
    uniform = len(set(physical)) == 1 and len(physical) > 1
    starts = list(docs.bounds.starts) + [docs.bounds.starts[-1] + physical[-1]]
    shape = f"uniform cu_seqlens [0, {physical[0]}, {2 * physical[0]}, ...]" if uniform else f"cu_seqlens {starts[:8]}"
    pads = sum(k for _, k in tails)
    verdict = "suspected from pad_token_id only; " if suspected else ""
    return Violation("uniform_boundaries",
                     f"{verdict}{shape} with {pads} pad slots inside the real spans per {evidence}: "
                     f"(document, pad slots) {tails[:8]}", tuple(d for d, _ in tails))


def suspect_pad_tails(inputs: PackedInputs, docs: Documents) -> tuple[list[Violation], Documents]:
    """No padding mask and no source: a real span ending in >= 2 slots of `pad_token_id` with no loss."""
    if inputs.pad_token_id is None:
        return [], docs
    weight = inputs.loss_mask if inputs.loss_mask is not None else None
    tails = []
    for d in range(docs.num_documents):
        if docs.bounds.separate_sets and docs.bounds.real[d] != docs.bounds.physical[d]:
            continue
        slots = docs.real_slots(d)
        ids = inputs.input_ids[slots]
        is_pad = ids == inputs.pad_token_id
        if weight is not None:
            is_pad &= weight[slots] == 0
        k = int(torch.cumprod(is_pad.flip(0).int(), 0).sum())
        if k >= 2:
            tails.append((d, k))
    for d, k in tails:
        docs = docs.with_real(d, docs.real[d] - k)
    return ([_tail_violation(docs, tails, f"pad_token_id={inputs.pad_token_id}", suspected=True)] if tails else []), docs
