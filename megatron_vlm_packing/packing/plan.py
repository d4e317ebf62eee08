"""The pack plan: where every real token of a right-padded batch goes in one packed THD sequence.

A plan is decided on the host from Python ints (the real lengths), so building it costs no device
work and no sync; `indices.plan_indices` then turns it into index tensors once per micro-batch.

Layout: document i occupies physical slots [cu_seqlens_padded[i], cu_seqlens_padded[i+1]). Its
real tokens are the first `real_lengths[i]` of those slots; the rest are pad slots, which
attention skips (they lie outside `cu_seqlens`) and the loss ignores.

Shape legend: B = rows, S = row length, N = documents (rows with real tokens), T = physical tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megatron_vlm_packing.packing.bounds import checked_int, is_int, tensor_hint


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class PackMultiples:
    """Alignment that parallelism imposes on a packed sequence.

    Attributes:
        segment: every physical document length is a multiple of this. 2*cp when cp > 1, because
            TransformerEngine's context-parallel attention cuts each document into 2*cp chunks.
        total: T is a multiple of this; always a multiple of `segment`.
    """

    segment: int = 1
    total: int = 1

    def __post_init__(self) -> None:
        for name in ("segment", "total"):  # 1.5 was kept and made every physical length a float
            object.__setattr__(self, name, checked_int(getattr(self, name), f"PackMultiples.{name}"))
        if self.segment < 1 or self.total < 1 or self.total % self.segment:
            raise ValueError(
                f"PackMultiples needs segment >= 1 and total a multiple of segment; got "
                f"segment={self.segment}, total={self.total}"
            )

    @classmethod
    def for_parallel(
        cls, *, tp_size: int = 1, cp_size: int = 1, sequence_parallel: bool = False, fp8: bool = False
    ) -> "PackMultiples":
        """The multiples for a parallel configuration (see `_for_parallel`)."""
        if type(tp_size) is int and type(cp_size) is int and tp_size == cp_size == 1 and sequence_parallel is False \
                and fp8 is False and cls is PackMultiples:
            return _NO_PARALLELISM  # the common case, built once
        return cls._for_parallel(tp_size=tp_size, cp_size=cp_size, sequence_parallel=sequence_parallel, fp8=fp8)

    @classmethod
    def _for_parallel(cls, *, tp_size: int, cp_size: int, sequence_parallel: bool, fp8: bool) -> "PackMultiples":
        """Derive the multiples from the parallel configuration.

        - segment = 2*cp (cp > 1): TE's CP splits each document into 2*cp equal chunks.
        - total includes cp*tp under sequence parallelism: each CP rank holds T/cp tokens and SP
          splits those evenly over tp ranks.
        - total includes 16 per rank-local slice under fp8: FP8 GEMMs need the token dimension
          each rank multiplies to be a multiple of 16.

        Raises:
            ValueError: a size that is not a positive int, a flag that is not a bool, or sequence_parallel
                at tp_size=1 (Megatron-Core's ModelParallelConfig refuses SP without TP).
        """
        for name, value in (("tp_size", tp_size), ("cp_size", cp_size)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        tp_size, cp_size = int(tp_size), int(cp_size)  # numpy ints: the multiples are Python ints
        if not isinstance(sequence_parallel, bool):  # a truthy string ("false") must not switch alignment on
            raise ValueError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
        if sequence_parallel and tp_size == 1:
            # ModelParallelConfig.__post_init__ raises this (0.16.1 to 0.19), and Megatron-LM's arguments turn SP
            # off at TP=1: no model runs this layout, and the multiples were those of SP off.
            raise ValueError(f"sequence_parallel=True needs tp_size > 1, got tp_size={tp_size} (cp_size={cp_size}): "
                             f"Megatron-Core refuses sequence parallelism without tensor parallelism; pass "
                             f"sequence_parallel=False")
        check_fp8(fp8)
        segment = 2 * cp_size if cp_size > 1 else 1
        per_rank = cp_size * (tp_size if sequence_parallel else 1)
        total = math.lcm(segment, per_rank * (16 if fp8 else 1))
        return cls(segment=segment, total=total)


_NO_PARALLELISM = PackMultiples()


@dataclass(frozen=True)
class PackPlan:
    """Real and physical lengths of every packed document. Immutable; all fields are host ints.

    Attributes:
        row_lengths: B real lengths, one per input row (0 for an empty row).
        row_capacity: S, the padded row length of the input.
        segment_rows: N input rows that became documents (rows with real tokens), in order.
        real_lengths: N real token counts.
        physical_lengths: N slot counts (real + pad), each a multiple of `multiples.segment`.
        multiples: the alignment the plan satisfies.
    """

    row_lengths: tuple[int, ...]
    row_capacity: int
    segment_rows: tuple[int, ...]
    real_lengths: tuple[int, ...]
    physical_lengths: tuple[int, ...]
    multiples: PackMultiples

    def __post_init__(self) -> None:
        n = len(self.segment_rows)
        if not (len(self.real_lengths) == len(self.physical_lengths) == n) or n == 0:
            raise ValueError(
                f"PackPlan needs N >= 1 segments with matching lengths; got {n} rows, "
                f"{len(self.real_lengths)} real and {len(self.physical_lengths)} physical lengths"
            )
        segment = self.multiples.segment
        bad = [i for i, (real, phys) in enumerate(zip(self.real_lengths, self.physical_lengths))
               if real < 1 or phys < real or phys % segment]
        if bad:
            i = bad[0]
            raise ValueError(
                f"segment {i}: real length {self.real_lengths[i]} must be >= 1 and physical length "
                f"{self.physical_lengths[i]} >= real and a multiple of {segment}"
            )
        if self.total % self.multiples.total:
            raise ValueError(f"total {self.total} is not a multiple of {self.multiples.total}")
        check_int32_total(self.total, sum(self.real_lengths))

    @property
    def num_segments(self) -> int:
        return len(self.segment_rows)

    @functools.cached_property  # the plan is frozen: computed once (several readers per micro-batch)
    def total(self) -> int:
        """T, the physical packed length."""
        return sum(self.physical_lengths)

    @functools.cached_property
    def num_real_tokens(self) -> int:
        return sum(self.real_lengths)

    @functools.cached_property
    def max_seqlen(self) -> int:
        """Longest physical document: covers every real and padded length (what TE needs)."""
        return max(self.physical_lengths)

    @property
    def efficiency(self) -> float:
        """Real tokens / physical tokens of the pack."""
        return self.num_real_tokens / self.total

    def cu_seqlens(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[N+1] int32, cumulative real lengths, starts at 0."""
        return _cumulative(self.real_lengths, device)

    def cu_seqlens_padded(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[N+1] int32, cumulative physical lengths, starts at 0."""
        return _cumulative(self.physical_lengths, device)


def _cumulative(lengths: tuple[int, ...], device) -> torch.Tensor:
    values = [0]
    for n in lengths:
        values.append(values[-1] + n)
    return torch.tensor(values, dtype=torch.int32, device=device)


def make_pack_plan(
    row_lengths: list[int] | tuple[int, ...],
    *,
    row_capacity: int,
    multiples: PackMultiples = PackMultiples(),
    pad_to: int | None = None,
) -> PackPlan:
    """Plan a pack: one document per non-empty row, each padded to the segment multiple.

    When only the total needs more padding (the total multiple, or a fixed `pad_to` for static
    shapes under PP > 1, EP > 1 or CUDA graphs), the last document grows: one longer document costs
    less than padding every document, and adds no fake document for attention to see.

    Args:
        row_lengths: B real lengths (ints, 0 <= n <= row_capacity). Empty rows make no segment.
        row_capacity: S, the row length the lengths came from.
        multiples: alignment from `PackMultiples.for_parallel`.
        pad_to: exact T wanted; must be >= the aligned length and a multiple of `multiples.total`.

    Example:
        row_lengths=[5, 0, 3], multiples=PackMultiples(segment=4, total=4) ->
        real_lengths=(5, 3), physical_lengths=(8, 4), cu_seqlens=[0, 5, 8], cu_seqlens_padded=[0, 8, 12]

    Raises:
        ValueError: no real tokens at all, a length out of range, or a `pad_to` that is too small
        or not aligned (naming the numbers).
    """
    if pad_to is not None:  # (no call for the common None: a plan is made per micro-batch)
        pad_to = checked_pad_to(pad_to)
    lengths = tuple(map(int, row_lengths))
    if lengths and (min(lengths) < 0 or max(lengths) > row_capacity):
        out_of_range = [(b, n) for b, n in enumerate(lengths) if not 0 <= n <= row_capacity]
        raise ValueError(f"row lengths must lie in [0, {row_capacity}]; got (row, length) {out_of_range[:8]}")
    if all(lengths):
        rows, real = tuple(range(len(lengths))), lengths
    else:  # (comprehensions, not generators: a plan is made per micro-batch)
        rows = tuple([b for b, n in enumerate(lengths) if n > 0])
        real = tuple([lengths[b] for b in rows])
    if not rows:
        raise ValueError(f"the batch has no real tokens ({len(lengths)} rows, all empty): nothing to pack")
    physical = [round_up(n, multiples.segment) for n in real] if multiples.segment > 1 else list(real)
    aligned = sum(physical) if multiples.total == 1 else round_up(sum(physical), multiples.total)
    if pad_to is not None:
        if pad_to % multiples.total:
            raise ValueError(f"pad_to={pad_to} is not a multiple of the total multiple {multiples.total}")
        if pad_to < aligned:
            raise ValueError(
                f"pad_to={pad_to} is smaller than the {aligned} physical tokens this batch needs "
                f"({sum(real)} real tokens in {len(real)} samples); nothing is truncated silently"
            )
        aligned = pad_to
    physical[-1] += aligned - sum(physical)
    num_real = sum(real)
    if aligned >= 2**31:
        check_int32_total(aligned, num_real)  # raises
    # The plan computed here, not checked a second time: these checks imply every check of `PackPlan.__post_init__`
    # (N >= 1 documents of >= 1 real tokens each, physical lengths rounded up to the segment multiple, the last one
    # grown to a multiple of `total`, itself a multiple of `segment`; `check_int32_total`). Those cost 10 us of a
    # 4-row micro-batch's 300 in a DataLoader worker, a constructor's layer some more with cold caches;
    # tests/packing/test_plan.py rebuilds random plans through the checking constructor and compares. The cached
    # properties' values (`total`, ...) are stored too: read then without functools' Python layer.
    plan = object.__new__(PackPlan)
    plan.__dict__.update(
        row_lengths=lengths,
        row_capacity=row_capacity,
        segment_rows=rows,
        real_lengths=real,
        physical_lengths=tuple(physical),
        multiples=multiples,
        # the cached properties, computed here (several readers per micro-batch)
        total=aligned,
        num_real_tokens=num_real,
        max_seqlen=max(physical),
    )
    return plan


def check_int32_total(total: int, real: int | None = None) -> None:
    """A pack's boundaries are int32 `cu_seqlens`: T must stay below 2**31 (the one check of it: the collapsed
    plan, LLaVA's expanded total, dense rows laid end to end).

    Raises:
        ValueError: naming T and, when given, its real tokens.
    """
    if total >= 2**31:
        of_which = "" if real is None else f" ({real} real tokens)"
        raise ValueError(f"the pack has {total} slots{of_which}, more than int32 cu_seqlens can hold (< 2**31): "
                         f"a smaller pad_to or seq_length, or fewer rows or images per micro-batch")


def check_fp8(fp8) -> None:
    """`fp8` is a bool: a truthy string ("false") or Megatron's fp8 format ("e4m3") must not switch FP8's
    alignment on.

    Raises:
        ValueError: `fp8` is not a bool (naming it).
    """
    if not isinstance(fp8, bool):
        raise ValueError(f"fp8 must be a bool, got {fp8!r} (for Megatron's fp8 format: fp8=config.fp8 is not None)")


def checked_pad_to(pad_to) -> int | None:
    """`pad_to` as a Python int (or None), by the one rule of an integer option (`bounds.is_int`). A numpy int
    would otherwise become the last physical length, T and `max_seqlen_*`, which must be Python ints; a float or
    a string would fail deep in the plan with a TypeError.

    Raises:
        ValueError: `pad_to` is a bool, a tensor (saying to pass int(pad_to)), not an integer, or below 1 (no
            pack has 0 slots: refused where an option is set, not at the first batch a collator packs).
    """
    if pad_to is None:
        return pad_to
    if not is_int(pad_to):
        raise ValueError(f"pad_to must be an int (the packed length T) or None, got {pad_to!r}"
                         f"{tensor_hint(pad_to, 'pad_to')}")
    if pad_to < 1:
        raise ValueError(f"pad_to must be a positive int (the packed length T) or None, got {pad_to!r}")
    return int(pad_to)
