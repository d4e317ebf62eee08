"""Megatron-Energon packing hooks: `select_samples_to_pack` / `pack_selected_samples`.

Energon calls `select_samples_to_pack(samples)` with a buffer of `packing_buffer_size` encoded
samples and `pack_selected_samples(samples)` once per returned group (method names as in
Energon's TaskEncoder documentation). `EnergonPackingHooks` implements both from per-sample
metadata: groups are cost-balanced bins of the layout's capacity (never truncated; an oversize
sample is an error or a bin of its own), and a group becomes one `MicroBatch` through the user's
collate (samples -> right-padded batch dict) and `pack_batch(..., pad_to=capacity)`.

Energon's contract, as its `PackingDataset` implements it: the samples `select_samples_to_pack`
does not return are dropped (nothing is kept for a later buffer), so every sample of the buffer is
returned in exactly one group; a hook that raises has its error logged by Energon's error handler
and the whole buffer dropped (fatal after `failure_tolerance` failures in a row), so the checks
that do not depend on the data run at construction, and `oversize="error"` under Energon drops the
buffer of an oversize sample (with a log line naming it): use `oversize="own_bin"` to keep it.
Energon's checkpoint stores the selected groups and packs them after a restore; the hooks hold no
state of their own (the mixin marks both methods stateless, as Energon's `@stateless` would).

Energon fills each rank's buffer on its own, so these hooks balance the bins of a buffer against
each other, not ranks against ranks; `PackedBatchSampler` has the global view for that.

Energon is not imported: the hooks are plain callables, and `PlannedPackingMixin` lends them to a
task encoder class that sets `packing_hooks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

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
        # Checked here: under Energon, an error in the first buffer is logged and the buffer dropped.
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
    """Mixin for a Megatron-Energon task encoder: set the class attribute `packing_hooks`."""

    packing_hooks: EnergonPackingHooks

    def select_samples_to_pack(self, samples: list) -> list[list]:
        return self._packing_hooks().select_samples_to_pack(samples)

    def pack_selected_samples(self, samples: list) -> MicroBatch:
        return self._packing_hooks().pack_selected_samples(samples)

    def _packing_hooks(self) -> EnergonPackingHooks:
        hooks = getattr(self, "packing_hooks", None)  # unset: an AttributeError at the first buffer
        if not isinstance(hooks, EnergonPackingHooks):
            raise ValueError(f"{type(self).__name__}.packing_hooks must be an EnergonPackingHooks (set it on the "
                             f"class or in __init__), got {'nothing' if hooks is None else repr(hooks)}")
        return hooks

    # What Energon's @stateless sets (without importing Energon): both are pure functions of the samples
    # (no RNG, no state), so Energon may restore a pack from its restore key.
    select_samples_to_pack.__stateless__ = True
    pack_selected_samples.__stateless__ = True
