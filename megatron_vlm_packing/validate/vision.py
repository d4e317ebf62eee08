"""Image / video placeholders against their grids, document by document (contract item 10).

Each image (video) takes `t*h*w / merge**2` placeholder tokens. Items are assigned to documents in
order: by the given per-document counts, else greedily (consecutive items filling each document's
placeholders exactly); a document whose placeholders no run of items fills is named.

Shape legend: N = documents, I = images (or videos).
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.validate.documents import Documents
from megatron_vlm_packing.validate.inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation


def _tokens_per_item(grid: torch.Tensor, merge: int, kind: str) -> tuple[list[int], str | None]:
    if grid.dim() != 2 or grid.shape[1] != 3:
        return [], f"{kind}_grid_thw must be [{kind[0].upper()}, 3], got {tuple(grid.shape)}"
    rows = grid.long().tolist()
    bad = [i for i, (t, h, w) in enumerate(rows) if min(t, h, w) < 1 or (h % merge) or (w % merge)]
    if bad:
        return [], f"{kind}_grid_thw rows {[(i, rows[i]) for i in bad[:4]]} are not positive multiples of merge {merge}"
    return [t * h * w // (merge * merge) for t, h, w in rows], None


def _runs(is_ph: torch.Tensor, docs: Documents) -> list[list[int]]:
    """Lengths of the contiguous placeholder runs of every document, in order."""
    runs: list[list[int]] = [[] for _ in range(docs.num_documents)]
    slots = is_ph.nonzero().flatten().tolist()
    prev = None
    for slot in slots:
        d = int(docs.doc_of_slot[slot])
        if prev is not None and slot == prev + 1 and int(docs.doc_of_slot[prev]) == d:
            runs[d][-1] += 1
        else:
            runs[d].append(1)
        prev = slot
    return runs


def _fits(runs: list[int], sizes: list[int]) -> bool:
    """Every run ends where an item ends (items may share a run when nothing separates them)."""
    ends, total = set(), 0
    for n in sizes:
        total += n
        ends.add(total)
    total = 0
    for n in runs:
        total += n
        if total not in ends:
            return False
    return True


def _assign(counts: list[int], sizes: list[int], per_doc: tuple[int, ...] | None,
            runs: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Items per document, and the documents whose placeholder runs the items do not fill exactly."""
    items, bad, j = [], [], 0
    for d, need in enumerate(counts):
        take, total = [], 0
        if per_doc is not None:
            take = list(range(j, min(j + per_doc[d], len(sizes)))) if d < len(per_doc) else []
            total = sum(sizes[i] for i in take)
        else:
            while j + len(take) < len(sizes) and total < need:
                total += sizes[j + len(take)]
                take.append(j + len(take))
        j += len(take)
        items.append(take)
        if total != need or not _fits(runs[d], [sizes[i] for i in take]):
            bad.append(d)
    return items, bad


def check_kind(inputs: PackedInputs, docs: Documents, kind: str) -> tuple[list[Violation], list[list[int]] | None, set[int]]:
    """Returns violations, items per document (None when unchecked) and the documents that failed."""
    token_id = getattr(inputs, f"{kind}_token_id")
    grid = getattr(inputs, f"{kind}_grid_thw")
    per_doc = getattr(inputs, f"{kind}s_per_document")
    if token_id is None:
        return [], None, set()
    is_ph = inputs.input_ids == token_id
    real = docs.is_real
    counts = torch.bincount(docs.doc_of_slot[is_ph & real], minlength=docs.num_documents).tolist()
    out = []
    on_pads = (is_ph & ~real).nonzero().flatten()
    if on_pads.numel():
        out.append(Violation("vision_placeholders", f"{on_pads.numel()} {kind} placeholders (id {token_id}) on pad "
                             f"slots, e.g. {on_pads[:8].tolist()}", tuple(docs.doc_of_slot[on_pads].unique().tolist())))
    if grid is None or grid.numel() == 0:
        if sum(counts):
            docs_with = tuple(d for d, c in enumerate(counts) if c)
            out.append(Violation("vision_placeholders", f"{sum(counts)} {kind} placeholders but no {kind}_grid_thw", docs_with))
        return out, [[] for _ in counts], set(d for d, c in enumerate(counts) if c)
    sizes, problem = _tokens_per_item(grid, inputs.spatial_merge_size, kind)
    if problem:
        return out + [Violation("vision_placeholders", problem)], None, set(range(docs.num_documents))
    if per_doc is not None and (len(per_doc) != docs.num_documents or sum(per_doc) != len(sizes)):
        out.append(Violation("vision_placeholders", f"{kind}s_per_document {list(per_doc)[:8]} does not fit "
                             f"{docs.num_documents} documents and {len(sizes)} {kind}s"))
        return out, None, set(range(docs.num_documents))
    if sum(counts) != sum(sizes):
        out.append(Violation("vision_placeholders", f"{sum(counts)} {kind} placeholders (id {token_id}) in real "
                             f"tokens but the {len(sizes)} grids need {sum(sizes)} ({sizes[:8]})"))
    runs = _runs(is_ph & real, docs)
    items, bad = _assign(counts, sizes, per_doc, runs)
    if bad and sum(counts) == sum(sizes):
        detail = [(d, runs[d], [sizes[i] for i in items[d]]) for d in bad[:6]]
        out.append(Violation("vision_placeholders", f"placeholder runs per document do not match consecutive {kind} "
                             f"grids: (document, placeholder runs, grid tokens assigned) {detail}", tuple(bad)))
    return out, items, set(bad) if bad else set()


def check_vision(inputs: PackedInputs, docs: Documents) -> tuple[list[Violation], dict, set[int]]:
    """Both kinds; returns violations, {kind: items per document}, the failed documents."""
    out, items, failed = [], {}, set()
    for kind in ("image", "video"):
        v, per_doc, bad = check_kind(inputs, docs, kind)
        out += v
        failed |= bad
        if v and not bad:  # a total mismatch: no document can be trusted
            failed |= set(range(docs.num_documents))
        items[kind] = per_doc
    return out, items, failed
