"""Value checks of a collated batch, made on the device and read back with the real lengths in one host sync.

`DeferredChecks` collects device values with a host test each and reads them all in one `tolist`;
`queue_value_checks` queues the ids / labels / loss-weight screens (see its docstring); the `check_*`
functions recompute the details on the host and raise the ValueError naming field, row, position
and value when a check fails. The same checks made over the packed tokens on the host (a DataLoader
worker) live in `packing/packed_value_checks.py`, which raises through these row checks.

Shape legend: B = rows, S = row length.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_vlm_packing.packing.label_style import (
    refuse_mismatched_style, refused_by_counts, style_evidence_rows,
)
from megatron_vlm_packing.packing.lengths import any_true

IGNORE_INDEX = -100


def is_integer_tensor(x: torch.Tensor) -> bool:
    """True when `x` holds integers: neither floating point, complex nor bool. Reads no values."""
    return not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def as_rows(values: torch.Tensor) -> torch.Tensor:
    """A micro-batch's per-token field as the rows the row checks name: [B, L] as it is, [1, T] (a pack) or
    any other shape as one row [1, N]. A view; reads no values."""
    return values if values.dim() == 2 else values.reshape(1, -1)


def integer_token_rows(value, name: str) -> torch.Tensor:
    """`value` (ids or labels of a micro-batch no packer checked) as `as_rows`, after checking it is an integer
    tensor. Reads no values.

    Raises:
        ValueError: `name` must be an integer tensor of token ids, naming the dtype (or the type).
    """
    if not isinstance(value, torch.Tensor) or not is_integer_tensor(value):
        raise ValueError(f"{name} must be an integer tensor of token ids, got "
                         f"{value.dtype if isinstance(value, torch.Tensor) else type(value).__name__}")
    return as_rows(value)


def is_undense(value: torch.Tensor) -> bool:
    """A sparse, nested or meta tensor: no dense values numpy and most of torch's kernels can read."""
    return value.layout is not torch.strided or value.is_nested or value.is_meta


def check_dense(key: str, value, reader: str, fix: str | None = None) -> None:
    """`refuse_undense` when `value` is a tensor without dense values (`is_undense`); anything else passes."""
    if isinstance(value, torch.Tensor) and is_undense(value):
        refuse_undense(key, value, reader, fix)


def refuse_undense(key: str, value: torch.Tensor, reader: str = "pack_batch/pad_batch", fix: str | None = None) -> None:
    """The ValueError for `key`, a meta, nested or sparse tensor (`is_undense`; the caller checked), that
    `reader` (a plural subject: "pack_batch/pad_batch") cannot read: what it is and, unless meta, how to pass it
    dense. `fix` replaces that remedy (a callable's output, not a batch tensor)."""
    if value.is_meta:
        raise ValueError(f"{key} is a meta tensor: it holds no values for {reader} to read")
    if value.is_nested:
        fix = fix or "pad its rows (torch.nested.to_padded_tensor) and give an attention_mask"
        raise ValueError(f"{key} is a nested tensor (layout {value.layout}): {reader} read dense (strided) tensors; "
                         f"{fix}")
    fix = fix or f"pass {key}.to_dense()"
    raise ValueError(f"{key} has layout {value.layout}: {reader} read dense (strided) tensors; {fix}")


def token_place(row: int, position: int) -> str:
    """Where a bad token is, in the batch as given: its row and position."""
    return f"row {row} position {position}"


def _first_bad(bad: torch.Tensor) -> tuple[int, int]:
    """(row, position) of the first True of a [B, S] bool (error path only)."""
    b, t = torch.nonzero(bad)[0].tolist()
    return b, t


def check_label_values(labels: torch.Tensor, keep: torch.Tensor, vocab_size: int | None,
                       where: Callable[[int, int], str] = token_place) -> None:
    """Real tokens' labels are -100 or a token id in [0, vocab_size); ValueError naming row and position
    (`where(row, position)`: in the batch as given)."""
    bad = keep & (labels != IGNORE_INDEX) & (labels < 0)
    if vocab_size is not None:
        bad = bad | (keep & (labels >= vocab_size))
    if bool(bad.any()):
        b, t = _first_bad(bad)
        allowed = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"labels {where(b, t)} is {int(labels[b, t])}: a label must be -100 (ignored) or a "
                         f"token id {allowed}; {int(bad.sum())} such label(s)")


