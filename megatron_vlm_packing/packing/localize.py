"""`localize`: the one place where a micro-batch is cut to this context-parallel rank's tokens.

Contract item 5: one CP index (TransformerEngine's zigzag per physical document, or per dense
row) is applied to every sequence-aligned tensor. Whether `input_ids` and `position_ids` stay full
length is what the model's adapter declares (`LocalizeNeeds`), never guessed from a tensor's rank:
a model that merges vision embeddings needs the full ids and selects its CP tokens itself, with
the `cp_index` carried on the result. Before cutting anything it checks, from metadata and shapes only,
the packed boundaries (`packed_params_checks.check_packed_seq_params`) and every field it cuts (here).

Shape legend: T = physical tokens of the whole pack, Tl = T / cp; dense rows [B, L] -> [B, L / cp].
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import torch

from megatron_vlm_packing.attention.boundaries import physical_boundary_set
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.packing.indices import PackIndices
from megatron_vlm_packing.packing.packed_params_checks import check_packed_seq_params, plan_indices_of
from megatron_vlm_packing.packing.plan import PackPlan
from megatron_vlm_packing.parallel.cp import cp_partition_index, dense_cp_partition_index
from megatron_vlm_packing.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class LocalizeNeeds:
    """Which sequence-aligned fields a model wants full length under CP (the rest become rank-local).

    Attributes:
        full_input_ids: the model embeds the whole sequence (to place vision/audio embeddings) and
            selects its CP tokens itself with `MicroBatch.cp_index`.
        full_position_ids: the model takes positions for the whole sequence (e.g. a rotary that
            returns the full frequency table and lets THD attention take each document's chunks).
        full_labels: labels, loss mask and padding mask stay full too: the model changes the
            sequence length (LLaVA expands each image token) and applies the CP selection itself.
    """

    full_input_ids: bool = False
    full_position_ids: bool = False
    full_labels: bool = False


def packed_cp_index(micro_batch: MicroBatch, layout: ParallelLayout) -> torch.Tensor:
    """This rank's slots: from the plan's host ints when the boundaries are the plan's own (no host
    sync; a loader's collate may have built it already), else read from `cu_seqlens_q_padded`
    (`cu_seqlens_q` when it is None)."""
    indices = plan_indices_of(micro_batch)
    if indices is not None:
        return indices.cp_index(layout.cp_size, layout.cp_rank)
    _, cu_padded = physical_boundary_set(micro_batch.packed_seq_params)
    return cp_partition_index(cu_padded, layout.cp_size, layout.cp_rank)


def check_lengths(fields: dict[str, torch.Tensor], total: int, *, dim: int = -1,
                  source: str = "the CP index") -> None:
    """Every field the CP index is applied to must hold the `total` slots it indexes (shapes only).

    `index_select` of a [.., T] index on a longer field silently dropped its tail (a labels tensor
    twice as long, a pack longer than `cu_seqlens_q_padded[-1]`); this names the field and both lengths.
    `source` says where `total` comes from (at CP = 1 no index is built: the plan, or a field).
    """
    wrong = {name: tuple(x.shape) for name, x in fields.items() if x.dim() == 0 or x.shape[dim] != total}
    if wrong:
        raise ValueError(f"{source} covers {total} slots but {wrong} have another "
                         f"length along dim {dim}: build every sequence-aligned field over the same {total} slots")


def _not_one_row(name: str, x: torch.Tensor, dim: int) -> bool:
    """A packed field that is not one row: [1, T] (`position_ids` [1, T] or mRoPE [3, 1, T]), or for an
    extra (`dim` 1) [1, T, ...]. Shapes only."""
    if dim == 1:
        return x.dim() < 2 or x.shape[0] != 1
    return x.dim() not in ((2, 3) if name == "position_ids" else (2,)) or x.shape[-2] != 1


def check_mrope_channels(position_ids: torch.Tensor | None) -> None:
    """3D positions ([3, 1, T] packed, [3, B, L] dense) hold the 3 mRoPE channels t, h, w (shapes only).

    A [1, 1, T] or [4, 1, T] tensor passed the one-row check: the rotary then broadcast one channel to
    all three (bug class 1) or read a channel that is not there.
    """
    if position_ids is not None and position_ids.dim() == 3 and position_ids.shape[0] != 3:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}: 3D positions are mRoPE's [3, 1, T] "
                         f"(dense [3, B, L]), one channel each for t, h, w, not {position_ids.shape[0]}")


def check_one_row(fields: dict[str, torch.Tensor], *, dim: int = -1) -> None:
    """A packed micro-batch is one row: its fields hold a batch dim of 1 (shapes only; `localize` checks
    mRoPE positions' 3 channels first, `check_mrope_channels`).

    Only the token dim was compared, so a hand-built [2, T] field passed (its rows cut as one, or
    broadcast against [1, T] ones) and [2, T/2] fields passed wherever T was taken from a field.
    """
    wrong = {name: tuple(x.shape) for name, x in fields.items() if _not_one_row(name, x, dim)}
    if wrong:
        raise ValueError(f"a packed micro-batch is one row of T slots: its fields are [1, T] (position_ids [1, T] "
                         f"or mRoPE [3, 1, T], extras [1, T, ...]), but {wrong} have another batch dim or rank")


def check_dense_rows(micro_batch: MicroBatch) -> None:
    """A dense micro-batch's fields hold the same B rows: [B, L] (position_ids [B, L] or [3, B, L],
    extras [B, L, ...]), and 3D positions 3 channels (shapes only).

    Only the token dim was compared, so a [2, L] labels beside [4, L] ids reached the model, broadcast
    or cut against the other rows.

    Raises:
        ValueError: naming each field and its row count (or a field with no row dim).
    """
    check_mrope_channels(micro_batch.position_ids)
    fields = {name: getattr(micro_batch, name) for name in _SEQUENCE_FIELDS}
    rows = {name: x.shape[-2] if x.dim() >= 2 else None for name, x in fields.items() if x is not None}
    rows.update({f"extras[{key!r}]": x.shape[0] if x.dim() >= 2 else None for key, x in micro_batch.extras.items()})
    if len(set(rows.values())) > 1 or None in rows.values():
        raise ValueError(f"a dense micro-batch's fields must all hold the same rows ([B, L]; position_ids [B, L] "
                         f"or [3, B, L]; extras [B, L, ...]), got rows {rows} (None: no row dim)")


_SEQUENCE_FIELDS = ("input_ids", "position_ids", "labels", "loss_mask", "padding_mask")


def check_field_types(micro_batch: MicroBatch) -> None:
    """Every sequence field and extra is a tensor (metadata only): a hand-built micro-batch with None or a
    list there was an AttributeError deep in a shape or device check.

    Raises:
        ValueError: naming each such field and its type.
    """
    wrong = {name: type(getattr(micro_batch, name)).__name__ for name in _SEQUENCE_FIELDS
             if not isinstance(getattr(micro_batch, name), torch.Tensor)}
    extras = micro_batch.extras
    if not isinstance(extras, Mapping):
        wrong["extras"] = type(extras).__name__
    else:
        wrong.update({f"extras[{key!r}]": type(x).__name__ for key, x in extras.items()
                      if not isinstance(x, torch.Tensor)})
    if wrong:
        raise ValueError(f"a micro-batch's sequence fields and extras are tensors, but {wrong} are not")
    if micro_batch.padding_mask.dtype != torch.bool:
        # An int mask: Megatron-Core's MoE router takes `~padding_mask` (-1 / -2 for 0 / 1), so its aux and z-loss
        # counted pad slots with negative weights, silently; the packers always make bool.
        raise ValueError(f"padding_mask must be torch.bool (True at pad slots), got {micro_batch.padding_mask.dtype}: "
                         f"a hand-built mask needs .bool()")


def _kept_full(needs: LocalizeNeeds) -> frozenset[str]:
    """The sequence fields `needs` keeps full length (`localize` neither cuts nor length-checks them)."""
    full = {"input_ids"} if needs.full_input_ids else set()
    full |= {"position_ids"} if needs.full_position_ids else set()
    full |= {"labels", "loss_mask", "padding_mask"} if needs.full_labels else set()
    return frozenset(full)


def check_sequence_lengths(micro_batch: MicroBatch, needs: LocalizeNeeds, total: int,
                           source: str = "the CP index") -> None:
    """The fields `localize` cuts (all but those `needs` keeps full; extras along dim 1) hold `total` slots,
    and, packed, one row each (`check_one_row`).

    Shapes only (no host read): shared by the CP > 1 path (`total` from the index it applies) and the
    CP = 1 one (`total` from the plan or a field), so a micro-batch built or changed by hand fails here,
    naming the field, not deep in the model (or broadcast silently).
    """
    full = _kept_full(needs)
    fields = {name: getattr(micro_batch, name) for name in _SEQUENCE_FIELDS if name not in full}
    extras = {f"extras[{key!r}]": value for key, value in micro_batch.extras.items()}
    if micro_batch.is_packed:
        check_one_row(fields)
        check_one_row(extras, dim=1)
    check_lengths(fields, total, source=source)
    check_lengths(extras, total, dim=1, source=source)


def check_field_devices(micro_batch: MicroBatch, needs: LocalizeNeeds, device: torch.device, what: str) -> None:
    """Every field `localize` cuts, the extras, and `input_ids` even when kept full (the model selects
    its embeddings with `cp_index`) are on `device`, the device of `what`. Metadata only (no host read).

    Raises:
        ValueError: names `what`, its device, and each field on another device.
    """
    full = _kept_full(needs) - {"input_ids"}
    fields = {name: getattr(micro_batch, name) for name in _SEQUENCE_FIELDS if name not in full}
    fields.update({f"extras[{key!r}]": value for key, value in micro_batch.extras.items()})
    wrong = {name: str(x.device) for name, x in fields.items() if x.device != device}
    if wrong:
        raise ValueError(f"{what} is on {device} but {wrong} are on another device: "
                         f"put the boundaries and every sequence-aligned field on one device")


def check_index_device(micro_batch: MicroBatch, needs: LocalizeNeeds, index: torch.Tensor, source: str) -> None:
    """The CP index is on the device of every field it is applied to (`check_field_devices`).

    Boundaries left on the CPU beside CUDA fields made `index_select` raise a RuntimeError far from
    the cause (and a meta field passed silently).
    """
    check_field_devices(micro_batch, needs, index.device, f"the CP index (from {source})")


def check_boundary_device(micro_batch: MicroBatch, needs: LocalizeNeeds) -> None:
    """At CP = 1 (no index is built) the boundaries are on the fields' device (`check_field_devices`;
    `check_packed_seq_params` put every boundary set on one device). A hand-built micro-batch with CPU
    boundaries and CUDA fields failed deep inside TE's attention, or synced silently."""
    name, cu = physical_boundary_set(micro_batch.packed_seq_params)
    check_field_devices(micro_batch, needs, cu.device, f"packed_seq_params.{name}")


