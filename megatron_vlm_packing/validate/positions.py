"""Positions restart per document; mRoPE documents with vision tokens keep their t/h/w positions.

Shape legend: T = physical packed slots, N = documents, L = one document's real tokens.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.packing.positions import HALF_EXACT_WHOLE_NUMBERS
from megatron_vlm_packing.validate.documents import Documents
from megatron_vlm_packing.validate.model_index import against_model_index
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation
from megatron_vlm_packing.validate.vision import MediaFindings


def vision_documents(inputs: PackedInputs, docs: Documents, *, min_run: int = 1) -> set[int] | None:
    """Documents with runs of >= `min_run` image / video placeholders at real slots; None when no
    placeholder id is known. (A one-token image has equal t/h/w positions in mRoPE too.)"""
    ids = [t for t in (inputs.image_token_id, inputs.video_token_id) if t is not None]
    if not ids:
        return None
    is_vision = torch.isin(inputs.input_ids, torch.tensor(ids)) & docs.is_real
    if min_run > 1:  # keep slots whose previous min_run - 1 slots are placeholders of the same document
        run = is_vision.clone()
        for k in range(1, min_run):
            prev = torch.cat([torch.zeros(k, dtype=torch.bool), is_vision[:-k]])
            same = torch.cat([torch.zeros(k, dtype=torch.bool), docs.doc_of_slot[k:] == docs.doc_of_slot[:-k]])
            run &= prev & same
        is_vision = run
    return set(docs.doc_of_slot[is_vision].unique().tolist())


def check_positions_1d(inputs: PackedInputs, docs: Documents) -> list[Violation]:
    """1D positions equal the offset in the document at every real slot (contract item 3)."""
    positions = inputs.position_ids
    real = docs.is_real
    wrong = real & (positions.long() != docs.offset)
    if not wrong.any():
        out = []
    else:
        bad = docs.doc_of_slot[wrong].unique().tolist()
        detail = []
        for d in bad[:8]:  # the first wrong token of each: a document's first position is often right
            slot = int(torch.nonzero(wrong & (docs.doc_of_slot == d))[0])
            offset = slot - int(docs.bounds.starts[d])
            detail.append((d, offset, positions[slot].item(), offset))
        out = [Violation("positions_restart", f"(document, token, position, expected) {detail}; each document's "
                         f"real tokens must be at 0, 1, 2, ...", tuple(bad))]
    vision = vision_documents(inputs, docs, min_run=2)
    if inputs.mrope is not None and vision:
        out.append(Violation("mrope_channels_identical", f"1D positions for an mRoPE model: documents {sorted(vision)[:8]} "
                             f"have vision tokens that need their own t/h/w positions", tuple(sorted(vision))))
    return out


def float64_read_changes(inputs: PackedInputs, docs: Documents) -> list[Violation]:
    """[3, T] float64 positions that the rotary's float32 reading changes (Megatron's MultimodalRotaryEmbedding casts
    them to its inv_freq dtype; `rope.rotary` likewise), named (contract 3 / 10). bf16 / fp16 values are all float32
    values: whether they are right is the index's question (`half_positions_unjudged` without it)."""
    positions, real = inputs.position_ids, docs.is_real
    if positions.dtype != torch.float64:
        return []
    changed = (positions.float().double() != positions) & real
    if not bool(changed.any()):
        return []
    channel, slot = (int(i) for i in changed.nonzero()[0])
    value = positions[channel, slot]
    return [Violation("dtypes", f"position_ids are torch.float64 and the rotary reads positions as float32, "
                      f"which changes {int(changed.sum())} of them: channel {channel} slot {slot}: "
                      f"{float(value)!r} is read as {float(value.float())!r}",
                      tuple(docs.doc_of_slot[changed.any(0)].unique().tolist()))]


def _rounding_examples(dtype: torch.dtype, limit: int, top: float) -> str:
    """Whole numbers just above `limit` (the dtype's exact range) that `dtype` rounds, and, where positions reach
    twice the limit, one there (the dtype steps by 4): '257 rounds to 256, 259 to 260, 514 to 512'."""
    examples = [limit + 1, limit + 3] + ([2 * limit + 2] if top > 2 * limit else [])
    rounded = [int(torch.tensor(float(v), dtype=torch.float64).to(dtype)) for v in examples]
    parts = [f"{v} rounds to {r}" if i == 0 else f"{v} to {r}" for i, (v, r) in enumerate(zip(examples, rounded))]
    return ", ".join(parts)


