"""Real (unpadded) lengths of right-padded rows, from a mask or explicit lengths. Checked, never guessed.

Token values are never looked at: a pad id that equals eos or 0 would otherwise mask real tokens
(bug class 7 in the design notes).

The 4D-mask rules (a Megatron [B, 1, S, S] mask's diagonal, its causal and byte checks) live in
`lengths_4d`; their public names are importable from here too.

Shape legend: B = rows, S = row length (padded).
"""

from __future__ import annotations

import functools
import numbers
from typing import Callable

import numpy as np
import torch

from megatron_vlm_packing.packing.lengths_4d import (  # noqa: F401 (re-exported: callers import them from lengths)
    any_true, check_4d_is_causal, deferred_4d_failure, keep_mask_from_4d, largest_byte,
)


def _describe_row(keep_row: torch.Tensor) -> str:
    """Human-readable summary of where a bad row has real tokens (error path only)."""
    real = torch.nonzero(keep_row).flatten().tolist()
    if not real:
        return "no real tokens"
    gaps = [i for i in range(real[0], real[-1] + 1) if not keep_row[i]]
    parts = [f"real tokens at positions {real[0]}..{real[-1]} ({len(real)} of them)"]
    if real[0] != 0:
        parts.append(f"left padding: first real token at position {real[0]}")
    if gaps:
        parts.append(f"holes at positions {gaps[:8]}{' ...' if len(gaps) > 8 else ''}")
    return "; ".join(parts)


def lengths_from_keep_mask(keep: torch.Tensor, *, field: str = "attention_mask") -> list[int]:
    """Real length of each row of a right-padded keep-mask.

    Args:
        keep: [B, S] bool or 0/1 int, 1 = real token. Each row must be 1...1 0...0.

    Returns:
        lengths: B Python ints.

    Raises:
        ValueError: a value other than 0/1, left padding or holes, naming the row and positions.

    One host sync.
    """
    if keep.dim() != 2:
        raise ValueError(f"{field} must be [B, S], got shape {tuple(keep.shape)}")
    if keep.is_floating_point() or keep.is_complex():  # rare: 0.0/1.0 masks; 0.5 is not binary
        not_binary = ((keep != 0) & (keep != 1)).any()
        values = (keep != 0).view(torch.uint8)
        low_high = torch.stack([torch.zeros_like(not_binary), not_binary]).long() * 2  # high 2: not 0/1
    else:
        values = comparable_mask(keep, field)
        low_high = torch.stack(values.aminmax()).long()
    # Three reductions, no [B, S] temporaries: a row of 0/1 values with n ones is 1...1 0...0
    # exactly when n == S or its first 0 (argmin: the first minimum) is at position n.
    # The single host sync: lengths, first zeros and the value range come back together.
    host = torch.cat([values.sum(dim=1), values.argmin(dim=1), low_high]).tolist()
    batch, row_length = keep.shape
    row_lengths, first_zero = host[:batch], host[batch:2 * batch]
    bad_rows = [b for b in range(batch) if row_lengths[b] != row_length and first_zero[b] != row_lengths[b]]
    if host[-2] < 0 or host[-1] > 1:
        _raise_not_binary(keep, values, field)
    if bad_rows:
        b = bad_rows[0]
        raise ValueError(
            f"{field} rows must be right-padded and contiguous (1...1 0...0); {len(bad_rows)} "
            f"bad row(s) {bad_rows[:8]}; row {b}: {_describe_row((keep[b] != 0).cpu())}"
        )
    return row_lengths


def _raise_not_binary(keep: torch.Tensor, values: torch.Tensor, field: str) -> None:
    """The ValueError of a [B, S] mask holding a value other than 0 and 1, naming the first one's row, column
    and value (error path only). `values`: `keep` as compared (a bool mask's bytes, an int64 copy)."""
    if keep.is_floating_point() or keep.is_complex():
        values = keep
    b, c = torch.nonzero((values != 0) & (values != 1))[0].tolist()
    value = keep[b, c].item()
    if keep.dtype == torch.bool:  # a bool tensor made by .view(torch.bool) of other bytes: torch's ops disagree on it
        raise ValueError(f"{field} row {b} has values other than 0 and 1: byte {int(values[b, c])} at column {c} of "
                         f"a torch.bool tensor (made by .view(torch.bool) of other bytes?); pass a 0/1 or bool mask")
    raise ValueError(f"{field} row {b} has values other than 0 and 1: {value} at column {c}")


# torch has few kernels for these (no min, max or sum on the CPU, no promotion with int64): read as int64.
_WIDENED_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32") if hasattr(torch, name))
_UINT64 = getattr(torch, "uint64", None)