def check_loss_weights(values: torch.Tensor, keep: torch.Tensor,
                       where: Callable[[int, int], str] = token_place) -> None:
    """Loss weights of real tokens are finite and >= 0 as the float32 weights they become; ValueError
    naming row, position and the value as given (`values`: the loss_mask, any real dtype)."""
    weights = values.float()
    bad = keep & ~(torch.isfinite(weights) & (weights >= 0))
    if bool(bad.any()):
        b, t = _first_bad(bad)
        given, weight = float(values[b, t]), float(weights[b, t])
        # A float64 weight above float32's range is named as given, not as the inf it would become.
        shown = f"{given} (inf as float32)" if math.isfinite(given) and not math.isfinite(weight) else f"{weight}"
        raise ValueError(f"loss_mask {where(b, t)} is {shown}: loss weights must be finite and >= 0")


def check_ids(input_ids: torch.Tensor, keep: torch.Tensor, vocab_size: int | None, name: str,
              where: Callable[[int, int], str] = token_place) -> None:
    bad = keep & (input_ids < 0)
    if vocab_size is not None:
        bad = bad | (keep & (input_ids >= vocab_size))
    if bool(bad.any()):
        b, t = _first_bad(bad)
        raise ValueError(f"{name} {where(b, t)} is {int(input_ids[b, t])}: token ids must lie in "
                         f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})")


# The largest finite float32: a loss weight above it becomes inf as the float32 weight it is packed as.
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ValueInputs:
    """What the value checks read. input_ids, raw_labels: [B, S] long; loss_values: [B, S] or None.
    keep(): [B, S] bool keep-mask; real_slots(): [B, S] 1 at real tokens, 0 elsewhere (the 0/1 mask
    as given, or keep()). Each built on call only.
    where(row, position): how an error names a token of these rows in the batch as given (rows split
    from pre-packed documents name their source row, `documents.DocumentPlaces`)."""

    input_ids: torch.Tensor
    name: str
    raw_labels: torch.Tensor
    loss_values: torch.Tensor | None
    keep: Callable[[], torch.Tensor]
    real_slots: Callable[[], torch.Tensor]
    where: Callable[[int, int], str] = token_place


def queue_value_checks(inputs: ValueInputs, label_style: str, vocab_size: int | None, checks: "DeferredChecks") -> None:
    """Queue the value checks of ids, labels and loss weights on `checks` (read with the lengths).

    Screens: one pass over [B, S] or less each, looking at every slot, pads included, so that the
    packed path needs no keep-mask. A pad slot rarely holds a bad value; when one trips a screen,
    the exact check over the real tokens runs on the host and raises for a bad real token, else
    returns (only pad slots tripped it: extra host reads, never a wrong answer).
    - ids: the lowest and highest id.
    - labels: any label below 0 other than -100; with `vocab_size`, the highest label.
    - labels of the other style (`label_style.mismatched_style`, of the micro-batch or of any one row): an
      exact check, the 5 values of `label_style.style_evidence_rows` over every real pair of tokens.
    - loss weights: the lowest and highest value (finite and >= 0, and finite as float32).
    """
    ids, labels, keep = inputs.input_ids, inputs.raw_labels, inputs.keep
    checks.add(tuple(ids.aminmax()), lambda v: v[0] < 0 or (vocab_size is not None and v[1] >= vocab_size),
               lambda: check_ids(ids, keep(), vocab_size, inputs.name, inputs.where), screen=True)
    label_check = lambda: check_label_values(labels, keep(), vocab_size, inputs.where)  # noqa: E731
    ignored = labels == IGNORE_INDEX
    checks.add(any_true((labels < 0) ^ ignored).long(), lambda v: v[0] != 0, label_check, screen=True)
    if vocab_size is not None:
        checks.add(labels.amax(), lambda v: v[0] >= vocab_size, label_check, screen=True)
    checks.add(style_evidence_rows(labels, ids, inputs.real_slots(), label_style),
               lambda v: refused_by_counts(v, label_style),
               lambda: refuse_mismatched_style(labels, ids, keep(), label_style, inputs.where))
    values = inputs.loss_values
    if values is not None and values.dtype != torch.bool:
        bits = torch.stack(values.aminmax()).double().view(torch.int64)  # read as int64 bits: one dtype to read
        checks.add(bits, lambda v: not _weights_in_range(v), lambda: check_loss_weights(values, keep(), inputs.where),
                   screen=True)


