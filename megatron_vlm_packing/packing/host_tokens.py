"""Token ids, labels and loss weights of rows read on the host, packed and checked in numpy.

`pack_batch(host_reads=True)` (a DataLoader worker) packs on the CPU, where every op is small and
torch's fixed cost per call (several microseconds, and as much again each time a tensor crosses to
numpy and back) is most of the time for a micro-batch of a few rows. Here each [B, S] input crosses
to numpy once, the three fields are packed, checked (`packed_value_checks.check_packed_values`) and weighted in
numpy, and each [1, T] result crosses back once. Same values as `pack_rows` +
`batch.pack_labels_and_weights` (tests/packing/test_host_reads.py compares the two paths).

Shape legend: B = rows, S = row length, T = physical packed tokens, N = documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_vlm_packing.packing.checks import IGNORE_INDEX
from megatron_vlm_packing.packing.packed_value_checks import check_packed_values
from megatron_vlm_packing.packing.pack import (
    cat_documents_host, cat_row_next_tokens, cat_row_prefixes, on_host_without_grad,
)
from megatron_vlm_packing.packing.indices import PackIndices
from megatron_vlm_packing.packing.plan import PackPlan


def packs_on_host(rows) -> bool:
    """Rows read on the host (`Rows.unchecked_values` set) whose ids, labels and loss values numpy can
    view: no autograd, a dtype numpy has (a bfloat16 or grad-carrying loss_mask packs with torch)."""
    return rows.unchecked_values is not None and on_host_without_grad(rows.input_ids) \
        and on_host_without_grad(rows.raw_labels) \
        and (rows.loss_values is None or on_host_without_grad(rows.loss_values))


def pack_tokens_on_host(rows, indices: PackIndices, *, pad_token_id: int,
                        vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[1, T] packed ids, next-token labels and float32 loss weights of `rows` (`packs_on_host`),
    checked over the packed tokens.

    Args:
        rows: `rows.Rows` read with `on_host=True`: their value checks are made here.
        indices: of the plan made for these rows.
        pad_token_id: the id at pad slots (labels hold -100 there, loss weights 0).
        vocab_size: ids and labels must lie below it when given.

    Raises:
        ValueError: the device path's error for the first bad id, label or loss weight.
    """
    loss_values = None if rows.loss_values is None else rows.loss_values.numpy()
    tokens = PackedHostTokens.of(rows.input_ids.numpy(), rows.raw_labels.numpy(), loss_values, rows.label_style,
                                 indices, pad_token_id=pad_token_id)
    check_packed_values(rows.unchecked_values, rows.label_style, vocab_size, **tokens.check_arguments())
    return tokens.tensors()


@dataclass(frozen=True)
class PackedHostTokens:
    """Ids, next-token labels and loss values of [B, S] CPU rows packed in numpy, not yet checked.

    Attributes:
        ids, labels: [T] packed ids (`pad_token_id` at pad slots) and next-token labels (-100 there).
        loss_values: [T] the packed `loss_mask` as given (0 at pad slots), or None.
        is_target: [T] bool, labels != -100.
        first_labels: Hugging Face labels only: [N] the label of every document's first token.
        plan: the `PackPlan` they were packed by.
    """

    ids: np.ndarray
    labels: np.ndarray
    loss_values: np.ndarray | None
    is_target: np.ndarray
    first_labels: np.ndarray | None
    plan: PackPlan

    @classmethod
    def of(cls, input_ids: np.ndarray, raw_labels: np.ndarray, loss_values: np.ndarray | None,
           label_style: str, indices: PackIndices, *, pad_token_id: int) -> "PackedHostTokens":
        """Pack [B, S] `input_ids`, labels as given (Megatron targets, or HF labels shifted inside each
        document) and `loss_values` (or None): numpy views of the rows' tensors (`packs_on_host`)."""
        plan = indices.plan
        hf = label_style == "hf"
        flat_length = len(plan.row_lengths) * plan.row_capacity
        raw = raw_labels.reshape(flat_length)
        # Hugging Face: no shifted target holds a document's first label, checked all the same.
        first_labels = raw[[row * plan.row_capacity for row in plan.segment_rows]] if hf else None
        if not indices.has_pad_slots:  # each document's real tokens as they are: row prefixes (labels shifted)
            ids = cat_row_prefixes(input_ids, plan)
            labels = cat_row_next_tokens(raw, plan, IGNORE_INDEX) if hf else cat_row_prefixes(raw, plan)
            values = None if loss_values is None else cat_row_prefixes(loss_values, plan)
            return cls(ids, labels, values, labels != IGNORE_INDEX, first_labels, plan)
        ids = cat_documents_host(input_ids.reshape(flat_length), indices.row_slices, pad_token_id)
        labels = cat_documents_host(raw, indices.next_token_slices if hf else indices.row_slices, IGNORE_INDEX)
        values = None if loss_values is None else \
            cat_documents_host(loss_values.reshape(flat_length), indices.row_slices, 0)
        return cls(ids, labels, values, labels != IGNORE_INDEX, first_labels, plan)

    def check_arguments(self) -> dict:
        """The keywords of `packed_value_checks.check_packed_values` / `packed_value_checks.packed_value_faults`
        for these tokens."""
        return dict(ids=self.ids, targets=self.labels, is_target=self.is_target, first_labels=self.first_labels,
                    loss_values=self.loss_values, plan=self.plan)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[1, T] ids, labels and float32 loss weights (the loss value at each target, else 0).

        Writes the weights over a float32 `loss_values` (no second [T] array): call it after the checks
        (`check_arguments`), which must see the values as given."""
        weights = loss_weights_host(self.loss_values, self.is_target)
        return torch.from_numpy(self.ids[None]), torch.from_numpy(self.labels[None]), torch.from_numpy(weights[None])


def loss_weights_host(values: np.ndarray | None, is_target: np.ndarray | None, *, length: int = 0) -> np.ndarray:
    """[T] float32 loss weights: the packed loss value at each target, else 0 (`is_target` as float32 without
    values). Writes over float32 `values` (a fresh packed copy, checked before: no second [T] array).

    `is_target` None: every one of the `length` slots is a target (no -100), and the weights are the values
    as float32 (ones without values), the bits of value * True, with no pass over [T] bools (at 64 x 32768,
    0.25 ms of 6)."""
    # value * True / value * False in float32: the same bits as the device path's weights.
    if is_target is None:
        return np.ones(length, dtype=np.float32) if values is None else values.astype(np.float32, copy=False)
    if values is None:
        return is_target.astype(np.float32)
    return np.multiply(values, is_target, out=values if values.dtype.char == "f" else None, dtype=np.float32)
