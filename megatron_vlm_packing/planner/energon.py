"""Megatron-Energon packing hooks: `select_samples_to_pack` / `pack_selected_samples`.

`EnergonPackingHooks` implements both from per-sample metadata: groups are cost-balanced bins of the
layout's capacity (never truncated; an oversize sample is an error or a bin of its own), and a group
becomes one `MicroBatch` through the user's collate (samples -> right-padded batch dict) and
`pack_batch(..., pad_to=capacity)`. `PlannedPackingMixin` lends them, and `batch`, to a task encoder.

Energon's contract, as megatron-energon 7.4.1's `TaskEncoder.build_batch` and `PackingDataset` implement
it (tests/planner/test_planner_energon_real.py drives these hooks through it):
- With `packing_buffer_size=N`, each DataLoader worker of each rank fills its own buffer of N samples
  (fewer at the end of its data) as `encode_sample` (or `preencode_sample`) returned them and calls
  `select_samples_to_pack(buffer)`; then `pack_selected_samples(group)` once per returned non-empty group,
  one group per yielded pack, after `postencode_sample` where the encoder defines it (so `metadata` and
  `collate` must read that form too). The packs then go through `batch` (`batch_size` packs, or none
  when `batch_size=None`); Energon's default `batch` fails on a `MicroBatch`, the mixin's returns the pack.
- The samples `select_samples_to_pack` does not return are dropped (nothing is kept for a later
  buffer), and one returned twice is packed twice: every sample of the buffer is in exactly one group.
- A hook's exception goes to the worker config's `global_error_handler` (default: log it) and what the
  hook was given is dropped: the whole buffer for `select_samples_to_pack`, the group for
  `pack_selected_samples`, the packs for `batch`; Energon raises after `failure_tolerance` (default 100)
  failures in a row, and re-raises its `FatalSampleError` (and system errors) at once. The mixin turns
  every ValueError of its methods (an oversize sample under oversize="error", a group over the capacity,
  bad metadata, `pack_batch`'s refusals) into a FatalSampleError, so none costs a buffer silently; the
  checks that do not depend on the data run at construction.
- Energon's state (`save_state_rank`) holds the restore keys of the buffered samples, those not yet
  selected and the groups selected but not yet packed; after `restore_state_rank` they are re-read and
  re-encoded (`encode_sample` must be `@stateless`, as the default is) and the groups packed by
  `pack_selected_samples` as saved. A group saved under a larger capacity is refused here, not packed
  over this one. The hooks hold no state of their own; `@stateless` (the `__stateless__` flag, set here
  without importing Energon) is recorded for the final packer but needed only to restore a single pack
  from its restore key, which a `MicroBatch` does not carry.

Each worker's buffer is balanced on its own: bins of a buffer against each other, not ranks against
ranks; `PackedBatchSampler` has the global view for that.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from megatron_vlm_packing.packing.batch import check_pack_options, pack_batch, tensor_off_host
from megatron_vlm_packing.packing.collate import for_the_loader
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.planner.bins import BinLayout, balanced_fit
from megatron_vlm_packing.planner.cost import CostModel, check_cost_model, checked_extra_costs
from megatron_vlm_packing.planner.metadata import ExpandedTokens, SampleMetadata, SampleTable, TokenCounter, count_array

_PARALLEL_KEYS = ("tp_size", "cp_size", "sequence_parallel", "fp8")


@dataclass(frozen=True, kw_only=True)
class EnergonPackingHooks:
    """The two Energon packing methods, from metadata and a collate.

    Attributes:
        metadata: encoded sample -> `SampleMetadata` (from its token ids and grids; no pixels read).
        collate: list of encoded samples -> right-padded batch dict that `pack_batch` accepts.
        layout: bin capacity and alignment; must match `pack_kwargs`' parallel sizes.
        pack_kwargs: keyword arguments of `pack_batch` (tp_size, cp_size, sequence_parallel, fp8,
            label_style, mrope, pad_token_id); `pad_to` is the layout's.
    """

    metadata: Callable[[Any], SampleMetadata]
    collate: Callable[[list], dict]
    layout: BinLayout
    cost_model: CostModel = field(default_factory=CostModel.qwen2_5_vl_7b)
    expanded_tokens: ExpandedTokens = field(default_factory=TokenCounter)
    pack_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked here, before any buffer (hooks bound without the mixin: Energon logs and drops the buffer).
        for name in ("metadata", "collate", "expanded_tokens"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.layout, BinLayout):
            raise ValueError(f"layout must be a BinLayout, got {type(self.layout).__name__}")
        check_cost_model(self.cost_model)
        if isinstance(self.pack_kwargs, dict) and "pad_to" in self.pack_kwargs:  # (not a dict: named below)
            raise ValueError("pack_kwargs must not set pad_to: bins are padded to the layout's capacity")
        check_pack_options(self.pack_kwargs, "EnergonPackingHooks", taken=("pad_to",))
        multiples = PackMultiples.for_parallel(**{k: self.pack_kwargs[k] for k in _PARALLEL_KEYS
                                                  if k in self.pack_kwargs})
        if multiples != self.layout.multiples:
            raise ValueError(f"pack_kwargs give multiples {multiples} but the layout has {self.layout.multiples}")

    def select_samples_to_pack(self, samples: list) -> list[list]:
        """Partition a buffer into bins (lists of the same sample objects), cost-balanced."""
        if not samples:
            return []
        table, tokens = self._tokens(samples)
        slots = self.layout.slot_sizes(tokens)
        over = self.layout.check_oversize(slots, np.arange(len(samples)))
        fits = np.setdiff1d(np.arange(len(samples)), over)
        groups = []
        if len(fits):
            num_bins = -(-int(slots[fits].sum()) // self.layout.capacity)
            extra = checked_extra_costs(self.cost_model, table, tokens)[fits]
            if not self.layout.static_shapes:  # bins of different lengths: their GEMMs differ too
                extra = extra + self.cost_model.lm_linear * slots[fits]
            bins = balanced_fit(slots[fits], extra, self.layout.capacity, num_bins)
            groups = [[int(fits[p]) for p in g] for g in bins]
        return [[samples[i] for i in g] for g in groups + [[int(p)] for p in over]]

    def pack_selected_samples(self, samples: list) -> MicroBatch:
        """One bin -> one packed micro-batch, padded to the capacity (static) or aligned (dynamic).

        ValueError for a group of several samples that does not fit the capacity, or one sample over it
        under oversize="error": Energon restores the groups it had selected from its checkpoint, and
        groups selected under another layout would become packs longer than this one's capacity.
        """
        if not samples:
            raise ValueError("pack_selected_samples got a group of 0 samples: a pack needs at least one")
        sample_slots = self.layout.slot_sizes(self._tokens(samples)[1])
        slots = int(sample_slots.sum())
        if len(samples) == 1:  # a restored oversize sample: its own pack under "own_bin" only
            self.layout.check_oversize(sample_slots, np.arange(1))
        elif slots > self.layout.capacity:
            raise ValueError(f"a group of {len(samples)} samples takes {slots} slots but the capacity is "
                             f"{self.layout.capacity}: it was not selected under this layout (a checkpoint "
                             f"saved under a larger capacity?)")
        batch = self.collate(samples)
        pad_to = self.layout.physical(slots) if self.layout.static_shapes else None
        on_host = tensor_off_host(batch) is None  # a loader worker's batch
        packed = pack_batch(batch, pad_to=pad_to, **{"host_reads": on_host, **self.pack_kwargs})
        # In a loader worker: CP indices built there, one storage to send and move, pinnable.
        return for_the_loader(packed, self.pack_kwargs.get("cp_size", 1)) if on_host else packed

    def _tokens(self, samples: list) -> tuple[SampleTable, np.ndarray]:
        """The samples' metadata table and [N] int64 expanded tokens, each checked (ValueError naming it)."""
        described = [self.metadata(s) for s in samples]
        for i, meta in enumerate(described):
            if not isinstance(meta, SampleMetadata):
                raise ValueError(f"metadata returned {type(meta).__name__} for sample {i} of the buffer; "
                                 f"expected SampleMetadata")
        table = SampleTable.from_samples(described)
        tokens = count_array(self.expanded_tokens(table), "expanded_tokens").reshape(-1)  # 7.5 is no count
        if len(tokens) != len(samples):
            raise ValueError(f"expanded_tokens returned {len(tokens)} counts for a buffer of {len(samples)} samples")
        if tokens.min() < 1:
            raise ValueError(f"sample {int(np.argmin(tokens))} of the buffer has {int(tokens.min())} tokens")
        return table, tokens


