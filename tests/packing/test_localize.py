"""`localize`: one CP index for every sequence-aligned field; ids/positions full only when asked."""

import pytest
import torch

from megatron_vlm_packing import cp_partition_index, pack_batch
from megatron_vlm_packing.packing.localize import LocalizeNeeds, localize
from megatron_vlm_packing.parallel.cp import dense_cp_partition_index
from megatron_vlm_packing.parallel.layout import ParallelLayout


def batch():
    ids = torch.tensor([[11, 12, 13, 14, 15, 0], [21, 22, 0, 0, 0, 0], [31, 32, 33, 0, 0, 0]])
    mask = (torch.arange(6) < torch.tensor([[5], [2], [3]])).long()
    return {"input_ids": ids, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}


def test_cp1_is_the_identity():
    mb = pack_batch(batch(), label_style="hf")
    assert localize(mb, ParallelLayout()) is mb


@pytest.mark.parametrize("rank", [0, 1])
def test_every_sequence_field_gets_the_same_index(rank):
    mb = pack_batch(batch(), cp_size=2, label_style="hf")
    local = localize(mb, ParallelLayout(cp_size=2, cp_rank=rank))
    index = cp_partition_index(mb.packed_seq_params.cu_seqlens_q_padded, 2, rank)
    assert torch.equal(local.cp_index, index)
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(local, name), getattr(mb, name)[..., index]), name
    assert local.full_fields == frozenset()
    assert local.packed_seq_params is mb.packed_seq_params  # boundaries stay global: attention needs them


def test_adapter_needs_keep_ids_and_positions_full():
    mb = pack_batch(batch(), cp_size=2, label_style="hf")
    local = localize(mb, ParallelLayout(cp_size=2, cp_rank=1), LocalizeNeeds(full_input_ids=True,
                                                                              full_position_ids=True))
    assert torch.equal(local.input_ids, mb.input_ids) and torch.equal(local.position_ids, mb.position_ids)
    assert local.labels.shape == (1, mb.labels.shape[1] // 2)
    assert local.full_fields == {"input_ids", "position_ids"}


def test_localizing_twice_is_refused():
    mb = pack_batch(batch(), cp_size=2, label_style="hf")
    once = localize(mb, ParallelLayout(cp_size=2, cp_rank=0))
    with pytest.raises(ValueError, match="already localized"):
        localize(once, ParallelLayout(cp_size=2, cp_rank=0))


def test_dense_rows_use_the_dense_zigzag():
    from dataclasses import replace

    mb = pack_batch(batch(), cp_size=2, label_style="hf")
    dense = replace(mb, packed_seq_params=None, input_ids=torch.arange(16).reshape(2, 8),
                    labels=torch.arange(16).reshape(2, 8), loss_mask=torch.ones(2, 8),
                    position_ids=torch.arange(8).expand(2, 8), padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    local = localize(dense, ParallelLayout(cp_size=2, cp_rank=1))
    assert local.cp_index.tolist() == dense_cp_partition_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local.input_ids.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_layout_rejects_bad_sizes():
    with pytest.raises(ValueError, match="cp_rank must be in \\[0, 2\\), got 2"):
        ParallelLayout(cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        ParallelLayout(tp_size=0)
