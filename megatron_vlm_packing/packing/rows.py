"""A collated batch read and checked once, as right-padded rows: what `pack_batch` and `pad_batch` share.

`read_rows` turns a batch dict into a `Rows` value: ids, real-token mask, next-token labels, float
loss weights, positions (mRoPE per row alone, or None for 1D positions restarting per document),
typed vision/audio inputs with per-row counts and declared per-token extras. Every key of the
batch is accounted for: an unknown key is a ValueError naming it, never sorted into a side dict.
The checks of single fields and options (keys, dense tensors, [B, S] shapes, dtypes) live in
`row_fields`; their public names are importable from here too.

Shape legend: B = rows, S = row length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch

from megatron_vlm_packing.packing.bounds import INT64_MAX  # noqa: F401 (also batch's, through rows)
from megatron_vlm_packing.packing.checks import (  # noqa: F401 (re-exported: callers import them from rows)
    IGNORE_INDEX, DeferredChecks, ValueInputs, _first_bad, check_ids, check_label_values, check_loss_weights,
    check_row_values, is_integer_tensor, queue_value_checks, token_place,
)
from megatron_vlm_packing.packing.documents import DOCUMENT_KEY, split_documents
from megatron_vlm_packing.packing.lengths import (  # noqa: F401 (widened_unsigned re-exported)
    DeferredKeep, keep_mask_deferred, real_lengths, widened_unsigned,
)
from megatron_vlm_packing.packing.media import VISION_KEYS, vision_inputs  # noqa: F401 (VISION_KEYS re-exported)
from megatron_vlm_packing.packing.media_audio import (  # noqa: F401 (AUDIO_KEYS re-exported)
    AUDIO_KEYS, audio_inputs, check_audio_seqlens, queue_audio_reads,
)
from megatron_vlm_packing.packing.media_counts import MediaHost, queue_media_reads, row_label
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.micro_batch import AudioInputs, VisionInputs
from megatron_vlm_packing.packing.mrope_channels import queue_flat_rows, refuse_flat_rows
from megatron_vlm_packing.packing.positions import (  # noqa: F401 (re-exported: callers import them from rows)
    batch_positions, check_1d_positions, check_position_layout, normalize_positions, queue_position_checks,
    queue_rope_positions, refuse_unread_rope_inputs, rope_positions,
)
from megatron_vlm_packing.packing.pack import on_host_without_grad
from megatron_vlm_packing.packing.row_fields import (  # noqa: F401 (re-exported: callers import them from rows)
    ROPE_ONLY_KEYS, SEQUENCE_KEYS, check_dense_tensors, check_flags, check_keys, check_label_style,
    check_mrope, check_pack_arguments, check_pad_token_id, check_vocab_size, checked_extra_keys, checked_labels,
    checked_loss_values, input_ids_of, is_undense, per_token_extras, refuse_undense, row_tensor,
)


@dataclass(frozen=True)
class Rows:
    """One checked, right-padded batch.

    Attributes:
        input_ids: [B, S] long.
        mask: the checked mask; `keep` ([B, S] bool, True at real tokens) is built from it on first use.
        lengths: B real lengths (host ints).
        raw_labels: [B, S] long labels as given (checked on real tokens; "hf": unshifted).
        label_style: "megatron" (raw_labels are next-token targets) or "hf".
        loss_values: [B, S] per-token loss weights as given (checked finite and >= 0 on real
            tokens), or None (weight 1 on every target).
        positions: [3, B, S] mRoPE positions of each row alone, or None (1D, restarting per document).
        vision, audio: typed media inputs with per-row counts, or None.
        extras: declared per-token tensors, [B, S, ...].
        row_tokens: slots of the collated rows (B*S of the batch as given).
        document_rows: with `document_lengths`, the source row of each row here (one per document).
        unchecked_values: None when the value checks of ids, labels and loss weights were made (on the
            device path, as screens riding the one read); else what they read (`checks.ValueInputs`),
            left to the caller: `pack_batch(host_reads=True)` checks them over the packed tokens.
        unchecked_positions: [B, S] 1D `position_ids` read on the host and not yet checked (they must
            count 0..n-1 on each row's real tokens; `positions.check_1d_positions_on_host`), else None.

    `labels` and `loss_weights` build the [B, S] targets and weights of the rows (`pad_batch`);
    `pack_batch` builds them over the packed tokens only (`batch.pack_labels_and_weights`).
    """

    input_ids: torch.Tensor
    mask: DeferredKeep
    lengths: list[int]
    raw_labels: torch.Tensor
    label_style: str
    loss_values: torch.Tensor | None
    positions: torch.Tensor | None
    vision: VisionInputs | None
    audio: AudioInputs | None
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    row_tokens: int = 0
    document_rows: list[int] | None = None
    unchecked_values: ValueInputs | None = None
    unchecked_positions: torch.Tensor | None = None

    @property
    def keep(self) -> torch.Tensor:
        return self.mask.keep

    @property
    def labels(self) -> torch.Tensor:
        """[B, S] long next-token targets (HF labels shifted inside each row), -100 where there is none."""
        if self.label_style == "hf":
            return shift_labels_within_rows(self.raw_labels, self.keep)
        return torch.where(self.keep, self.raw_labels, IGNORE_INDEX)

    @property
    def loss_weights(self) -> torch.Tensor:
        """[B, S] float loss weight of each target (0 where there is none)."""
        return loss_weights_of(self.labels, self.loss_values)


def loss_weights_of(labels: torch.Tensor, loss_values: torch.Tensor | None) -> torch.Tensor:
    """Float weight of each target: 1 (or its `loss_mask` value) where a label is set, else 0. Any shape.

    (value * True / value * False computes value * 1.0 / value * 0.0 in float32: the same bits as
    multiplying by the float target mask, one op fewer.)"""
    if on_host_without_grad(labels) and (loss_values is None or on_host_without_grad(loss_values)):
        is_target = labels.numpy() != IGNORE_INDEX  # numpy: two small ops at a fraction of torch's fixed cost
        if loss_values is None:
            return torch.from_numpy(is_target.astype(np.float32))
        return torch.from_numpy(np.multiply(loss_values.numpy(), is_target, dtype=np.float32))
    is_target = labels != IGNORE_INDEX
    if loss_values is None:
        return is_target.float()
    return (loss_values if loss_values.dtype == torch.float32 else loss_values.float()).mul(is_target)


def shift_labels_within_rows(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels (unshifted) to next-token targets, shifted inside each row.

    Args:
        labels: [B, S] long, HF convention (target of position s is labels[s+1]; -100 = ignore).
        keep: [B, S] bool, True at real tokens (right-padded).

    Returns:
        [B, S] long: out[b, s] = labels[b, s+1] while s+1 is a real token of row b, else -100;
        so the last token of a sample never learns the first token of the next (bug class 8).
    """
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    next_is_real = torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    return torch.where(next_is_real, shifted, IGNORE_INDEX)


@dataclass(frozen=True)
class QueuedRows:
    """A batch's rows with their mask, label, loss-weight and value checks queued on `checks`, not read yet.

    Callers queue their own values on the same `checks` (positions, media, LLaVA's per-row facts),
    then make the one `checks.read()` and get the real lengths from it with `lengths(host)`.
    """

    mask: DeferredKeep
    raw_labels: torch.Tensor
    loss_values: torch.Tensor | None
    checks: DeferredChecks
    lengths_entry: int | None
    batch_size: int
    unchecked_values: ValueInputs | None = None

    def lengths(self, host: list) -> list[int]:
        """The B real lengths, from the read's `host` values (or known without a read: no mask given)."""
        if self.lengths_entry is None:
            return list(self.mask.lengths)
        return host[self.lengths_entry][:self.batch_size]


def queue_row_reads(batch: Mapping, input_ids: torch.Tensor, name: str, label_style: str,
                    vocab_size: int | None, *, on_host: bool = False,
                    where: Callable[[int, int], str] = token_place) -> QueuedRows:
    """Queue the reads every right-padded batch needs: the deferred mask (real lengths and its detailed
    error), labels and loss weights checked for type and shape, and the value screens of ids, labels
    and loss weights (`checks.queue_value_checks`). `input_ids` [B, S] long, named `name` in errors.

    `on_host=True` (a batch on the CPU, `pack_batch(host_reads=True)`): the lengths are read at once
    and no value screen is queued: the caller checks the packed values (`packed_value_checks.check_packed_values`)
    with `QueuedRows.unchecked_values`."""
    shape = tuple(input_ids.shape)
    mask = batch.get("attention_mask")
    deferred = keep_mask_deferred(batch_size=shape[0], row_length=shape[1], attention_mask=mask,
                                  seq_lens=batch.get("seq_lens"), device=input_ids.device, on_host=on_host)
    raw_labels, loss_values = checked_labels(batch, shape, label_style), checked_loss_values(batch, shape)
    checks, lengths_entry = DeferredChecks(), None
    if deferred.values is not None:  # the detailed mask error (holes, left padding, values, non-causal 4D)
        lengths_entry = checks.add(deferred.values, deferred.fails,
                                   lambda: real_lengths(batch_size=shape[0], row_length=shape[1], attention_mask=mask))
    inputs = ValueInputs(input_ids, name, raw_labels, loss_values, lambda: deferred.keep, deferred.real_slots, where)
    if not on_host:
        queue_value_checks(inputs, label_style, vocab_size, checks)
    return QueuedRows(mask=deferred, raw_labels=raw_labels, loss_values=loss_values, checks=checks,
                      lengths_entry=lengths_entry, batch_size=shape[0], unchecked_values=inputs if on_host else None)


def raise_value_errors_first(unchecked_values: ValueInputs | None, label_style: str, vocab_size: int | None,
                             unchecked_positions: torch.Tensor | None) -> None:
    """Called while a ValueError is being handled: rows read on the host (`unchecked_values` set) raise the
    error of a bad id, label, loss weight or [B, S] position_ids first, if they hold one.

    The device path reads those values first (their checks are queued before those of positions read
    with them, media and mRoPE blocks, and made before the plan), while the host checks them last, over
    the packed tokens; without this a batch with two faults would name a different one on each path.
    Error path only (callers wrap the host reads in a try, free in Python 3.11+): the rows are checked
    exactly (`checks.check_row_values`, `check_1d_positions`)."""
    if unchecked_values is not None:
        check_row_values(unchecked_values, label_style, vocab_size)
        if unchecked_positions is not None:
            check_1d_positions(unchecked_positions, unchecked_values.keep(), unchecked_values.where)


def read_rows(batch, *, label_style: str, mrope, media: MediaTokens, extra_keys=(), vocab_size: int | None = None,
              position_layout: str | None = None, on_host: bool = False) -> Rows:
    """Check a collated batch and read it into `Rows` (see the module docstring).

    `on_host=True` (a batch on the CPU, where a read costs no sync) reads the lengths at once and
    leaves the value checks of ids, labels and loss weights (`Rows.unchecked_values` holds what they
    read) and of [B, S] position_ids (`Rows.unchecked_positions`) to the caller:
    `pack_batch(host_reads=True)` makes them over the packed tokens (`packed_value_checks.check_packed_values`,
    `positions.check_1d_positions_on_host`).

    With `document_lengths` in the batch every document becomes a row of its own first
    (`documents.split_documents`); `Rows.document_rows` then names each one's source row.
    """
    extra_keys = _check_batch(batch, extra_keys, position_layout, mrope, vocab_size)
    name, input_ids = input_ids_of(batch)
    source_shape = tuple(input_ids.shape)
    for key in ("labels", "loss_mask"):
        row_tensor(batch, key, source_shape)
    per_token_extras(batch, extra_keys, source_shape)
    batch = normalize_positions(batch, source_shape, position_layout)
    batch, input_ids, documents = _rows_of_documents(batch, name, input_ids, extra_keys)
    document_rows, where, row_name = documents
    queued = queue_row_reads(batch, input_ids, name, label_style, vocab_size, on_host=on_host, where=where)
    deferred, checks = queued.mask, queued.checks
    unchecked_positions = _queue_positions(batch, deferred, mrope, checks, where, on_host)
    media_entries = queue_media_reads(batch, input_ids, lambda: deferred.keep, media, checks, row_name,
                                      count_grids=callable(mrope))
    media_entries |= queue_audio_reads(batch, input_ids, lambda: deferred.keep, media, checks,
                                       counted="audio" in media_entries)
    rope = queue_rope_positions(batch, input_ids, lambda: deferred.keep, mrope, checks, where)
    given = batch.get("position_ids")  # [3, B, S] given with media: 1D positions copied into 3 channels?
    flat_entry = queue_flat_rows(given, deferred.keep, checks) \
        if mrope is None and given is not None and given.dim() == 3 and _has_grids(batch) else None
    try:
        host = checks.read()  # the one host sync
        lengths = queued.lengths(host)
        media_host = MediaHost({name: host[entry] for name, entry in media_entries.items()}, row_name)
        vision = vision_inputs(batch, media_host, media, grids_for_rope=mrope is not None, count_grids=callable(mrope))
        audio = audio_inputs(batch, media_host, media)
        check_audio_seqlens(batch, media_host, media, audio)
        positions = batch_positions(batch, input_ids, deferred, mrope, audio, rope, host, where, media=media)
        if flat_entry is not None:
            refuse_flat_rows(host[flat_entry], vision, media_host.values, media.spatial_merge_size, row_name)
    except ValueError:
        raise_value_errors_first(queued.unchecked_values, label_style, vocab_size, unchecked_positions)
        raise
    return Rows(input_ids=input_ids, mask=deferred, lengths=lengths, raw_labels=queued.raw_labels,
                label_style=label_style, loss_values=queued.loss_values, positions=positions,
                vision=vision, audio=audio, extras=per_token_extras(batch, extra_keys, tuple(input_ids.shape)),
                row_tokens=source_shape[0] * source_shape[1], document_rows=document_rows,
                unchecked_values=queued.unchecked_values, unchecked_positions=unchecked_positions)


def _has_grids(batch: Mapping) -> bool:
    """The batch carries image or video grid rows (only they can hold a block of several merged tokens)."""
    return any(isinstance(batch.get(k), torch.Tensor) and batch[k].dim() == 2 and batch[k].shape[0] > 0
               for k in ("image_grid_thw", "video_grid_thw"))


def _check_batch(batch, extra_keys, position_layout: str | None, mrope, vocab_size) -> tuple:
    """`read_rows`' checks of the batch as a whole and of its options, in this order: dense tensors (first, as
    `pack_batch(host_reads=True)` checks them), `extra_keys` (returned as a tuple), `position_layout`, every
    key understood, `vocab_size`."""
    check_dense_tensors(batch)
    extra_keys = checked_extra_keys(extra_keys)
    check_position_layout(position_layout)
    check_keys(batch, extra_keys=extra_keys, mrope=mrope)
    check_vocab_size(vocab_size)
    return extra_keys


def _rows_of_documents(batch: Mapping, name: str, input_ids: torch.Tensor, extra_keys: tuple):
    """(batch, [B', S] long ids, (document rows, where, row name)): with `document_lengths` every document a
    row of its own (`documents.split_documents`), else the batch and ids as given, no document rows and the
    plain token and row names of errors."""
    if batch.get(DOCUMENT_KEY) is None:
        return batch, input_ids, (None, token_place, row_label)
    batch, places = split_documents(batch, name, extra_keys)
    return batch, batch[name].long(), (list(places.rows), places.where, places.row_name)


def _queue_positions(batch: Mapping, deferred: DeferredKeep, mrope, checks: DeferredChecks,
                     where: Callable[[int, int], str], on_host: bool) -> torch.Tensor | None:
    """[B, S] `position_ids` left unchecked for the caller (`on_host`, CPU, no autograd: checked over the real
    tokens with numpy, after the value checks), else None with the positions' checks queued on `checks`."""
    given_positions = batch.get("position_ids")
    if on_host and isinstance(given_positions, torch.Tensor) and given_positions.dim() == 2 \
            and on_host_without_grad(given_positions):
        return given_positions
    queue_position_checks(batch, lambda: deferred.keep, mrope, checks, where)
    return None