def half_positions_unjudged(inputs: PackedInputs, docs: Documents,
                            documents: set[int] | None = None) -> list[Violation]:
    """[3, T] bf16 / fp16 positions above the whole numbers the dtype holds exactly (`HALF_EXACT_WHOLE_NUMBERS`),
    in documents no index compared (all, or those of `documents`): a value there may be a rounded position (257
    stored as 256), which only the model's index can tell from a right one, so they are named with the whole
    numbers that round (contract 3 / 10). Nothing when the dtype is not a half one or no position is beyond."""
    positions = inputs.position_ids
    limit = HALF_EXACT_WHOLE_NUMBERS.get(positions.dtype)
    if limit is None:
        return []
    beyond = (positions.abs() > limit).any(0) & docs.is_real
    if documents is not None:
        beyond &= torch.isin(docs.doc_of_slot, torch.tensor(sorted(documents), dtype=docs.doc_of_slot.dtype))
    if not bool(beyond.any()):
        return []
    found = tuple(docs.doc_of_slot[beyond].unique().tolist())
    top = float(positions[:, beyond].abs().max())
    return [Violation("dtypes", f"position_ids are {positions.dtype}, which holds whole numbers exactly only up to "
                      f"{limit} ({_rounding_examples(positions.dtype, limit, top)}), and documents {list(found)[:8]} "
                      f"hold {int(beyond.sum())} positions above {limit} (up to {top:g}): without the model's index "
                      f"(mrope=) they cannot be told from rounded ones; pack mRoPE positions as integers (float32 "
                      f"where they are fractional)", found)]


def check_positions_3d(inputs: PackedInputs, docs: Documents,
                       media: MediaFindings) -> tuple[list[Violation], dict[int, str]]:
    """[3, T] positions: read as the rotary reads them (float64 that float32 changes, or bf16 / fp16 beyond their
    exact whole numbers with no index to judge them, stop here), restart at 0, distinct channels on vision
    documents, equal to the model's index (`validate.model_index`, given each document's items of `media`; its
    failed documents are not asked about).
    Returns the violations and the documents the index could not check, with why."""
    positions = inputs.position_ids
    unread = float64_read_changes(inputs, docs)
    if not unread and inputs.mrope is None:  # no index to tell exact bf16 / fp16 positions from rounded ones
        unread = half_positions_unjudged(inputs, docs)
    if unread:  # the values are not what the model reads, or cannot be judged: the checks below would mislead
        return unread, {}
    out, flagged = [], set()
    starts = [d for d in range(docs.num_documents) if docs.real[d] and
              bool((positions[:, docs.bounds.starts[d]] != 0).any())]
    if starts:
        detail = [(d, positions[:, docs.bounds.starts[d]].tolist()) for d in starts[:6]]
        out.append(Violation("positions_restart", f"(document, first t/h/w position) {detail}; each document starts "
                             f"at 0", tuple(starts)))
        flagged |= set(starts)
    vision = vision_documents(inputs, docs, min_run=2) or set()
    identical = []
    for d in sorted(vision):
        p = positions[:, docs.real_slots(d)]
        if bool((p[0] == p[1]).all() and (p[1] == p[2]).all()):
            identical.append(d)
    if identical:
        out.append(Violation("mrope_channels_identical", f"the 3 channels are equal on every token of documents "
                             f"{identical[:8]}, which hold image / video placeholders", tuple(identical)))
        flagged |= set(identical)
    if inputs.mrope is None:
        return out, {}
    found, unchecked = against_model_index(inputs, docs, media.items, flagged | media.failed, media.audio.unchecked)
    # bf16 / fp16 positions the index compared are judged by it (exact ones pass, rounded ones differ); the rest
    # are judged as without an index
    return out + found + (half_positions_unjudged(inputs, docs, set(unchecked)) if unchecked else []), unchecked


def check_positions(inputs: PackedInputs, docs: Documents,
                    media: MediaFindings) -> tuple[list[Violation], dict[int, str]]:
    """Violations, and {document: why the model's index could not check it}; `media`: what `check_vision` found."""
    if inputs.position_ids.dim() == 1:
        return check_positions_1d(inputs, docs), {}
    return check_positions_3d(inputs, docs, media)
