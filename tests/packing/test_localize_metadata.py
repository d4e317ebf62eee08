"""`localize`'s metadata checks (shapes and devices only, no host read) on hand-built micro-batches:
mRoPE positions with another channel count, `rope_cu_seqlens` on another device, the CP > 1 path that
keeps every field full, and dense fields with different row counts. Each passed silently before.
Meta stands in for CUDA."""

from dataclasses import replace

import pytest
import torch

from megatron_vlm_packing.packing.localize import LocalizeNeeds, localize
from megatron_vlm_packing.parallel.layout import ParallelLayout

from tests.packing.test_localize import _dense, _on, _packed

EVERYTHING_FULL = LocalizeNeeds(full_input_ids=True, full_position_ids=True, full_labels=True)


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("channels", [1, 2, 4])
@pytest.mark.parametrize("needs", [LocalizeNeeds(), LocalizeNeeds(full_input_ids=True, full_position_ids=True)])
def test_mrope_positions_need_three_channels(cp_size, channels, needs):
    mb = _packed(cp_size=cp_size)
    total = mb.input_ids.shape[-1]
    wrong = replace(mb, position_ids=torch.zeros(channels, 1, total, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"position_ids has shape \({channels}, 1, {total}\): 3D positions are "
                                         rf"mRoPE's \[3, 1, T\]"):
        localize(wrong, ParallelLayout(cp_size=cp_size, cp_rank=0), needs)
    right = replace(mb, position_ids=torch.zeros(3, 1, total, dtype=torch.long))
    local = localize(right, ParallelLayout(cp_size=cp_size, cp_rank=0), needs)
    assert local.position_ids.shape[0] == 3


@pytest.mark.parametrize("cp_size", [1, 2])
def test_rope_cu_seqlens_on_another_device_than_the_boundaries_is_refused(cp_size):
    mb = _packed(cp_size=cp_size)
    assert mb.rope_cu_seqlens is not None
    with pytest.raises(ValueError, match=r"boundary sets must all be on one device, got \{'cu_seqlens_q': 'cpu', "
                                         r".*'rope_cu_seqlens': 'meta'\}"):
        localize(replace(mb, rope_cu_seqlens=mb.rope_cu_seqlens.to("meta")), ParallelLayout(cp_size=cp_size))
    with pytest.raises(ValueError, match=r"rope_cu_seqlens must be an integer tensor \(int32\), got torch.float32"):
        localize(replace(mb, rope_cu_seqlens=mb.rope_cu_seqlens.float()), ParallelLayout(cp_size=cp_size))


def test_cp2_with_every_field_full_still_checks_devices():
    layout = ParallelLayout(cp_size=2, cp_rank=1)
    mb = _packed()
    local = localize(mb, layout, EVERYTHING_FULL)  # on one device: unchanged, every field named full
    assert local.cp_index is None and local.input_ids is mb.input_ids and local.full_fields == frozenset(
        {"input_ids", "position_ids", "labels", "loss_mask", "padding_mask"})
    with pytest.raises(ValueError, match=r"packed_seq_params.cu_seqlens_q_padded is on cpu but "
                                         r"\{'labels': 'meta'\} are on another device"):
        localize(_on(mb, "meta", names=("labels",)), layout, EVERYTHING_FULL)
    dense = _dense(mb)
    assert localize(dense, layout, EVERYTHING_FULL).full_fields == local.full_fields
    with pytest.raises(ValueError, match=r"input_ids is on cpu but \{'padding_mask': 'meta'\} are on another device"):
        localize(_on(dense, "meta", names=("padding_mask",)), layout, EVERYTHING_FULL)


@pytest.mark.parametrize("cp_size, needs", [(1, LocalizeNeeds()), (2, LocalizeNeeds()), (2, EVERYTHING_FULL)])
@pytest.mark.parametrize("fields, rows", [
    (dict(labels=torch.zeros(1, 8, dtype=torch.long)), "'labels': 1"),
    (dict(loss_mask=torch.ones(3, 8)), "'loss_mask': 3"),
    (dict(position_ids=torch.zeros(3, 1, 8, dtype=torch.long)), "'position_ids': 1"),
    (dict(padding_mask=torch.zeros(8, dtype=torch.bool)), "'padding_mask': None"),
    (dict(extras={"token_type": torch.zeros(4, 8, dtype=torch.long)}), "\"extras['token_type']\": 4"),
])
def test_dense_fields_with_other_row_counts_are_refused(cp_size, needs, fields, rows):
    dense = _dense(_packed(), **fields)  # [2, 8] rows but one field
    with pytest.raises(ValueError, match=r"a dense micro-batch's fields must all hold the same rows .*got rows "
                                         r"\{'input_ids': 2, .*" + rows.replace("[", r"\[").replace("]", r"\]")):
        localize(dense, ParallelLayout(cp_size=cp_size, cp_rank=0), needs)


def test_dense_mrope_positions_need_three_channels_and_same_rows_pass():
    dense = _dense(_packed(), position_ids=torch.zeros(3, 2, 8, dtype=torch.long))
    assert localize(dense, ParallelLayout()) is dense
    assert localize(dense, ParallelLayout(cp_size=2, cp_rank=1)).position_ids.shape == (3, 2, 4)
    with pytest.raises(ValueError, match=r"position_ids has shape \(2, 2, 8\)"):
        localize(_dense(_packed(), position_ids=torch.zeros(2, 2, 8, dtype=torch.long)), ParallelLayout())