def widened_unsigned(tensor: torch.Tensor, field: str) -> torch.Tensor:
    """`tensor` in a dtype torch can reduce and compare: uint16 and uint32 (which it cannot) as int64, exact;
    any other dtype as given (no copy). Input ids and labels of these dtypes are read the same way.

    Raises:
        ValueError: a uint64 tensor: its values need not fit int64 (2**64 - 100 would read as -100, an
        ignored label) and torch cannot reduce it to check them.
    """
    if tensor.dtype in _WIDENED_UNSIGNED:
        return tensor.long()
    if tensor.dtype == _UINT64:
        raise ValueError(f"{field} has dtype torch.uint64, whose values need not fit int64 and which torch cannot "
                         f"reduce to check them; pass int64")
    return tensor


def comparable_mask(mask: torch.Tensor, field: str = "attention_mask") -> torch.Tensor:
    """An integer or bool [B, S] mask as torch's reductions take it: a bool mask's bytes (uint8), uint16 and
    uint32 as int64 (`widened_unsigned`: uint64 is a ValueError), any other integer dtype as given."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else widened_unsigned(mask, field)


def _seq_lens_list(seq_lens) -> list:
    """`seq_lens` ([B] tensor or numpy array, or a list of ints, numpy ints included) as a list of Python
    ints; fractional, bool or non-numeric entries are a ValueError."""
    if isinstance(seq_lens, (torch.Tensor, np.ndarray)):
        if seq_lens.ndim != 1:
            raise ValueError(f"seq_lens must be [B] (one length per row), got shape {tuple(seq_lens.shape)}; "
                             f"several documents per row go in document_lengths")
        values = seq_lens.tolist()
    elif isinstance(seq_lens, (list, tuple)):
        values = list(seq_lens)
    else:
        raise ValueError(f"seq_lens must be a [B] integer tensor or a list of ints, got {type(seq_lens).__name__}")
    for b, n in enumerate(values):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Real) \
                or (not isinstance(n, numbers.Integral) and not float(n).is_integer()):
            raise ValueError(f"seq_lens row {b} is {n!r}: lengths must be whole numbers of tokens")
    return [int(n) for n in values]


class DeferredKeep:
    """Real lengths of right-padded rows whose mask is checked and read later, with other values, in one sync.

    Attributes:
        lengths: B host ints when they were host data (`seq_lens`, full rows), else None.
        values: device tensors to read when `lengths` is None, the [B] lengths first (see `fails`).
        fails: host values -> True when the mask is invalid (`real_lengths` then raises the details).
        keep: [B, S] bool, True at real tokens (exact once the mask has passed), built on first use:
            the packed path needs none.
    """

    def __init__(self, lengths, values, fails, keep_fn, mask: torch.Tensor | None = None) -> None:
        self.lengths, self.values, self.fails, self._keep_fn, self._mask = lengths, values, fails, keep_fn, mask

    @functools.cached_property
    def keep(self) -> torch.Tensor:
        return self._keep_fn()

    def real_slots(self) -> torch.Tensor:
        """[B, S] 1 at real tokens, 0 at pad slots: a 2D integer or bool mask as given (no copy), else `keep`."""
        return self._mask if self._mask is not None else self.keep


def right_padded_reads(mask: torch.Tensor, field: str = "attention_mask") -> tuple[tuple[torch.Tensor, ...],
                                                                                  Callable[[list], bool]]:
    """3 x [B] device numbers of a [B, S] integer or bool mask (row sums, row minima, first minimum of
    each row), for an int64 mask also its 0-dim maximum, and the host test that fails unless every row
    is 1...1 0...0. Two reductions (three for int64), no [B, S] temporaries.

    Why it is exact: with row minimum m >= 0 and first minimum at z, the z values before z are >= 1.
    If m == 0 the row sum n is >= z, with equality exactly when those are all 1 and all after are 0;
    if m >= 1 every value is >= 1 and n == S exactly when all are 1. That needs exact sums: torch sums
    narrower integers in int64, but int64 sums wrap (M + M + 5 == 3 for M = 2**63 - 1), so an int64
    mask's maximum must be <= 1 as well.
    """
    values = comparable_mask(mask, field)
    minima, first_minimum = values.min(dim=1)
    reads = (values.sum(dim=1), minima, first_minimum)
    if values.dtype == torch.int64:
        reads += (values.amax(),)
    return reads, _right_padded_test(*mask.shape)


def _right_padded_test(batch: int, row_length: int) -> Callable[[list], bool]:
    """The host test of `right_padded_reads`' numbers (see there): True when some row is not 1...1 0...0."""

    def fails(host: list) -> bool:
        if len(host) > 3 * batch and host[3 * batch] > 1:  # an int64 mask's maximum
            return True
        return not _rows_right_padded(host[:batch], host[batch:2 * batch], host[2 * batch:3 * batch], row_length)

    return fails


