"""What the epoch planner takes besides the samples (`PlannerConfig`) and what it returns (`EpochPlan`, of `Step`s).

Plain frozen dataclasses, checked when made, so a bad setting is a ValueError naming it before any
planning; `plan_epoch` (`schedule.py`) makes the plans, `PackedBatchSampler` (`sampler.py`) and
`EnergonPackingHooks` read them.

Shape legend: R = data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.row_fields import check_flags
from megatron_vlm_packing.planner.balance import imbalance
from megatron_vlm_packing.planner.bins import Bin, BinLayout
from megatron_vlm_packing.planner.cost import CostModel, check_cost_model
from megatron_vlm_packing.planner.metadata import ExpandedTokens, TokenCounter


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What the planner needs besides the samples.

    Attributes:
        layout: bin capacity, alignment, static shapes, oversize policy.
        dp_size: data-parallel ranks R.
        micro_batches_per_rank: M, bins each rank runs per optimizer step.
        window_steps: steps planned together; larger balances better, drifts further from random.
        seed: seeds the permutation (with the epoch) and the order of steps in a window.
        shuffle: permute the dataset each epoch (False: dataset order).
        balance: balance cost over ranks (False: the unbalanced baseline).
        tail: the epoch's last samples (less than a step): "short_step" (one step with fewer
            micro-batches per rank, bins less full) or "carry" (they lead the next epoch; those of
            the last epoch a run trains are never trained: `PackedBatchSampler.carried_over()` names them).
        samples_per_step: a fixed number of samples per optimizer step (what sample-based LR
            schedules assume); each step then runs as many micro-batches per rank as its samples
            need (variable), spread over R * m bins of balanced cost (bins are then less full: pair
            it with dynamic shapes). None: a fixed number of bins
            (`micro_batches_per_rank`) per step and a variable number of samples.
        cost_model: per-bin cost; expanded_tokens: tokens per sample in the space attention sees.
    """

    layout: BinLayout
    dp_size: int = 1
    micro_batches_per_rank: int = 1
    window_steps: int = 8
    seed: int = 0
    shuffle: bool = True
    balance: bool = True
    tail: str = "short_step"
    samples_per_step: int | None = None
    cost_model: CostModel = field(default_factory=CostModel.qwen2_5_vl_7b)
    expanded_tokens: ExpandedTokens = field(default_factory=TokenCounter)

    def __post_init__(self) -> None:
        # Checked here, not as an AttributeError / TypeError at planning; True was 1 and "no" a truthy flag.
        if not isinstance(self.layout, BinLayout):
            raise ValueError(f"layout must be a BinLayout, got {type(self.layout).__name__}")
        check_cost_model(self.cost_model)
        if not callable(self.expanded_tokens):
            raise ValueError(f"expanded_tokens must be callable (table -> [N] tokens), got "
                             f"{type(self.expanded_tokens).__name__}")
        check_flags(shuffle=self.shuffle, balance=self.balance)
        for name in ("dp_size", "micro_batches_per_rank", "window_steps"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy int kept as a Python int
        if self.samples_per_step is not None and (not is_int(self.samples_per_step)
                                                  or self.samples_per_step < self.dp_size):
            raise ValueError(f"samples_per_step must be an int >= dp_size={self.dp_size}, got {self.samples_per_step!r}")
        if self.samples_per_step is not None:
            object.__setattr__(self, "samples_per_step", int(self.samples_per_step))
        if not is_int(self.seed) or self.seed < 0:
            # numpy's generator takes no negative seed: the error came at planning, naming no field
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # a numpy seed went into the sampler's state_dict as is
        if self.tail not in ("short_step", "carry"):
            raise ValueError(f"tail must be 'short_step' or 'carry', got {self.tail!r}")

    @property
    def bins_per_step(self) -> int:
        return self.dp_size * self.micro_batches_per_rank


@dataclass(frozen=True)
class Step:
    """One optimizer step: `ranks[r]` is the tuple of bins (micro-batches) rank r runs."""

    ranks: tuple[tuple[Bin, ...], ...]

    def rank_costs(self) -> np.ndarray:
        """[R] float64."""
        return np.asarray([sum(b.cost for b in bins) for bins in self.ranks], dtype=np.float64)

    @property
    def imbalance(self) -> float:
        return imbalance(self.rank_costs())


@dataclass(frozen=True)
class EpochPlan:
    """Steps of one epoch, and the samples it hands to the next (its last ones, fewer than a step needs)."""

    epoch: int
    steps: tuple[Step, ...]
    carried: tuple[int, ...] = ()

    def bins(self) -> list[Bin]:
        return [b for step in self.steps for bins in step.ranks for b in bins]

    def micro_batches(self, rank: int) -> list[Bin]:
        """The bins rank `rank` runs this epoch, in order."""
        return [b for step in self.steps for b in step.ranks[rank]]

    def fill(self) -> float:
        """Real tokens / physical tokens over every bin."""
        bins = self.bins()
        return sum(b.real_tokens for b in bins) / max(1, sum(b.physical for b in bins))