def check_full_devices(micro_batch: MicroBatch) -> None:
    """With every field kept full at CP > 1 (no index is built): every sequence field on the device of the
    boundaries (packed; `check_packed_seq_params` put every set on one), or of `input_ids` (dense).
    Metadata only."""
    name, cu = physical_boundary_set(micro_batch.packed_seq_params) if micro_batch.is_packed \
        else ("input_ids", micro_batch.input_ids)
    if all(getattr(micro_batch, field).device == cu.device for field in _SEQUENCE_FIELDS):
        return  # the common case, without building the error's dicts
    check_field_devices(micro_batch, LocalizeNeeds(), cu.device,
                        f"packed_seq_params.{name}" if micro_batch.is_packed else name)


def _slots_without_index(micro_batch: MicroBatch, needs: LocalizeNeeds) -> tuple[int, str] | None:
    """T and where it comes from at CP = 1, from host ints and shapes only: the plan's total when the
    boundaries are the plan's own, else `input_ids`' length (dense rows, or ids that `localize` would
    cut), else the first field it would cut (hand-built boundaries are not read: a host sync; a 0-d field
    counts 0 slots, and `check_one_row` names it). None: every field stays full."""
    indices = plan_indices_of(micro_batch) if micro_batch.is_packed else None
    if indices is not None:
        return indices.plan.total, "the pack plan"
    full = _kept_full(needs)
    if not micro_batch.is_packed:
        full = full - {"input_ids"}  # the dense index is built over input_ids' length at CP > 1 too
    name = next((name for name in _SEQUENCE_FIELDS if name not in full), None)
    if name is None:
        return None
    field = getattr(micro_batch, name)
    return (field.shape[-1] if field.dim() else 0), name  # 0-d: not one row, as check_sequence_lengths says