def check_row_values(inputs: ValueInputs, label_style: str, vocab_size: int | None) -> None:
    """The exact checks behind `queue_value_checks`' screens, in its order, over the rows `inputs` read.

    For `pack_batch(host_reads=True)` on an error path only: its value checks run over the packed
    tokens, after the reads of media, mRoPE blocks and positions and after the plan; when one of those
    fails, this raises the error the device path (which reads the values first) would have raised."""
    keep = inputs.keep()
    check_ids(inputs.input_ids, keep, vocab_size, inputs.name, inputs.where)
    check_label_values(inputs.raw_labels, keep, vocab_size, inputs.where)
    refuse_mismatched_style(inputs.raw_labels, inputs.input_ids, keep, label_style, inputs.where)
    if inputs.loss_values is not None and inputs.loss_values.dtype != torch.bool:
        check_loss_weights(inputs.loss_values, keep, inputs.where)


def _weights_in_range(bits: list[int]) -> bool:
    """Lowest and highest loss weight (float64 bits) are >= 0 and finite as float32 (NaN is not)."""
    low, high = struct.unpack("<2d", struct.pack("<2q", *bits))
    return low >= 0 and high <= FLOAT32_MAX


class DeferredChecks:
    """Numbers computed on the device and read back in one host sync (with the lengths).

    Each entry holds device values, a host test of them, and a function that recomputes the
    details and raises the ValueError naming the field and numbers. An exact check's function must
    raise when its test fails; a screen's (a coarse test that pad slots may trip) raises only for a
    bad real token and otherwise returns. The clean path costs one sync.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[tuple[torch.Tensor, ...], Callable, Callable | None, bool]] = []

    def add(self, values, fails: Callable[[list], bool], raiser: Callable | None, *, screen: bool = False) -> int:
        """Queue `values`: a 1-D tensor, a 0-dim one, or a tuple of 0-dim ones (e.g. `aminmax()`'s);
        `fails(their host values as a flat list)`. Returns the entry's index for `read()`'s result."""
        parts = values if isinstance(values, tuple) else (values,)
        parts = tuple(p.double() if p.is_floating_point() else p for p in parts)  # floats read as float64
        self.entries.append((parts, fails, raiser, screen))
        return len(self.entries) - 1

    def read(self) -> list[list]:
        """The one host sync: every entry's values as host numbers (ints stay ints), after raising
        the first failed check's error. 1-D values go in one `cat`, 0-dim ones in one `stack`
        (all on the first entry's device: callers queue values there)."""
        if not self.entries:
            return []
        vectors = [p for parts, *_ in self.entries for p in parts if p.dim()]
        scalars = [p for parts, *_ in self.entries for p in parts if not p.dim()]
        flat = torch.cat(vectors + [torch.stack(scalars)] if scalars else vectors).tolist()  # the one host sync
        floats = any(p.is_floating_point() for p in vectors + scalars)
        host, vector_at, scalar_at = [], 0, len(flat) - len(scalars)
        for parts, *_ in self.entries:
            chunk = []
            for p in parts:
                if p.dim():
                    size = p.shape[0]
                    chunk += flat[vector_at:vector_at + size]
                    vector_at += size
                else:
                    chunk.append(flat[scalar_at])
                    scalar_at += 1
            integer = floats and not any(p.is_floating_point() for p in parts)
            host.append([int(x) for x in chunk] if integer else chunk)
        for chunk, (_, fails, raiser, screen) in zip(host, self.entries):
            if raiser is not None and fails(chunk):
                raiser()
                if not screen:
                    raise AssertionError("a failed check did not raise its ValueError")  # a bug here, not in the input
        return host
