"""What a LLaVA micro-batch's packer knew, kept as host ints: the adapter checks and the boundary
patch expands from it without reading any tensor back (models/llava.py has the rules).

`llava_pack_plan` plans a pack in LLaVA's expanded space (checked by `check_expanded_total`).
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

from megatron_vlm_packing.packing.plan import PackMultiples, PackPlan, check_int32_total, round_up

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
    from megatron_vlm_packing.packing.indices import _to_device

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


def check_expanded_total(physical: list[int], *, segment: int, total_multiple: int, pad_to: int | None,
                         max_length: int | None) -> int:
    """The expanded total after `pad_to`, checking every multiple and int32 boundaries (T < 2**31);
    ValueError naming the numbers."""
    bad = [(i, n) for i, n in enumerate(physical) if n % segment]
    if bad:
        raise ValueError(f"expanded documents {[i for i, _ in bad][:8]} have physical lengths "
                         f"{[n for _, n in bad][:8]} that do not divide by {segment}: plan the pack in expanded "
                         f"space (models.llava_pack.pack_llava_batch)")
    total = sum(physical)
    target = total if pad_to is None else pad_to
    if target < total:
        raise ValueError(f"the pack expands to {total} tokens but LLaVA pads rows to {pad_to}: it would truncate")
    check_int32_total(target)  # the collapsed plan's own check does not see the images
    if max_length is not None and target > max_length:
        raise ValueError(f"the pack expands to {target} tokens, more than language_max_sequence_length={max_length}: "
                         f"LLaVAModel would truncate it silently; split the micro-batch")
    if target % total_multiple:
        raise ValueError(f"the expanded pack has {target} tokens, not a multiple of LLaVA's shard factor "
                         f"{total_multiple}: plan the pack in expanded space (models.llava_pack.pack_llava_batch)")
    return target


def llava_pack_plan(row_lengths: list[int], *, row_capacity: int, row_expansion: list[int],
                    opens_with_image: list[bool], space: LlavaSpace, pad_to: int | None = None) -> PackPlan:
    """A collapsed-space plan whose expansion is aligned and loses no token.

    Each document i gets the fewest pad slots p_i such that
    - (real_i + p_i + expansion_i) divides by `space.segment_multiple` (its expanded physical length),
    - p_i >= 1 when document i+1 opens with an image (the slot LLaVA zeroes is then a pad),
    and the last document grows so the expanded total is `pad_to`, else `space.pipeline_length`,
    else the next multiple of `space.total_multiple`.

    Args:
        row_lengths: B collapsed real lengths; row_expansion: B extra embeddings of each row's images;
        opens_with_image: B, whether row b's first token is an image.
        pad_to: expanded total wanted (static shapes).

    Returns:
        PackPlan in collapsed space (`multiples` = 1: the multiples hold after expansion instead).

    Example (img_seq_len 4, one tile each, 2*cp = 4): rows [A=3 text, B=[<image>, t]] ->
        A gets 1 pad (B opens with an image), B expands 2 -> 5, padded to 8: physical (4, 5),
        expanded (4, 8).
    """
    rows = [b for b, n in enumerate(row_lengths) if n > 0]
    if not rows:
        raise ValueError(f"the batch has no real tokens ({len(row_lengths)} rows, all empty): nothing to pack")
    seg = space.segment_multiple
    physical = []
    for k, b in enumerate(rows):
        next_opens = k + 1 < len(rows) and opens_with_image[rows[k + 1]]
        collapsed = row_lengths[b] + (1 if next_opens else 0)
        physical.append(collapsed + (-(collapsed + row_expansion[b])) % seg)
    expanded = [p + row_expansion[b] for p, b in zip(physical, rows)]
    wanted = pad_to if pad_to is not None else space.pipeline_length
    if wanted is None:
        wanted = round_up(sum(expanded), space.total_multiple)
    target = check_expanded_total(expanded, segment=seg, total_multiple=space.total_multiple, pad_to=wanted,
                                  max_length=space.max_length)
    physical[-1] += target - sum(expanded)
    return PackPlan(row_lengths=tuple(int(n) for n in row_lengths), row_capacity=row_capacity,
                    segment_rows=tuple(rows), real_lengths=tuple(row_lengths[b] for b in rows),
                    physical_lengths=tuple(physical), multiples=PackMultiples())
