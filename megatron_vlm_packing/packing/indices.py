"""A pack plan's index tensors and host slices: what copies each document's tokens into place.

`plan.make_pack_plan` decides where every real token goes from host ints; `plan_indices` turns that
plan into `PackIndices` once per micro-batch, each tensor built on first use with no host sync, and
`DocumentSlices` gives the host (numpy) copies their row slices. `host_ramp` is the one shared
0, 1, 2, ... every offset within a document is sliced from.

Shape legend: B = rows, S = row length, N = documents (rows with real tokens), T = physical tokens.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from megatron_vlm_packing.packing.plan import PackPlan


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
    def of(cls, plan: PackPlan, *, shift: int = 0) -> "DocumentSlices":
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
        offset_in_segment: [T] long, slot offset within its document (0 at each document start). On
            the CPU a micro-batch's 1D `position_ids` are a view of it (`pack.segment_positions`, no
            copy per micro-batch): never write either in place.
        is_real: [T] bool, True at real tokens, False at pad slots.
        has_pad_slots: some document has pad slots (physical length > real length).
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
        # (an attribute, read several times per micro-batch: no property call each time)
        self.has_pad_slots = plan.real_lengths != plan.physical_lengths
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
    def offset_in_segment_host(self) -> np.ndarray:
        """[T] int64 numpy `offset_in_segment`, for indices on the CPU (a slice costs numpy a fraction of
        a microsecond, torch several; `pack.segment_positions` views it without a second crossing). Built
        once, kept in the instance's dict under its own name (a property with its own cache, not a
        cached_property: one Python call instead of functools' layer, in a DataLoader worker's cold caches)."""
        offsets = self.__dict__.get("offset_in_segment_host")
        if offsets is None:
            ramp = host_ramp(self.plan.max_seqlen)
            offsets = self.__dict__["offset_in_segment_host"] = np.concatenate(
                [ramp[:n] for n in self.plan.physical_lengths])
        return offsets

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
