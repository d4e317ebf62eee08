"""Value checks of a batch on the host, made exactly over its packed tokens (numpy, no device read).

`pack_batch(host_reads=True)` (a DataLoader worker: reading a value back costs no sync) reads the real
lengths first and checks ids, labels and loss weights after packing, over the T packed slots rather than
`checks.queue_value_checks`' screens over all B*S slots. These are those tests (`packed_value_faults`: one
unsigned comparison per range test) and `check_packed_values`, which runs `checks`' row checks, the same
ones as the device path, to raise the ValueError naming row, position and value when a test fails. Split
from `packing/checks.py`, which keeps the device path and the row checks both paths share.

Shape legend: T = packed slots, N = documents.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_vlm_packing.packing.checks import (
    FLOAT32_MAX, IGNORE_INDEX, ValueInputs, check_ids, check_label_values, check_loss_weights,
)
from megatron_vlm_packing.packing.label_style import packed_style_mismatch, refuse_mismatched_style


def check_packed_values(inputs: ValueInputs, label_style: str, vocab_size: int | None, *, ids: np.ndarray,
                        targets: np.ndarray, is_target: np.ndarray, first_labels: np.ndarray | None,
                        loss_values: np.ndarray | None, plan) -> None:
    """`queue_value_checks`' checks for a batch on the host, made exactly over the packed tokens.

    On the host (a DataLoader worker) reading a value back costs no sync, so the real lengths are
    read first and these checks run after packing, over the T packed slots, where pad slots hold
    `pad_token_id`, -100 and 0, not over all B*S slots (often three times as many). A failed test
    runs the same row check as the device path (`check_ids`, ...), which raises the ValueError
    naming row, position and value; only a `pad_token_id` >= `vocab_size` in packed pad slots can
    trip a test without a bad real token, and the row check then returns.

    Args:
        inputs: the rows the checks name in their errors (`ValueInputs`).
        ids: [T] packed ids. targets: [T] packed labels: the Megatron labels as given, or the
            Hugging Face labels shifted inside each document. is_target: [T] bool, targets != -100.
        first_labels: Hugging Face only: [N] the label of every document's first token, which no
            shifted target holds (checked for its value all the same).
        loss_values: [T] the packed `loss_mask` as given (0 at pad slots), or None.
        plan: the `PackPlan` the tokens were packed by.
    """
    bad_ids, bad_labels, other_style, bad_weights = packed_value_faults(
        label_style, vocab_size, ids=ids, targets=targets, is_target=is_target, first_labels=first_labels,
        loss_values=loss_values, plan=plan)
    keep = inputs.keep
    if bad_ids:
        check_ids(inputs.input_ids, keep(), vocab_size, inputs.name, inputs.where)
    if bad_labels:
        check_label_values(inputs.raw_labels, keep(), vocab_size, inputs.where)
    if other_style:
        refuse_mismatched_style(inputs.raw_labels, inputs.input_ids, keep(), label_style, inputs.where)
    if bad_weights:
        check_loss_weights(inputs.loss_values, keep(), inputs.where)


def packed_value_faults(label_style: str, vocab_size: int | None, *, ids: np.ndarray, targets: np.ndarray,
                        is_target: np.ndarray, first_labels: np.ndarray | None, loss_values: np.ndarray | None,
                        plan) -> tuple[bool, bool, bool, bool]:
    """`check_packed_values`' tests alone (same arguments), nothing raised: (an id out of range, a label
    out of range, labels of the other style (`label_style.packed_style_mismatch`), a loss weight negative /
    not finite). All False on a clean batch; a True may come from pad slots only (an id test tripped by
    `pad_token_id`), which the row checks then clear."""
    ignored = targets.size - int(np.count_nonzero(is_target))
    signed = _UNSIGNED_HALF.get(ids.dtype.num)
    if signed is not None and targets.dtype.num == ids.dtype.num:  # the two tests inline: a worker's common case
        unsigned, half = signed
        bound = unsigned(half if vocab_size is None else min(vocab_size, half))
        bad_ids = bool(np.maximum.reduce(ids.view(unsigned)) >= bound)
        # (no vocab_size: the signed test, numpy's unsigned comparison is the slower loop)
        bad_labels = np.count_nonzero((targets < 0) if vocab_size is None else (targets.view(unsigned) >= bound)) \
            != ignored
    else:
        bad_ids = _ids_out_of_range(ids, vocab_size)
        bad_labels = _labels_out_of_range(targets, ignored, vocab_size)
    bad_labels = bad_labels or bool(
        first_labels is not None and first_labels.size
        and _labels_out_of_range(first_labels, int(np.count_nonzero(first_labels == IGNORE_INDEX)), vocab_size))
    other_style = packed_style_mismatch(label_style, ids=ids, targets=targets, is_target=is_target,
                                        first_labels=first_labels, plan=plan)
    bad_weights = False
    if loss_values is not None and loss_values.dtype.kind != "b":
        # NaN propagates (min / max do not warn); the ufuncs' reductions themselves, not ndarray.min's Python layer
        low, high = float(np.minimum.reduce(loss_values)), float(np.maximum.reduce(loss_values))
        bad_weights = not (low >= 0 and high <= FLOAT32_MAX)  # NaN fails both
    return bad_ids, bad_labels, other_style, bad_weights


def _ids_out_of_range(ids: np.ndarray, vocab_size: int | None) -> bool:
    """An id below 0, or one at or above `vocab_size` (non-empty `ids`). Signed ints: one unsigned test
    (`_UNSIGNED_HALF`), a maximum."""
    signed = _UNSIGNED_HALF.get(ids.dtype.num)
    if signed is not None:
        unsigned, half = signed
        bound = unsigned(half if vocab_size is None else min(vocab_size, half))
        return bool(np.maximum.reduce(ids.view(unsigned)) >= bound)
    return bool(ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size))


def _labels_out_of_range(labels: np.ndarray, ignored: int, vocab_size: int | None) -> bool:
    """A label below 0 other than the `ignored` -100s, or one at or above `vocab_size` (non-empty `labels`).
    Signed ints: one unsigned test (`_UNSIGNED_HALF`), a count: every -100 is out, no other value may be."""
    signed = _UNSIGNED_HALF.get(labels.dtype.num)
    if signed is not None and vocab_size is not None:  # (no vocab_size: the signed test below is one pass too)
        unsigned, half = signed
        bound = unsigned(half if vocab_size is None else min(vocab_size, half))
        return np.count_nonzero(labels.view(unsigned) >= bound) != ignored
    return np.count_nonzero(labels < 0) != ignored or (vocab_size is not None and labels.max() >= vocab_size)


# Signed integers of width w: a value lies outside [0, vocab_size) exactly when its unsigned view is >= b =
# min(vocab_size, 2**(w-1)), one test where two made the lower and upper bounds: a negative value reads as
# >= 2**(w-1), the top of the non-negative values (no vocab_size: nothing above them is out).
# Signed integer dtype's type number (an int key: no descriptor hashed) -> (the unsigned type of its width, 2**(w-1)).
_UNSIGNED_HALF = {np.dtype(signed).num: (unsigned, 1 << (8 * np.dtype(signed).itemsize - 1))
                  for signed, unsigned in ((np.int8, np.uint8), (np.int16, np.uint16), (np.int32, np.uint32),
                                           (np.int64, np.uint64))}


def host_array(values: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor for `check_packed_values` (detached; bfloat16, which numpy lacks,
    widened to float32)."""
    if values.dtype == torch.bfloat16:
        values = values.float()
    return (values.detach() if values.requires_grad else values).numpy()