class PlannedPackingMixin:
    """Mixin for a Megatron-Energon task encoder: set the class attribute `packing_hooks`.

    Put it before Energon's `TaskEncoder` / `DefaultTaskEncoder` in the bases (its methods must win). It lends
    `select_samples_to_pack`, `pack_selected_samples` and `batch` (a pack is one micro-batch: build the dataset
    with `batch_size=1` or `None`); a ValueError from any of them reaches Energon as its `FatalSampleError`.
    """

    packing_hooks: EnergonPackingHooks

    def select_samples_to_pack(self, samples: list) -> list[list]:
        with _fatal_under_energon():
            return self._packing_hooks().select_samples_to_pack(samples)

    def pack_selected_samples(self, samples: list) -> MicroBatch:
        with _fatal_under_energon():
            return self._packing_hooks().pack_selected_samples(samples)

    def batch(self, samples: list) -> MicroBatch:
        """Energon's batch stage: the one pack itself. Energon's default batched the MicroBatch's fields as
        a generic dataclass and failed (TypeError) on every pack, each logged and dropped by its handler."""
        with _fatal_under_energon():
            if len(samples) != 1:
                raise ValueError(f"batch got {len(samples)} packs: a packed micro-batch is one pack, so build the "
                                 f"Energon dataset with batch_size=1 or batch_size=None")
            return samples[0]

    def _packing_hooks(self) -> EnergonPackingHooks:
        hooks = getattr(self, "packing_hooks", None)  # unset: an AttributeError at the first buffer
        if not isinstance(hooks, EnergonPackingHooks):
            raise ValueError(f"{type(self).__name__}.packing_hooks must be an EnergonPackingHooks (set it on the "
                             f"class or in __init__), got {'nothing' if hooks is None else repr(hooks)}")
        return hooks

    # What Energon's @stateless sets (without importing Energon): pure functions of the samples (no RNG, no
    # state). Energon records the final packer's and the batch's flag; neither is needed to save or restore.
    select_samples_to_pack.__stateless__ = True
    pack_selected_samples.__stateless__ = True
    batch.__stateless__ = True


@contextmanager
def _fatal_under_energon() -> Iterator[None]:
    """Re-raise a ValueError as Energon's FatalSampleError (a ValueError too) where Energon is installed.

    Energon's error handler logs any other exception of a hook and drops what the hook was given: the whole
    buffer for `select_samples_to_pack` (one oversize sample under oversize="error" cost every sample of its
    buffer, and training went on), the group for `pack_selected_samples`. Its FatalSampleError it re-raises.
    """
    try:
        yield
    except ValueError as error:
        try:
            from megatron.energon.errors import FatalSampleError
        except ImportError:  # no Energon: the plain ValueError
            raise error from None
        if isinstance(error, FatalSampleError):
            raise
        raise FatalSampleError(str(error)) from error