def _cp_index(micro_batch: MicroBatch, layout: ParallelLayout) -> tuple[torch.Tensor, str]:
    """This rank's [T/cp] index (`packed_cp_index`, or the dense zigzag over `input_ids`' length) and
    what it was built from, for error messages."""
    if not micro_batch.is_packed:
        index = dense_cp_partition_index(micro_batch.input_ids.shape[-1], layout.cp_size, layout.cp_rank,
                                         device=micro_batch.input_ids.device)
        return index, "input_ids' length, on its device"
    name, _ = physical_boundary_set(micro_batch.packed_seq_params)
    return packed_cp_index(micro_batch, layout), f"packed_seq_params.{name}"


def _check_localizable(micro_batch: MicroBatch) -> None:
    """The checks every path of `localize` makes first, in this order (metadata and shapes only): not
    localized yet (`cp_index` None), every sequence field and extra a tensor (`check_field_types`), and
    packed: well-formed `packed_seq_params` and 3-channel mRoPE positions, kept full or cut; dense:
    the same B rows in every field (`check_dense_rows`)."""
    if micro_batch.cp_index is not None:
        raise ValueError("micro_batch is already localized to a CP rank (cp_index is set); localize it once")
    check_field_types(micro_batch)
    if micro_batch.is_packed:
        check_packed_seq_params(micro_batch)
        check_mrope_channels(micro_batch.position_ids)  # kept full or cut
    else:
        check_not_a_stripped_pack(micro_batch)
        check_dense_rows(micro_batch)


