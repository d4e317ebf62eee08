"""What a LLaVA micro-batch's packer knew, kept as host ints: the adapter checks and the boundary
patch expands from it without reading any tensor back (models/llava.py has the rules).

`LlavaPackPlan` (packed, `pack_llava_batch`) and `LlavaRows` (dense, `pad_llava_batch`) are the
micro-batch's `plan`; `PlannedPackedSeqParams` carries a `LlavaPackPlan` to the patch, which calls
`expanded_packed_seq_params`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.packing.plan import PackPlan

if TYPE_CHECKING:
    from megatron_vlm_packing.models.llava import LlavaSpace


@dataclass(frozen=True)
class LlavaPackPlan(PackPlan):
    """A `llava_pack_plan` with what LLaVA does to each document, all host ints (read once, when packing).

    With it the adapter checks tiles and leaks, and the boundary patch expands the boundaries
    (`expanded_packed_seq_params`), without reading any tensor back: no host sync after packing.

    Attributes:
        space: the `LlavaSpace` the plan was made for (its total multiple includes FP8's).
        tiles: I tiles of every image, in token order.
        images_per_document: N images of each document.
        expansion: N extra embeddings of each document's images (the expanded physical and real
            lengths are the collapsed ones plus these).
        opens_with_image: N, whether each document's first token is an image.
    """

    space: LlavaSpace
    tiles: tuple[int, ...]
    images_per_document: tuple[int, ...]
    expansion: tuple[int, ...]
    opens_with_image: tuple[bool, ...]

    @property
    def expanded_physical(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.physical_lengths, self.expansion))

    @property
    def expanded_real(self) -> tuple[int, ...]:
        return tuple(r + e for r, e in zip(self.real_lengths, self.expansion))

    def leaking_documents(self) -> list[int]:
        """`leaking_documents` from the plan: documents opening with an image after a document with no pad."""
        return [i for i in range(1, self.num_segments) if self.opens_with_image[i]
                and self.physical_lengths[i - 1] == self.real_lengths[i - 1]]


@dataclass(frozen=True)
class LlavaRows:
    """The `plan` of a dense LLaVA micro-batch (`pad_llava_batch`): what the rows hold, as host ints.

    Attributes:
        tiles: I tiles of every image, in token order; expanded_lengths: B real lengths after expansion.
    """

    tiles: tuple[int, ...]
    expanded_lengths: tuple[int, ...]


@dataclass
class PlannedPackedSeqParams(PackedSeqParams):
    """Collapsed-space `PackedSeqParams` with the `LlavaPackPlan` they came from (what `LLaVAAdapter`
    passes): `patches.llava_boundaries` expands them from the plan's host ints, with no host sync,
    instead of reading the image tokens back (`remap_packed_seq_params`)."""

    llava_plan: LlavaPackPlan | None = None


def planned_packed_seq_params(plan: LlavaPackPlan, collapsed: PackedSeqParams) -> PlannedPackedSeqParams:
    fields = {f.name: getattr(collapsed, f.name) for f in dataclasses.fields(PackedSeqParams) if f.init}
    return PlannedPackedSeqParams(**fields, llava_plan=plan)


def expanded_packed_seq_params(plan: LlavaPackPlan, collapsed: PackedSeqParams) -> PackedSeqParams:
    """The expanded boundaries of `plan`'s pack, from host ints (one small non-blocking copy, no sync).

    Equal to `remap_packed_seq_params(collapsed, ...)` for the plan's micro-batch; every field other
    than the boundaries and `max_seqlen_*` is `collapsed`'s.
    """
    from megatron_vlm_packing.packing.plan import _to_device

    real, physical = [0], [0]
    for r, p in zip(plan.expanded_real, plan.expanded_physical):
        real.append(real[-1] + r)
        physical.append(physical[-1] + p)
    cu = collapsed.cu_seqlens_q
    both = _to_device(torch.tensor([real, physical] if real != physical else [real], dtype=cu.dtype), cu.device)
    fields = {f.name: getattr(collapsed, f.name) for f in dataclasses.fields(PackedSeqParams) if f.init}
    longest = max(plan.expanded_physical)
    # One tensor for both sets when no document has pad slots (as `PackIndices`: TE's pad_between_seqs check).
    cu_real = both[0]
    cu_padded = both[1] if real != physical else cu_real
    fields.update(cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu_padded,
                  cu_seqlens_kv_padded=cu_padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    return PackedSeqParams(**fields)
