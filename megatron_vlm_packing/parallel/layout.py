"""`ParallelLayout`: the parallel sizes a micro-batch is aligned and partitioned for, as host ints.

Process groups are looked up once, at the edge (`from_megatron`); everything below takes ints.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_vlm_packing.packing.bounds import is_int


@dataclass(frozen=True)
class ParallelLayout:
    """Attributes:
        tp_size: tensor-parallel size.
        cp_size: context-parallel size.
        cp_rank: this rank's context-parallel rank, in [0, cp_size).
        sequence_parallel: activations are split over TP ranks along the sequence.
    """

    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tp_size", "cp_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy int as its int
        if not is_int(self.cp_rank) or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"ParallelLayout.cp_rank must be in [0, {self.cp_size}), got {self.cp_rank!r}")
        object.__setattr__(self, "cp_rank", int(self.cp_rank))
        if not isinstance(self.sequence_parallel, bool):  # "no" was kept, and read as on
            raise ValueError(f"ParallelLayout.sequence_parallel must be a bool, got {self.sequence_parallel!r}")

    @classmethod
    def from_megatron(cls, config) -> "ParallelLayout":
        """This rank's layout from Megatron-Core's parallel state and the model's config."""
        from megatron.core import parallel_state as ps

        return cls(tp_size=ps.get_tensor_model_parallel_world_size(), cp_size=ps.get_context_parallel_world_size(),
                   cp_rank=ps.get_context_parallel_rank(), sequence_parallel=bool(config.sequence_parallel))
