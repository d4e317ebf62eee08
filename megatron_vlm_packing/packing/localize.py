"""`localize`: the one place where a micro-batch is cut to this context-parallel rank's tokens.

Contract item 5: one CP index (TransformerEngine's zigzag per physical document, or per dense
row) is applied to every sequence-aligned tensor. Whether `input_ids` and `position_ids` stay full
length is what the model's adapter declares (`LocalizeNeeds`), never guessed from a tensor's rank:
a model that merges vision embeddings needs the full ids and selects its CP tokens itself, with
the `cp_index` carried on the result.

Shape legend: T = physical tokens of the whole pack, Tl = T / cp; dense rows [B, L] -> [B, L / cp].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.packing.plan import PackIndices
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
    sync; a loader's collate may have built it already), else read from `cu_seqlens_q_padded`."""
    cu_padded = micro_batch.packed_seq_params.cu_seqlens_q_padded
    indices = micro_batch.indices
    if isinstance(indices, PackIndices) and cu_padded is indices.cu_seqlens_padded:
        return indices.cp_index(layout.cp_size, layout.cp_rank)
    return cp_partition_index(cu_padded, layout.cp_size, layout.cp_rank)


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
        ValueError: the micro-batch was already localized, or its length does not divide for CP.
    """
    if micro_batch.cp_index is not None:
        raise ValueError("micro_batch is already localized to a CP rank (cp_index is set); localize it once")
    if layout.cp_size == 1:
        return micro_batch
    if needs.full_input_ids and needs.full_position_ids and needs.full_labels and not micro_batch.extras:
        # The model selects its CP tokens itself, in a space of its own (LLaVA: after expanding
        # images), so no index of this micro-batch's slots applies.
        return replace(micro_batch, full_fields=frozenset({"input_ids", "position_ids", "labels", "loss_mask",
                                                           "padding_mask"}))
    if micro_batch.is_packed:
        index = packed_cp_index(micro_batch, layout)
    else:
        index = dense_cp_partition_index(micro_batch.input_ids.shape[-1], layout.cp_size, layout.cp_rank,
                                         device=micro_batch.input_ids.device)

    def last(x: torch.Tensor) -> torch.Tensor:  # [..., T] -> [..., Tl]
        return x.index_select(-1, index)

    def seq(x: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [B, Tl, ...]
        return x.index_select(1, index)

    full = set()
    input_ids = micro_batch.input_ids
    if needs.full_input_ids:
        full.add("input_ids")
    else:
        input_ids = last(input_ids)
    positions = micro_batch.position_ids
    if needs.full_position_ids:
        full.add("position_ids")
    else:
        positions = last(positions)
    targets = (micro_batch.labels, micro_batch.loss_mask, micro_batch.padding_mask)
    if needs.full_labels:
        full.update(("labels", "loss_mask", "padding_mask"))
    else:
        targets = tuple(last(x) for x in targets)
    return replace(
        micro_batch,
        input_ids=input_ids,
        position_ids=positions,
        labels=targets[0],
        loss_mask=targets[1],
        padding_mask=targets[2],
        extras={key: seq(value) for key, value in micro_batch.extras.items()},
        cp_index=index,
        full_fields=frozenset(full),
    )