def _rows_right_padded(sums: list[int], minima: list[int], firsts: list[int], row_length: int) -> bool:
    """Every row is 1...1 0...0, from its sum, minimum and first minimum (`right_padded_reads`)."""
    return not any([m < 0 or n != (z if m == 0 else row_length) for n, m, z in zip(sums, minima, firsts)])


def right_padded_lengths_on_host(mask: torch.Tensor) -> list[int]:
    """B real lengths of a [B, S] integer or bool mask on the CPU, read and checked now (no sync to save).

    `right_padded_row_lengths`' numbers and test, read with numpy; `lengths_from_keep_mask` raises the
    detailed error of a bad mask."""
    lengths = right_padded_row_lengths(mask.numpy())
    if lengths is None:
        lengths_from_keep_mask(mask)  # raises
        raise AssertionError("a mask failing the right-padding test passed lengths_from_keep_mask")
    return lengths


def right_padded_row_lengths(rows: np.ndarray) -> list[int] | None:
    """The B real lengths of a [B, S] integer or bool mask (numpy), or None when some row is not 1...1 0...0
    (nothing raised: the caller names the error).

    Three passes over the mask, read as signed ints of its width (a bool's bytes as int8): the row sums
    (in int64), its maximum read as unsigned ints (a negative value is a large unsigned one), then the first
    minimum of each row (`argmin`). Why it is exact: with every value 0 or 1 (unsigned maximum <= 1), a row
    of sum n == S is all ones, and a row of sum n < S has a 0, whose first place z is the row's first
    minimum; the row is 1...1 0...0 exactly when n == z. The sums are used only once the maximum has
    held them exact (64-bit sums of larger values wrap). The sums come first because the first pass is the
    one that reads the mask from memory, which numpy's signed sum does faster than its unsigned maximum: at
    64 x 32768 int64 with cold caches, 1.5 ms where the maximum first took 2.0 ms; the same 0.04 ms at
    4 x 2048 (one core). One numpy call fewer than reading each row's minimum back (`take`); torch's fused
    min-with-index took 2 to 4x longer (4 x 2048 to 64 x 32768, one core)."""
    width = rows.dtype.itemsize
    signed = rows.view(_SIGNED_OF_WIDTH[width])  # 0/1 either way; numpy's signed sums are the faster loop
    sums = np.add.reduce(signed, axis=1)
    if np.maximum.reduce(rows.view(_UNSIGNED_OF_WIDTH[width]), axis=None, initial=0) > 1:  # (initial: 0 rows)
        return None
    row_length = rows.shape[1]
    sums = sums.tolist()
    firsts = signed.argmin(axis=1).tolist()
    if not all([n == row_length or n == z for n, z in zip(sums, firsts)]):
        return None
    return sums


_UNSIGNED_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def keep_mask_deferred(
    *,
    batch_size: int,
    row_length: int,
    attention_mask: torch.Tensor | None = None,
    seq_lens=None,
    device=None,
    on_host: bool = False,
) -> DeferredKeep:
    """The rows' real lengths and keep-mask without reading anything back to the host.

    Shape and `seq_lens` errors are raised at once (they need no device data); the mask's own
    validity (0/1 values, right padding, a causal 4D mask) rides the caller's one host read, and
    when it fails, `real_lengths` with the same arguments raises the detailed error.

    `on_host=True` (a 2D integer or bool mask on the CPU, where a read costs no sync): the lengths
    are read and checked now, and `lengths` holds them.
    """
    if attention_mask is not None and seq_lens is not None:
        raise ValueError("give either attention_mask or seq_lens, not both")
    if attention_mask is None:
        lengths = real_lengths(batch_size=batch_size, row_length=row_length, seq_lens=seq_lens)
        return DeferredKeep(lengths, None, None, lambda: keep_from_lengths(lengths, row_length, device))
    keep = _keep_of(attention_mask)
    _check_mask_covers(keep, batch_size, row_length)
    if attention_mask.dim() == 2 and not attention_mask.is_floating_point() and not attention_mask.is_complex():
        return _deferred_integer_mask(attention_mask, device, on_host)
    return _deferred_rare_mask(attention_mask, keep, device)


def _keep_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S]: a 2D mask as given, a 4D mask's keep-mask (`keep_mask_from_4d`); any other rank is a ValueError."""
    if attention_mask.dim() == 4:
        return keep_mask_from_4d(attention_mask)
    if attention_mask.dim() == 2:
        return attention_mask
    raise ValueError(
        f"attention_mask must be [B, S] or [B, 1, S, S], got shape {tuple(attention_mask.shape)}"
    )


