"""`PackedBatchSampler`: the epoch plan as a PyTorch batch sampler, one per data-parallel rank.

Each item is the list of dataset indices of one bin (one packed micro-batch) of this rank, in plan
order, so a `DataLoader(dataset, batch_sampler=sampler, collate_fn=...)` whose collate right-pads
the samples and calls `pack_batch(..., pad_to=capacity)` yields exactly the packs the planner
laid out. Every rank builds the same plan (same metadata, config and seed) and takes its share.

Where it plugs in:
- Megatron-LM (`--dataloader-type external`): build the DataLoader per rank with
  `dp_rank=parallel_state.get_data_parallel_rank()` and return its iterator from your
  `train_valid_test_datasets_provider`; Megatron then calls `forward_step` once per micro-batch.
- Megatron-Bridge: pass the DataLoader (or its iterator) where a custom dataset provider returns
  loaders; the step is the same.
Run `micro_batches_per_step()` micro-batches per optimizer step. Megatron's fixed global batch
(`--micro-batch-size 1 --global-batch-size M*DP`, one bin per micro-batch) matches
`micro_batches_per_rank=M` with `tail="carry"`: every step then has exactly M micro-batches per
rank. `tail="short_step"` and `samples_per_step` give steps of varying length, for loops that pass
`num_microbatches` per step to `get_forward_backward_func`.

Resume: `state_dict()` records the epoch, how many micro-batches this rank has taken, and the
samples carried in from the previous epoch; the plan is rebuilt from the seed and iteration resumes
at the next micro-batch. With prefetching loaders the sampler runs ahead of training: pass the
count actually trained to `state_dict(consumed=...)`: a count above the micro-batches this epoch
has yielded so far means the sampler has already moved on while training finishes the previous
epoch (a DataLoader prefetches across the boundary), and the state is that of the previous epoch.
`set_epoch` on the epoch a `load_state_dict` resumed keeps its place (the usual
`for epoch in ...: sampler.set_epoch(epoch)` loop after a resume would otherwise repeat it).
`len(sampler)` (a DataLoader's len) counts what the next iteration yields: after a resume, the rest
of the epoch; once the epoch is done or `set_epoch` starts another, all of the next one.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch.utils.data

from megatron_vlm_packing.planner.metadata import SampleTable
from megatron_vlm_packing.planner.schedule import EpochPlan, PlannerConfig, plan_epoch


class PackedBatchSampler(torch.utils.data.Sampler):
    """Yields `list[int]` sample indices per micro-batch of rank `dp_rank`, epoch after epoch.

    Args:
        table: metadata of every sample of the dataset (index i = dataset index i).
        config: the planner configuration (its `dp_size` is the number of ranks).
        dp_rank: this rank, 0 <= dp_rank < config.dp_size.
        progress: draw a progress line on stderr while planning.
    """

    def __init__(self, table: SampleTable, config: PlannerConfig, *, dp_rank: int, progress: bool = False) -> None:
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < config.dp_size:
            raise ValueError(f"dp_rank={dp_rank!r} must lie in [0, {config.dp_size})")
        self.table, self.config, self.dp_rank, self.progress = table, config, dp_rank, progress
        self._epoch, self._position, self._carried = 0, 0, ()
        self._plan: EpochPlan | None = None
        # (epoch, carried into it, micro-batches of this rank) of the epoch iteration last finished:
        # a prefetching loader ends an epoch before training does, and state_dict(consumed=) may
        # still count micro-batches of it.
        self._previous: tuple[int, tuple[int, ...], int] | None = None
        self._resumed = False  # the position came from load_state_dict (set_epoch keeps it)

    def plan(self) -> EpochPlan:
        """The plan of the current epoch (built once per epoch)."""
        if self._plan is None or self._plan.epoch != self._epoch:
            self._plan = plan_epoch(self.table, self.config, epoch=self._epoch, carried_in=self._carried,
                                    progress=self.progress)
        return self._plan

    def micro_batches_per_step(self) -> list[int]:
        """Micro-batches every rank runs in each step of the current epoch."""
        return [len(step.ranks[self.dp_rank]) for step in self.plan().steps]

    def __len__(self) -> int:
        """Micro-batches the next iteration yields: the rest of the current epoch (all of it, unless a
        `load_state_dict` or a paused iteration has already taken its first ones)."""
        return self._epoch_length() - self._position

    def _epoch_length(self) -> int:
        """Micro-batches of this rank in the whole current epoch."""
        return sum(self.micro_batches_per_step())

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch; when it is exhausted, the sampler moves to the next epoch."""
        plan = self.plan()
        bins = plan.micro_batches(self.dp_rank)
        while self._position < len(bins):
            self._position += 1
            yield list(bins[self._position - 1].samples)
        self._previous = (self._epoch, self._carried, len(bins))
        self._epoch, self._position, self._carried = self._epoch + 1, 0, plan.carried
        self._resumed = False

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (samples carried so far stay carried); the epoch a
        `load_state_dict` resumed keeps its place instead (its first micro-batches were trained)."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if self._resumed and int(epoch) == self._epoch:
            return
        self._epoch, self._position, self._resumed, self._previous = int(epoch), 0, False, None

    def state_dict(self, consumed: int | None = None) -> dict:
        """Where this rank stands: epoch, micro-batches taken (or `consumed`), carried samples.

        `consumed` above the micro-batches yielded in this epoch counts micro-batches of the epoch
        the sampler just finished (a prefetching loader runs ahead over the epoch boundary); more
        than either epoch yielded is a ValueError (resuming there would skip samples).
        """
        epoch, position, carried = self._epoch, self._position, self._carried
        if consumed is not None:
            consumed = int(consumed)
            if 0 <= consumed <= position:
                position = consumed
            elif self._previous is not None and position < consumed <= self._previous[2]:
                # Training is still in the previous epoch; resuming at the new one would skip the
                # rest of the previous epoch and the first `consumed` micro-batches of this one.
                epoch, carried, _ = self._previous
                position = consumed
                if consumed == self._previous[2]:  # the previous epoch is done: the new one from 0
                    epoch, position, carried = self._epoch, 0, self._carried
            else:
                limit = position if self._previous is None else max(position, self._previous[2])
                raise ValueError(f"consumed={consumed} must lie in [0, {limit}]: this rank's sampler has yielded "
                                 f"{position} micro-batch(es) of epoch {self._epoch}"
                                 + (f" after {self._previous[2]} of epoch {self._previous[0]}"
                                    if self._previous is not None else ""))
        return {
            "epoch": epoch,
            "position": position,
            "carried": list(carried),
            "seed": self.config.seed,
            "num_samples": len(self.table),
            "dp_size": self.config.dp_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`; ValueError if it was written for another dataset size, seed or DP size."""
        for key, mine in (("seed", self.config.seed), ("num_samples", len(self.table)),
                          ("dp_size", self.config.dp_size)):
            if state.get(key) != mine:
                raise ValueError(f"sampler state has {key}={state.get(key)!r} but this sampler has {mine!r}")
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._carried = tuple(int(i) for i in state["carried"])
        self._plan = None
        self._previous, self._resumed = None, True
        if not 0 <= self._position <= self._epoch_length():  # e.g. written under another micro_batches_per_rank
            raise ValueError(f"sampler state has position={self._position} but epoch {self._epoch} has "
                             f"{self._epoch_length()} micro-batch(es) on this rank (same seed, DP size and dataset size: "
                             f"has the layout or micro_batches_per_rank changed?)")
