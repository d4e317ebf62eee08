"""The plain batch packed on the host: `pack_batch(host_reads=True)`'s clean path for the most common batch.

Most micro-batches a DataLoader worker packs are plain text rows: ids, labels, an optional loss mask,
a 0/1 attention mask and optional [B, S] positions, all on the CPU, without media, mRoPE, extras or
pre-packed documents. For those, `read_rows`' general reading (media and mRoPE reads queued, key
dispatch, deferred checks for a batch on an accelerator) is most of the time at a few rows: its
Python layers cost more than the numpy work itself.

`pack_plain_batch_on_host` packs such a batch with the same pieces (`make_pack_plan`, `plan_indices`,
`host_tokens.PackedHostTokens`) and the same tests (`lengths.right_padded_row_lengths`,
`packed_value_checks.packed_value_faults`, `positions.host_positions_differ`), over numpy views of the tensors (each
tensor crosses once); a plan without pad slots (cp = 1, no total multiple or pad_to to fill) takes one
function for the copies, tests and weights (`_pack_row_prefixes`). `pack_batch` builds the same
`MicroBatch` from its result as from the general path's. It raises nothing of its own: a batch it does
not recognise as plain, or one that fails any test, returns None, and `pack_batch` takes its general
path, which raises the error naming the field and the numbers (or, for a test tripped only by pad
slots, packs it). So the errors are one code's, and tests/packing/test_plain_host.py holds the two
paths equal on random and hostile batches.

Why so few layers: a DataLoader worker packs right after the dataset's own work, with cold caches, where
each Python function and each distinct numpy or torch operation first read costs microseconds (4 x 2048:
about 100 us of 400 went to the layers of the same work).

Shape legend: B = rows, S = row length, T = physical packed tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from megatron_vlm_packing.packing.checks import IGNORE_INDEX
from megatron_vlm_packing.packing.packed_value_checks import packed_value_faults
from megatron_vlm_packing.packing.host_tokens import PackedHostTokens, loss_weights_host
from megatron_vlm_packing.packing.lengths import right_padded_row_lengths
from megatron_vlm_packing.packing.pack import cat_row_next_tokens, segment_positions
from megatron_vlm_packing.packing.indices import PackIndices, host_ramp, plan_indices
from megatron_vlm_packing.packing.plan import PackMultiples, PackPlan, make_pack_plan
from megatron_vlm_packing.packing.positions import host_positions_differ

PLAIN_KEYS = frozenset({"input_ids", "tokens", "labels", "loss_mask", "attention_mask", "position_ids"})


class PlainPack(NamedTuple):
    """A plain batch packed and checked: its plan and indices, [1, T] ids, labels and float32 loss weights, and
    [1, T] positions restarting per document (`pack.segment_positions`)."""

    plan: PackPlan
    indices: PackIndices
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


def pack_plain_batch_on_host(batch, *, multiples: PackMultiples, pad_to: int | None, label_style: str,
                             pad_token_id: int, vocab_size: int | None) -> PlainPack | None:
    """What `pack_batch(batch, host_reads=True, ...)` packs for a plain batch that passes every check,
    else None (the general path then packs it or names its error).

    Plain: a dict holding only `input_ids` or `tokens`, `labels`, and optionally `loss_mask`,
    `attention_mask` ([B, S] bool or integer) and [B, S] `position_ids`; ids and labels int64; every
    tensor [B, S], on the CPU, without autograd, of a dtype numpy has. The caller has checked the
    options (`pad_token_id`, `pad_to`) and passes no mRoPE, media ids or extra keys.

    Args:
        multiples: the parallel layout's `PackMultiples`.
        pad_to, label_style, pad_token_id, vocab_size: as `pack_batch` takes them.
    """
    rows = _plain_rows(batch, label_style, vocab_size)
    if rows is None:
        return None
    input_ids, raw_labels, loss_values, mask, given_positions = rows
    batch_size, row_length = input_ids.shape
    if mask is None:
        lengths = [row_length] * batch_size
    else:
        lengths = right_padded_row_lengths(mask)
        if lengths is None:
            return None
    try:
        plan = make_pack_plan(lengths, row_capacity=row_length, multiples=multiples, pad_to=pad_to)
    except ValueError:
        return None
    indices = plan_indices(plan)
    if not indices.has_pad_slots:
        return _pack_row_prefixes(input_ids, raw_labels, loss_values, given_positions, indices, label_style,
                                  vocab_size)
    tokens = PackedHostTokens.of(input_ids, raw_labels, loss_values, label_style, indices, pad_token_id=pad_token_id)
    if any(packed_value_faults(label_style, vocab_size, **tokens.check_arguments())):
        return None
    if given_positions is not None and host_positions_differ(given_positions, indices):
        return None
    return PlainPack(plan, indices, *tokens.tensors(), segment_positions(indices))


def _pack_row_prefixes(input_ids: np.ndarray, labels: np.ndarray, loss_values: np.ndarray | None,
                       given_positions: np.ndarray | None, indices: PackIndices, label_style: str,
                       vocab_size: int | None) -> PlainPack | None:
    """`PackedHostTokens` + `packed_value_faults` + `host_positions_differ` + `tensors` for a plan without pad
    slots (every document its row's prefix), in one function: the same copies (`cat_row_prefixes`' and
    `cat_row_next_tokens`') and tests, without their layers, which cost a DataLoader worker more than the work
    itself at a few rows when its caches are cold (the dataset's work ran just before)."""
    plan = indices.plan
    documents = list(zip(plan.segment_rows, plan.real_lengths))
    ids = np.concatenate([input_ids[row, :n] for row, n in documents])
    first_labels = None
    if label_style == "hf":  # shifted inside each document; no target holds its first label, checked all the same
        targets = cat_row_next_tokens(labels, plan, IGNORE_INDEX)
        first_labels = labels[list(plan.segment_rows), 0]
    else:
        targets = np.concatenate([labels[row, :n] for row, n in documents])
    values = None if loss_values is None else np.concatenate([loss_values[row, :n] for row, n in documents])
    is_target = targets != IGNORE_INDEX
    if any(packed_value_faults(label_style, vocab_size, ids=ids, targets=targets, is_target=is_target,
                               first_labels=first_labels, loss_values=values, plan=plan)):
        return None
    # every slot real: the positions are each document's 0..n-1 (`segment_positions` views these offsets)
    offsets = indices.offset_in_segment_host if given_positions is None else \
        _checked_given_offsets(given_positions, documents, indices)
    if offsets is None:
        return None
    if np.count_nonzero(is_target) == is_target.size:  # no -100 target: the weights are the values
        is_target = None
    return PlainPack(plan, indices, torch.from_numpy(ids[None]), torch.from_numpy(targets[None]),
                     torch.from_numpy(loss_weights_host(values, is_target, length=ids.size)[None]),
                     torch.from_numpy(offsets[None]))  # what `segment_positions` views on the CPU


def _checked_given_offsets(given_positions: np.ndarray, documents: list, indices: PackIndices) -> np.ndarray | None:
    """[T] int64 `indices.offset_in_segment_host` when the given positions of every document's real tokens are
    its 0..n-1 (a plan without pad slots), else None.

    Documents of `_COMPARED_PER_DOCUMENT_FROM` tokens or more on average: each document's packed positions are
    compared with the shared ramp (`host_ramp`, in cache) while they are in cache, and once they have passed,
    they are the offsets the indices would build (cached as theirs): no [T] array of offsets is written and
    read again (at 64 x 32768, 0.5 ms of 6.7). Shorter ones: the offsets and one comparison, one numpy call
    for all where per-document calls cost more than the pass they save."""
    positions = np.concatenate([given_positions[row, :n] for row, n in documents])
    plan = indices.plan
    if plan.num_real_tokens < _COMPARED_PER_DOCUMENT_FROM * len(documents):
        offsets = indices.offset_in_segment_host
        return None if np.count_nonzero(positions != offsets) else offsets
    ramp = host_ramp(plan.max_seqlen)
    differs = np.empty(plan.max_seqlen, dtype=np.bool_)
    start = 0
    for n in plan.real_lengths:
        if np.count_nonzero(np.not_equal(positions[start:start + n], ramp[:n], out=differs[:n])):
            return None
        start += n
    # integers equal to 0..n-1 whatever their dtype: int64 exactly (no copy when they are int64)
    offsets = indices.__dict__["offset_in_segment_host"] = positions.astype(np.int64, copy=False)
    return offsets


# Mean real tokens per document. Per-document calls pay where the pass they save reads memory: with cold caches
# (a DataLoader worker's) from about 1200 tokens (equal at 16 x 4096; 121 us against 140 at 8 x 8192, 2600 tokens),
# with the batch in cache from about 6000 (equal at 4 x 16384; 108 us against 85 at 32 x 8192); one core.
_COMPARED_PER_DOCUMENT_FROM = 2048


def _plain_rows(batch, label_style: str, vocab_size):
    """numpy views (ids, labels, loss values or None, mask or None, [B, S] positions or None) of a plain
    batch, else None.

    Each tensor is read with `Tensor.numpy`, whose own C checks refuse what numpy cannot view (another
    device, autograd, a sparse or nested layout, a dtype numpy lacks) with a RuntimeError or TypeError: one
    call per tensor, where reading each property is one (a nested tensor's shape even raises)."""
    if type(batch) is not dict or not PLAIN_KEYS.issuperset(batch.keys()) or label_style not in ("megatron", "hf"):
        return None
    if vocab_size is not None and (type(vocab_size) is not int or vocab_size < 1):
        return None
    ids, tokens = batch.get("input_ids"), batch.get("tokens")
    if (ids is None) == (tokens is None):
        return None
    tensors = (ids if ids is not None else tokens, batch.get("labels"), batch.get("loss_mask"),
               batch.get("attention_mask"), batch.get("position_ids"))
    try:
        rows = [value if value is None else value.numpy() if isinstance(value, torch.Tensor) else _NOT_A_TENSOR
                for value in tensors]
    except (RuntimeError, TypeError):
        return None
    ids = rows[0]
    if ids is None or ids is _NOT_A_TENSOR or ids.ndim != 2 or ids.dtype.num not in _LABEL_DTYPES or not ids.size \
            or rows[1] is None:
        return None
    for value, dtypes in zip(rows[1:], (_LABEL_DTYPES, _VALUE_DTYPES, _MASK_DTYPES, _VALUE_DTYPES)):
        if value is not None and (value is _NOT_A_TENSOR or value.shape != ids.shape
                                  or value.dtype.num not in dtypes):
            return None
    return rows


_NOT_A_TENSOR = object()  # a value that is no tensor (the general path names it)


# The dtypes (numpy's type numbers: an int's hash, where a dtype's costs numpy's descriptor code) the general path's
# host reads take from numpy (`pack.on_host_without_grad`: no uint16 to uint64, which it reads as int64, no complex),
# the integer masks it reads on the host (`lengths.right_padded_lengths_on_host`), and int64 ids and labels.
_MASK_DTYPES = frozenset(np.dtype(t).num for t in (np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64))
_VALUE_DTYPES = _MASK_DTYPES | frozenset(np.dtype(t).num for t in (np.float16, np.float32, np.float64))
_LABEL_DTYPES = frozenset({np.dtype(np.int64).num})