def check_not_a_stripped_pack(micro_batch: MicroBatch) -> None:
    """A micro-batch without `packed_seq_params` must not be a pack of several documents: one whose pack
    plan, indices or `rope_cu_seqlens` still count more than one lost its boundaries after packing (a
    `dataclasses.replace`), and its [1, T] row would train as one causal document. A pack of one
    document is one dense row (the parity probe runs a sample alone so). Metadata and host ints only.

    Raises:
        ValueError: naming the fields that count several documents, and their counts.
    """
    counts = {}
    if isinstance(micro_batch.plan, PackPlan):
        counts["plan"] = micro_batch.plan.num_segments
    if isinstance(micro_batch.indices, PackIndices):
        counts["indices"] = micro_batch.indices.plan.num_segments
    if isinstance(micro_batch.rope_cu_seqlens, torch.Tensor):
        counts["rope_cu_seqlens"] = micro_batch.rope_cu_seqlens.numel() - 1
    several = {name: n for name, n in counts.items() if n > 1}
    if several:
        raise ValueError(f"packed_seq_params is None but the micro-batch is packed: {several} documents "
                         f"(plan / indices / rope_cu_seqlens); without its boundaries the pack would train as "
                         f"one causal document: keep packed_seq_params (or build it dense with pad_batch)")


