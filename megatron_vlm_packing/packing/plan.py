"""The pack plan: where every real token of a right-padded batch goes in one packed THD sequence.

A plan is decided on the host from Python ints (the real lengths), so building it costs no device
work and no sync; `PackIndices` then turns it into device index tensors once per micro-batch.

Layout: document i occupies physical slots [cu_seqlens_padded[i], cu_seqlens_padded[i+1]). Its
real tokens are the first `real_lengths[i]` of those slots; the rest are pad slots, which
attention skips (they lie outside `cu_seqlens`) and the loss ignores.

Shape legend: B = rows, S = row length, N = documents (rows with real tokens), T = physical tokens.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass

import numpy as np
import torch


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def host_ramp(length: int) -> np.ndarray:
    """[length] read-only int64 0, 1, ..., length-1, a view of one array shared by every caller.

    Offsets within documents are slices of one ramp; `np.arange` per micro-batch cost 10 to 20 us
    at S = 2k to 32k on one core. Read-only, so a caller that returned a view by mistake could not let
    a later micro-batch's writes reach it (outputs are copies: `np.concatenate` of its slices)."""
    return _ramp_of_size(1 << max(length - 1, 0).bit_length())[:length]


@functools.lru_cache(maxsize=8)
def _ramp_of_size(size: int) -> np.ndarray:
    ramp = np.arange(size, dtype=np.int64)
    ramp.flags.writeable = False
    return ramp


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
        """
        for name, value in (("tp_size", tp_size), ("cp_size", cp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("sequence_parallel", sequence_parallel), ("fp8", fp8)):
            if not isinstance(value, bool):  # a truthy string ("false") must not switch alignment on
                hint = " (for Megatron's fp8 format: fp8=config.fp8 is not None)" if name == "fp8" else ""
                raise ValueError(f"{name} must be a bool, got {value!r}{hint}")
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

    @classmethod
    def _made_by_make_pack_plan(cls, **fields) -> "PackPlan":
        """The plan `make_pack_plan` computed, not checked a second time: its own checks imply every check
        of `__post_init__` (N >= 1 documents of >= 1 real tokens each, physical lengths rounded up to the
        segment multiple, the last one grown to a multiple of `total`, itself a multiple of `segment`).
        (`check_int32_total` it makes itself). The checks cost 10 us of a 4-row micro-batch's 300 in a
        DataLoader worker; tests/packing/test_plan.py rebuilds random plans through the checking constructor
        and compares."""
        plan = object.__new__(cls)
        plan.__dict__.update(fields)
        return plan

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
    aligned = round_up(sum(physical), multiples.total)
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
    check_int32_total(aligned, sum(real))
    return PackPlan._made_by_make_pack_plan(
        row_lengths=lengths,
        row_capacity=row_capacity,
        segment_rows=rows,
        real_lengths=real,
        physical_lengths=tuple(physical),
        multiples=multiples,
    )


def check_int32_total(total: int, real: int) -> None:
    """A pack's boundaries are int32 `cu_seqlens`: T must stay below 2**31.

    Raises:
        ValueError: naming T and its real tokens.
    """
    if total >= 2**31:
        raise ValueError(f"the pack has {total} slots ({real} real tokens), more than int32 cu_seqlens can hold "
                         f"(< 2**31): a smaller pad_to, or fewer rows per micro-batch")


def checked_pad_to(pad_to) -> int | None:
    """`pad_to` as a Python int (or None). An integer scalar (numpy, a 0-dim tensor) would otherwise
    become the last physical length, T and `max_seqlen_*`, which must be Python ints; a float or a
    string would fail deep in the plan with a TypeError.

    Raises:
        ValueError: `pad_to` is a bool or not an integer.
    """
    if pad_to is None or type(pad_to) is int:
        return pad_to
    if not isinstance(pad_to, bool):
        try:
            return operator.index(pad_to)
        except TypeError:
            pass
    raise ValueError(f"pad_to must be an int (the packed length T) or None, got {pad_to!r}")


@dataclass(frozen=True)
class DocumentSlices:
    """Where each document's tokens lie in the flattened rows.

    Attributes:
        spans: N (start, stop) of each document's slice of the flattened rows (what numpy slices).
        pad_lengths: N ints, pad slots after each document's slice.
        longest_pad: max(pad_lengths).
        flat_length: B*S.
        split_sizes: 2N+1 ints (derived, for one `split_with_sizes`): gap, document 0, gap,
            document 1, ..., rest; they cover B*S exactly, so the odd pieces of
            `flat.split_with_sizes(split_sizes)` are the documents' slices.
    """

    spans: tuple[tuple[int, int], ...]
    pad_lengths: tuple[int, ...]
    longest_pad: int
    flat_length: int

    @classmethod
    def of(cls, plan: "PackPlan", *, shift: int = 0) -> "DocumentSlices":
        """Slices [row*S + shift, row*S + real) of every document (shift 1: next-token targets)."""
        capacity = plan.row_capacity
        spans = tuple([(row * capacity + shift, row * capacity + real)
                       for row, real in zip(plan.segment_rows, plan.real_lengths)])
        pads = tuple([phys - real + shift for real, phys in zip(plan.real_lengths, plan.physical_lengths)])
        return cls(spans, pads, max(pads), len(plan.row_lengths) * capacity)

    @functools.cached_property  # only the torch path splits (numpy slices `spans`)
    def split_sizes(self) -> tuple[int, ...]:
        sizes, position = [], 0
        for start, stop in self.spans:
            sizes += (start - position, stop - start)
            position = stop
        sizes.append(self.flat_length - position)
        return tuple(sizes)


class PackIndices:
    """Device index tensors of a plan, each built on first use (`plan_indices` makes one per micro-batch).

    A micro-batch rarely needs them all: `pack.pack_rows` copies each document's slice (one
    `torch.cat`), so packing token ids needs no [T] index at all. Each attribute is computed once,
    on `device`, with no host sync (every size is a host int of the plan).

    Attributes:
        plan: the host `PackPlan`.
        device: where the tensors live.
        segment_of_slot: [T] long, document of every physical slot.
        offset_in_segment: [T] long, slot offset within its document (0 at each document start).
        is_real: [T] bool, True at real tokens, False at pad slots.
        next_is_real: [T] bool, True where the next slot is a real token of the same document
            (where a next-token target exists inside the sample).
        source: [T] long, flat index b*S+s of each slot's source token (0 at pad slots).
        unpack_target: [T] long, `source` at real slots and B*S (a scratch row) at pad slots.
        cu_seqlens: [N+1] int32, real boundaries.
        cu_seqlens_padded: [N+1] int32, physical boundaries (the `cu_seqlens` tensor itself when no
            document has pad slots: never write either in place).
    """

    def __init__(self, plan: PackPlan, device: torch.device):
        self.plan, self.device = plan, device
        cu_real = (0, *itertools.accumulate(plan.real_lengths))
        cu_padded = (0, *itertools.accumulate(plan.physical_lengths)) if self.has_pad_slots else cu_real
        # With no pad slots the two sets are one tensor on every device (nothing writes boundaries in
        # place): Transformer Engine infers `pad_between_seqs` when Megatron-Core cannot pass it (no such
        # PackedSeqParams field before 0.19) by identity (TE >= 2.18: distinct tensors disable FlashAttention)
        # or `torch.equal` (TE <= 2.17: two host syncs per layer unless they are one tensor).
        if device.type == "cpu":  # numpy builds a small tensor at a third of torch's cost
            self.cu_seqlens = torch.from_numpy(np.array(cu_real, dtype=np.int32))
            self.cu_seqlens_padded = torch.from_numpy(np.array(cu_padded, dtype=np.int32)) \
                if self.has_pad_slots else self.cu_seqlens
        elif self.has_pad_slots:
            both = _to_device(torch.tensor([cu_real, cu_padded], dtype=torch.int32), device)  # one small copy
            self.cu_seqlens, self.cu_seqlens_padded = both[0], both[1]
        else:
            self.cu_seqlens = self.cu_seqlens_padded = _to_device(torch.tensor(cu_real, dtype=torch.int32), device)

    def cp_index(self, cp_size: int, cp_rank: int) -> torch.Tensor:
        """[T/cp] long: the slots CP rank `cp_rank` keeps (`parallel.cp.cp_partition_index`), built
        from the plan's host ints with no host sync; cached (a loader's collate can build every
        rank's in its worker, and they travel with the micro-batch)."""
        key = (cp_size, cp_rank)
        cache = self.__dict__.setdefault("_cp_indices", {})
        if key not in cache:
            from megatron_vlm_packing.parallel.cp import cp_partition_index_from_lengths

            cache[key] = cp_partition_index_from_lengths(self.plan.physical_lengths, cp_size, cp_rank,
                                                         device=self.device)
        return cache[key]

    # Host arrays rebuilt from the plan on demand: a DataLoader worker's pickle would copy them by value
    # next to the tensors sharing their memory, and a copy moved to a device has no use for them.
    _HOST_CACHES = frozenset({"offset_in_segment_host"})

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name not in self._HOST_CACHES}

    def map_tensors(self, fn, memo: dict | None = None) -> "PackIndices":
        """A copy with `fn` applied to every tensor built so far (e.g. to move them to a device).

        `memo` (id -> result) keeps tensors shared with other holders (a micro-batch's
        `packed_seq_params` holds the same boundaries) shared in the copy.
        """
        once = apply_once(fn, memo)
        copy = object.__new__(PackIndices)
        for name, value in self.__getstate__().items():
            copy.__dict__[name] = {k: once(v) for k, v in value.items()} if name == "_cp_indices" else once(value)
        copy.device = copy.cu_seqlens.device
        return copy

    @functools.cached_property
    def row_slices(self) -> DocumentSlices:
        """Each document's real tokens in the flattened rows (host ints)."""
        return DocumentSlices.of(self.plan)

    @functools.cached_property
    def next_token_slices(self) -> DocumentSlices:
        """Each document's next-token targets (labels[1:n]) in the flattened rows (host ints)."""
        return DocumentSlices.of(self.plan, shift=1)

    @property
    def has_pad_slots(self) -> bool:
        return self.plan.real_lengths != self.plan.physical_lengths

    @functools.cached_property
    def offset_in_segment_host(self) -> np.ndarray:
        """[T] int64 numpy `offset_in_segment`, for indices on the CPU (a slice costs numpy a fraction of
        a microsecond, torch several; `pack.segment_positions` views it without a second crossing)."""
        ramp = host_ramp(self.plan.max_seqlen)
        return np.concatenate([ramp[:n] for n in self.plan.physical_lengths])

    @functools.cached_property
    def offset_in_segment(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.from_numpy(self.offset_in_segment_host)
        ramp = torch.arange(self.plan.max_seqlen, device=self.device)
        return torch.cat([ramp[:n] for n in self.plan.physical_lengths])

    @functools.cached_property
    def is_real(self) -> torch.Tensor:
        if not self.has_pad_slots:
            return torch.ones(self.plan.total, dtype=torch.bool, device=self.device)
        return self.offset_in_segment < self._per_slot(self.plan.real_lengths)

    @functools.cached_property
    def next_is_real(self) -> torch.Tensor:
        return self.offset_in_segment + 1 < self._per_slot(self.plan.real_lengths)

    @functools.cached_property
    def segment_of_slot(self) -> torch.Tensor:
        return self._per_slot(range(self.plan.num_segments))

    @functools.cached_property
    def source(self) -> torch.Tensor:
        starts = [row * self.plan.row_capacity for row in self.plan.segment_rows]
        return torch.where(self.is_real, self._per_slot(starts) + self.offset_in_segment, 0)

    @functools.cached_property
    def unpack_target(self) -> torch.Tensor:
        scratch = len(self.plan.row_lengths) * self.plan.row_capacity
        return torch.where(self.is_real, self.source, scratch)

    def _per_slot(self, per_document) -> torch.Tensor:
        """[T] long: each document's value repeated over its physical slots."""
        if self.device.type == "cpu":
            return torch.from_numpy(np.repeat(np.asarray(list(per_document), dtype=np.int64),
                                              self.plan.physical_lengths))
        values = _to_device(torch.tensor(list(per_document), dtype=torch.long), self.device)
        lengths = _to_device(torch.tensor(self.plan.physical_lengths, dtype=torch.long), self.device)
        return torch.repeat_interleave(values, lengths, output_size=self.plan.total)


def apply_once(fn, memo: dict | None = None):
    """value -> `fn(value)` for a tensor, computed once per tensor object (`memo`: id -> result, shared
    by callers that must keep shared tensors shared); anything else is returned as it is."""
    memo = {} if memo is None else memo

    def once(value):
        if not isinstance(value, torch.Tensor):
            return value
        key = id(value)
        result = memo.get(key)
        if result is None:
            result = memo[key] = fn(value)
        return result

    return once


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to `device` without blocking the host (pinned on CUDA)."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def plan_indices(plan: PackPlan, device: torch.device | str | None = None) -> PackIndices:
    """The index tensors of `plan` on `device`, built lazily with no host sync.

    The boundaries (2 x (N+1) ints, or N+1 when no document has pad slots: one tensor for both sets)
    cross to the device in one small copy now; every [T] tensor is built on first use from the plan's
    host ints.
    """
    return PackIndices(plan, torch.device(device) if device is not None else _HOST)


_HOST = torch.device("cpu")
