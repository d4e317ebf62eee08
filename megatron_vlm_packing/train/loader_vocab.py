"""The model's vocabulary checked in a DataLoader micro-batch packed without it (`check_loader_vocab`).

A `PackingCollator` runs in the DataLoader's workers, where no model is: its micro-batches may carry ids,
labels and pad ids bound by no vocabulary, or a larger one than the model's. They are checked where they
arrive, in host memory before the move to the model's device (numpy: no device sync), and marked checked
for the vocabulary (`MicroBatch.checked_vocab_size`, `checked_ids`) so that no later stage reads them again.

Shape legend: T = packed slots, B = rows, S = row length.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from megatron_vlm_packing.packing.micro_batch import IdsMark, MicroBatch


def check_loader_vocab(micro_batch: MicroBatch, vocab_size: int | None, *,
                       unembedded_token_id: int | None = None) -> MicroBatch:
    """A micro-batch from the data iterator whose ids and labels its packer bound below no vocabulary, or a
    larger one than the model's (`MicroBatch.vocab_checked`: a `PackingCollator` has no model), checked
    against `vocab_size` where it arrives, in host memory: no device sync. A label >= the vocabulary reached
    Megatron's vocab-parallel cross entropy, which masks it (its loss silently the log-sum-exp of the
    logits); a real id >= it became a zero embedding at TP > 1 (every rank masks it).

    Returns the micro-batch marked checked for `vocab_size`, or as given when there is nothing to check, or
    when its tensors are on a device already (`check_unpacked_labels` and the adapter's id check read them
    there, one sync). `unembedded_token_id` (the adapter's: LLaVA's image token) is never embedded, so it is no
    bad id whatever its value (`pack_llava_batch` does not screen it either).

    Raises:
        ValueError: naming the first real id or label >= `vocab_size` (row, position in the micro-batch), its
            value, and that the collator can check it with `pack_options=dict(vocab_size=...)`.
    """
    ids, labels, pads = micro_batch.input_ids, micro_batch.labels, micro_batch.padding_mask
    tensors = (ids, labels, pads)
    if micro_batch.vocab_checked(vocab_size) or not all(isinstance(t, torch.Tensor) and t.is_cpu for t in tensors) \
            or ids.shape != labels.shape or pads.shape != ids.shape or pads.dtype != torch.bool:
        return micro_batch  # a hand-built mask of another dtype: the checks after the move read it as it is
    # numpy: these are host memory on a GPU run too (the worker's pinned buffer), so no device waits on them
    real = ~pads.numpy()
    if unembedded_token_id is not None:
        real &= ids.numpy() != unembedded_token_id
    bad_ids, bad_labels = real & (ids.numpy() >= vocab_size), labels.numpy() >= vocab_size
    if bad_ids.any() or bad_labels.any():
        from megatron_vlm_packing.packing.checks import as_rows, check_ids, check_label_values

        hint = (f"; the data iterator's micro-batch was packed without the model's vocabulary: give "
                f"PackingCollator pack_options=dict(vocab_size={vocab_size}) (LlavaPackingCollator: "
                f"space=LlavaSpace.of(model); pack_batch / pad_batch: vocab_size={vocab_size}) to refuse it in the "
                f"DataLoader worker")
        try:
            check_ids(as_rows(ids), as_rows(torch.from_numpy(real)), vocab_size, "input_ids")
            check_label_values(as_rows(labels), torch.ones_like(as_rows(labels), dtype=torch.bool), vocab_size)
        except ValueError as error:
            raise ValueError(f"{error}{hint}") from None
    _refuse_pad_ids_outside(ids.numpy(), pads.numpy(), vocab_size)
    return replace(micro_batch, checked_vocab_size=vocab_size, checked_ids=_ids_mark_below(micro_batch, vocab_size))


def _refuse_pad_ids_outside(ids: np.ndarray, pads: np.ndarray, vocab_size: int) -> None:
    """A ValueError naming the first pad slot whose id lies outside [0, vocab_size): the model embeds pad slots
    too (an index error at TP=1, a device-side assert on a GPU). ids, pads: [1, T] or [B, S], host memory."""
    bad = pads & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        place = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"input_ids pad slot {place} holds {int(ids[place])} (the pad_token_id), no token id of the "
                         f"model (vocab_size={vocab_size}): every pad slot is embedded (an index error at TP=1, a "
                         f"device-side assert on a GPU); give the collator a pad_token_id in [0, {vocab_size}), and "
                         f"pack_options=dict(vocab_size={vocab_size}) to refuse it in the DataLoader worker")


def _ids_mark_below(micro_batch: MicroBatch, vocab_size: int) -> IdsMark | None:
    """The packer's `checked_ids` (LLaVA's, which may bound no vocabulary) now bounded by `vocab_size`, which
    `check_loader_vocab` just checked its real ids below (the same id excepted); else as it was."""
    mark = micro_batch.checked_ids
    if mark is None or mark.input_ids is not micro_batch.input_ids:
        return mark
    return mark._replace(vocab_size=vocab_size)