def _check_without_index(micro_batch: MicroBatch, needs: LocalizeNeeds) -> None:
    """At CP = 1 (no index is built): packed boundaries on the fields' device (`check_boundary_device`),
    then the fields `localize` would cut hold the T slots of `_slots_without_index` (host ints and shapes
    only; nothing to check when every field stays full)."""
    if micro_batch.is_packed:
        check_boundary_device(micro_batch, needs)
    slots = _slots_without_index(micro_batch, needs)
    if slots is not None:
        check_sequence_lengths(micro_batch, needs, *slots)


def _model_selects_its_tokens(micro_batch: MicroBatch, needs: LocalizeNeeds) -> bool:
    """Every sequence field kept full and no extras: the model selects its CP tokens itself, in a space of
    its own (LLaVA: after expanding images), so no index of this micro-batch's slots applies."""
    return _kept_full(needs) == frozenset(_SEQUENCE_FIELDS) and not micro_batch.extras


def _cut_to_rank(micro_batch: MicroBatch, needs: LocalizeNeeds, index: torch.Tensor) -> MicroBatch:
    """`micro_batch` with `index` ([Tl] long, this rank's slots) applied to every sequence field but those
    `needs` keeps full ([.., T] -> [.., Tl]) and to every extra along dim 1 ([B, T, ..] -> [B, Tl, ..]);
    `cp_index` set to `index` and `full_fields` to the fields kept full. Fields already checked."""
    full = _kept_full(needs)
    fields = {name: getattr(micro_batch, name) for name in _SEQUENCE_FIELDS}
    return replace(
        micro_batch,
        **{name: x if name in full else x.index_select(-1, index) for name, x in fields.items()},  # [.., T] -> [.., Tl]
        extras={key: x.index_select(1, index) for key, x in micro_batch.extras.items()},  # [B, T, ..] -> [B, Tl, ..]
        cp_index=index,
        full_fields=full,
    )


def localize(micro_batch: MicroBatch, layout: ParallelLayout, needs: LocalizeNeeds = LocalizeNeeds()) -> MicroBatch:
    """This CP rank's view of `micro_batch`.

    Args:
        micro_batch: a full-length `MicroBatch` (from `pack_batch` or `pad_batch`, aligned for `layout`).
        layout: the parallel layout; only `cp_size` and `cp_rank` matter here.
        needs: which fields the model's adapter wants full length.

    Returns:
        The same micro-batch when cp_size == 1. Otherwise labels, loss mask, padding mask and
        extras (and ids / positions unless `needs` keeps them) hold [.., T/cp] this rank's tokens,
        `cp_index` is the [T/cp] index used, and `full_fields` names what stayed full.

    Raises:
        ValueError: the micro-batch was already localized, a sequence field or extra is not a tensor
            (`check_field_types`), its length does not divide for CP, its
            `packed_seq_params` are malformed (`check_packed_seq_params`), a dense one's fields hold
            different row counts (`check_dense_rows`), a field it cuts is not one
            row (packed) or does not hold the slots the index covers (`check_sequence_lengths`; at cp_size == 1 too,
            against the plan's total or the first field it would cut), or the index (at cp_size == 1:
            the boundaries) is on another device than the fields it is applied to (`check_index_device`,
            `check_boundary_device`; with every field kept full at cp_size > 1, `check_full_devices`).
    """
    _check_localizable(micro_batch)
    if layout.cp_size == 1:
        _check_without_index(micro_batch, needs)
        return micro_batch
    if _model_selects_its_tokens(micro_batch, needs):
        check_full_devices(micro_batch)  # its fields and boundaries must still be on one device (metadata only)
        return replace(micro_batch, full_fields=frozenset(_SEQUENCE_FIELDS))
    index, source = _cp_index(micro_batch, layout)
    check_index_device(micro_batch, needs, index, source)
    check_sequence_lengths(micro_batch, needs, index.numel() * layout.cp_size)  # T, a shape: no host read
    return _cut_to_rank(micro_batch, needs, index)