def _check_mask_covers(keep: torch.Tensor, batch_size: int, row_length: int) -> None:
    """The mask's [B, S] (`keep`) is input_ids' (batch_size, row_length), else a ValueError naming both."""
    if tuple(keep.shape) != (batch_size, row_length):
        raise ValueError(
            f"attention_mask covers {tuple(keep.shape)} tokens but input_ids is {(batch_size, row_length)}"
        )


def _deferred_integer_mask(attention_mask: torch.Tensor, device, on_host: bool) -> DeferredKeep:
    """`keep_mask_deferred` of a [B, S] integer or bool mask: read now on the host (`on_host` and a CPU mask),
    else its `right_padded_reads` left to the caller's read (moved to `device` when it is elsewhere)."""
    attention_mask = widened_unsigned(attention_mask, "attention_mask")
    keep_fn = (lambda: attention_mask) if attention_mask.dtype == torch.bool else (lambda: attention_mask != 0)
    if on_host and attention_mask.is_cpu:
        return DeferredKeep(right_padded_lengths_on_host(attention_mask), None, None, keep_fn, mask=attention_mask)
    values, fails = right_padded_reads(attention_mask)
    if device is not None and attention_mask.device != torch.device(device):  # read with the ids' values
        values = tuple(v.to(device) for v in values)
    return DeferredKeep(None, values, fails, keep_fn, mask=attention_mask)


def _deferred_rare_mask(attention_mask: torch.Tensor, keep: torch.Tensor, device) -> DeferredKeep:
    """`keep_mask_deferred` of the rare forms, checked the longer way: a float 0/1 [B, S] mask, or a 4D mask
    (`keep` its diagonal; causal between real tokens, `lengths_4d.deferred_4d_failure`). Its right-padding
    reads and one more 0-dim value (nonzero: the mask fails) are left to the caller's read."""
    if attention_mask.dim() == 4:
        other = deferred_4d_failure(attention_mask, keep)
    else:
        other = any_true((attention_mask != 0) & (attention_mask != 1))
        keep = attention_mask != 0
    values, fails = right_padded_reads(keep)
    if device is not None and keep.device != torch.device(device):
        values, other = tuple(v.to(device) for v in values), other.to(device)
    return DeferredKeep(None, values + (other,), lambda host: bool(host[-1]) or fails(host[:-1]), lambda: keep)


def keep_from_lengths(lengths: list[int], row_length: int, device=None) -> torch.Tensor:
    """[B, S] bool, True at the first lengths[b] slots of row b."""
    return torch.arange(row_length, device=device)[None] < torch.tensor(lengths, device=device)[:, None]


def real_lengths(
    *,
    batch_size: int,
    row_length: int,
    attention_mask: torch.Tensor | None = None,
    seq_lens: torch.Tensor | list[int] | None = None,
) -> list[int]:
    """Real length of every row from exactly one source: `seq_lens`, a 2D or 4D mask, or neither.

    Args:
        batch_size, row_length: B and S of `input_ids`, which every source must agree with.
        attention_mask: [B, S] keep-mask (1 = real) or [B, 1, S, S] bool (True = masked).
        seq_lens: [B] ints, 0 <= len <= S.

    Returns:
        B Python ints. With neither source every row is full length (S).

    Raises:
        ValueError: both sources given, a shape that disagrees with `input_ids`, lengths out of
        range, holes or left padding.
    """
    if attention_mask is not None and seq_lens is not None:
        raise ValueError("give either attention_mask or seq_lens, not both")
    if seq_lens is not None:
        return _checked_seq_lens(seq_lens, batch_size, row_length)
    if attention_mask is None:
        return [row_length] * batch_size
    keep = _keep_of(attention_mask)
    if attention_mask.dim() == 4:
        check_4d_is_causal(attention_mask, keep)
    _check_mask_covers(keep, batch_size, row_length)
    return lengths_from_keep_mask(keep)


def _checked_seq_lens(seq_lens, batch_size: int, row_length: int) -> list[int]:
    """`seq_lens` as B Python ints, each in [0, row_length]; else a ValueError naming the rows."""
    lengths = _seq_lens_list(seq_lens)
    if len(lengths) != batch_size:
        raise ValueError(f"seq_lens has {len(lengths)} entries but input_ids has {batch_size} rows")
    out_of_range = [(b, n) for b, n in enumerate(lengths) if not 0 <= int(n) <= row_length]
    if out_of_range:
        raise ValueError(
            f"seq_lens must lie in [0, {row_length}] (the row length of input_ids); "
            f"out of range (row, length): {out_of_range[:8]}"
        )
    return [int(n) for n in lengths]
