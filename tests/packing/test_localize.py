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


@pytest.mark.parametrize("rank, needs", [(0, LocalizeNeeds()), (1, LocalizeNeeds(full_input_ids=True,
                                                                                   full_position_ids=True))])
def test_the_config_that_made_mrope_positions_is_kept_on_every_rank(rank, needs):
    """`mrope_config` (what the step compares with the model's) survives the CP cut, positions cut or full."""
    from megatron_vlm_packing.rope import MRopeConfig

    rope = MRopeConfig(family="qwen2_vl", image_token_id=900, video_token_id=901)
    mb = pack_batch(batch(), cp_size=2, label_style="hf", mrope=rope)
    local = localize(mb, ParallelLayout(cp_size=2, cp_rank=rank), needs)
    assert local.cp_index is not None and local.position_ids.dim() == 3
    assert local.mrope_config is rope


def test_localizing_twice_is_refused():
    mb = pack_batch(batch(), cp_size=2, label_style="hf")
    once = localize(mb, ParallelLayout(cp_size=2, cp_rank=0))
    with pytest.raises(ValueError, match="already localized"):
        localize(once, ParallelLayout(cp_size=2, cp_rank=0))


def test_dense_rows_use_the_dense_zigzag():
    from dataclasses import replace

    mb = pack_batch(batch(), cp_size=2, label_style="hf")
    dense = replace(mb, packed_seq_params=None, plan=None, indices=None, rope_cu_seqlens=None,  # a dense one has none
                    input_ids=torch.arange(16).reshape(2, 8),
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


# Hostile micro-batches a user builds by hand: each was cut silently (or failed far from the cause).

def _packed(cp_size=2):
    return pack_batch(batch(), cp_size=cp_size, label_style="hf")  # real [5, 2, 3], physical [8, 4, 4] at cp 2


def _with_params(mb, **fields):
    from dataclasses import replace

    return replace(mb, packed_seq_params=replace(mb.packed_seq_params, **fields))


def _all_boundaries(cu_real, cu_padded):
    real, padded = torch.tensor(cu_real, dtype=torch.int32), torch.tensor(cu_padded, dtype=torch.int32)
    return dict(cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("fields, message", [
    # qkv_format None (PackedSeqParams' default): Megatron's attention and rotary run the pack as dense rows
    (dict(qkv_format=None), r"qkv_format must be 'thd' for a packed micro-batch, got None"),
    (dict(qkv_format="sbhd"), r"qkv_format must be 'thd' for a packed micro-batch, got 'sbhd'"),
    (dict(cu_seqlens_q=None), r"cu_seqlens_q is None"),
    # float boundaries were truncated by .long()
    (dict(cu_seqlens_q_padded=torch.tensor([0.0, 8.0, 12.0, 16.0])),
     r"packed_seq_params.cu_seqlens_q_padded must be an integer tensor \(int32\), got torch.float32"),
    (dict(cu_seqlens_q_padded=torch.tensor([0, 8, 16], dtype=torch.int32)),
     r"boundary sets must all have N\+1 entries, got sizes \{'cu_seqlens_q': 4, 'cu_seqlens_q_padded': 3"),
    (dict(max_seqlen_q=8.0), r"max_seqlen_q must be a positive int, got float 8.0"),
    (dict(max_seqlen_kv=True), r"max_seqlen_kv must be a positive int, got bool True"),
    # a float or many-valued tensor reached the kernel (the attention backends refuse it: so does localize)
    (dict(max_seqlen_q=torch.tensor(8.0)),
     r"max_seqlen_q must be a positive int, got Tensor of shape \(\) and dtype torch.float32 \(a one-value"),
    (dict(max_seqlen_kv=torch.tensor([8, 8])),
     r"max_seqlen_kv must be a positive int, got Tensor of shape \(2,\) and dtype torch.int64"),
    # the plan's boundaries with a max_seqlen below its longest document (8): kernels leave the tail uncomputed
    (dict(max_seqlen_q=4), r"max_seqlen_q=4 is below the longest physical document \(8 slots\)"),
])
def test_malformed_packed_seq_params_are_refused(cp_size, fields, message):
    with pytest.raises(ValueError, match=message):
        localize(_with_params(_packed(), **fields), ParallelLayout(cp_size=cp_size, cp_rank=cp_size - 1))


def test_boundaries_covering_fewer_slots_than_the_pack_are_refused():
    # every set agrees on a 12-slot pack, but the tensors hold 16: the last document was dropped silently
    mb = _with_params(_packed(), **_all_boundaries([0, 5, 7], [0, 8, 12]))
    with pytest.raises(ValueError, match=r"the CP index covers 12 slots but \{'input_ids': \(1, 16\), 'position_ids'"):
        localize(mb, ParallelLayout(cp_size=2, cp_rank=1))


def test_a_field_of_another_length_is_refused_not_cut():
    from dataclasses import replace

    mb = _packed()
    longer = replace(mb, labels=torch.cat([mb.labels, mb.labels], -1))
    with pytest.raises(ValueError, match=r"covers 16 slots but \{'labels': \(1, 32\)\}"):
        localize(longer, ParallelLayout(cp_size=2, cp_rank=0))
    extra = replace(mb, extras={"token_type": torch.zeros(1, 12, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"\{\"extras\['token_type'\]\": \(1, 12\)\} have another length along dim 1"):
        localize(extra, ParallelLayout(cp_size=2, cp_rank=0))
    dense = replace(mb, packed_seq_params=None, plan=None, indices=None, rope_cu_seqlens=None,
                    input_ids=torch.zeros(2, 8, dtype=torch.long),
                    labels=torch.zeros(2, 12, dtype=torch.long), loss_mask=torch.ones(2, 8),
                    position_ids=torch.arange(8).expand(2, 8), padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"covers 8 slots but \{'labels': \(2, 12\)\}"):
        localize(dense, ParallelLayout(cp_size=2, cp_rank=0))


def test_fields_the_adapter_keeps_full_are_not_length_checked():
    from dataclasses import replace

    mb = _packed()
    longer_ids = replace(mb, input_ids=torch.zeros(1, 20, dtype=torch.long))  # e.g. a model's own space
    local = localize(longer_ids, ParallelLayout(cp_size=2, cp_rank=0), LocalizeNeeds(full_input_ids=True))
    assert local.input_ids.shape == (1, 20) and local.labels.shape == (1, 8)


def test_without_padded_boundaries_the_real_ones_are_the_physical_ones():
    # cu_seqlens_q_padded None is legal in PackedSeqParams (TE and our attention fall back to cu_seqlens_q);
    # localize raised AttributeError ('NoneType' object has no attribute 'dim')
    real = torch.tensor([0, 8, 12, 16], dtype=torch.int32)  # (cu_seqlens_kv None is refused: the rotary reads it)
    mb = _with_params(_packed(), cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=None,
                      cu_seqlens_kv_padded=None)
    local = localize(mb, ParallelLayout(cp_size=2, cp_rank=1))
    assert torch.equal(local.cp_index, cp_partition_index(torch.tensor([0, 8, 12, 16]), 2, 1))


def test_a_tensor_max_seqlen_is_left_to_the_kernel_and_the_plan_ones_pass():
    mb = _packed()
    local = localize(_with_params(mb, max_seqlen_q=torch.tensor(8)), ParallelLayout(cp_size=2, cp_rank=0))
    assert local.cp_index.numel() == 8
    assert localize(mb, ParallelLayout()) is mb


def test_a_numpy_int_max_seqlen_passes_as_the_attention_backends_take_it():
    # localize refused np.int64 ("a positive Python int") that attention.boundaries accepts: one rule now
    import numpy as np

    local = localize(_with_params(_packed(), max_seqlen_q=np.int64(8), max_seqlen_kv=np.int64(8)),
                     ParallelLayout(cp_size=2, cp_rank=0))
    assert local.cp_index.numel() == 8
    with pytest.raises(ValueError, match=r"max_seqlen_q=4 is below the longest physical document \(8 slots\)"):
        localize(_with_params(_packed(), max_seqlen_q=np.int64(4)), ParallelLayout(cp_size=2, cp_rank=0))


# At CP = 1 localize built no index and returned at once: a field of another length reached the model.

def _dense(mb, **fields):
    from dataclasses import replace

    rows = dict(packed_seq_params=None, rope_cu_seqlens=None, plan=None, indices=None,
                input_ids=torch.zeros(2, 8, dtype=torch.long), labels=torch.zeros(2, 8, dtype=torch.long),
                loss_mask=torch.ones(2, 8), position_ids=torch.arange(8).expand(2, 8),
                padding_mask=torch.zeros(2, 8, dtype=torch.bool))
    return replace(mb, **{**rows, **fields})


@pytest.mark.parametrize("field, value, message", [
    ("labels", torch.zeros(1, 18, dtype=torch.long), r"the pack plan covers 10 slots but \{'labels': \(1, 18\)\}"),
    ("loss_mask", torch.ones(1, 15), r"the pack plan covers 10 slots but \{'loss_mask': \(1, 15\)\}"),
    ("padding_mask", torch.zeros(1, 8, dtype=torch.bool), r"\{'padding_mask': \(1, 8\)\}"),
    ("input_ids", torch.zeros(1, 12, dtype=torch.long), r"\{'input_ids': \(1, 12\)\}"),
    # mRoPE positions [3, 1, T]: a length of 1 broadcast silently in the rotary
    ("position_ids", torch.zeros(3, 1, 1, dtype=torch.long), r"\{'position_ids': \(3, 1, 1\)\}"),
    ("extras", {"token_type": torch.zeros(1, 12, dtype=torch.long)},
     r"\{\"extras\['token_type'\]\": \(1, 12\)\} have another length along dim 1"),
])
def test_cp1_refuses_a_field_of_another_length(field, value, message):
    from dataclasses import replace

    mb = replace(_packed(cp_size=1), **{field: value})
    with pytest.raises(ValueError, match=message):
        localize(mb, ParallelLayout())


def test_cp1_checks_hand_built_boundaries_and_dense_rows_against_input_ids():
    from dataclasses import replace

    # boundaries that are not the plan's are not read (a host sync): the fields must agree with input_ids
    mb = _with_params(_packed(cp_size=1), **_all_boundaries([0, 5, 7, 10], [0, 5, 7, 10]))
    with pytest.raises(ValueError, match=r"input_ids covers 10 slots but \{'labels': \(1, 20\)\}"):
        localize(replace(mb, labels=torch.zeros(1, 20, dtype=torch.long)), ParallelLayout())
    assert localize(mb, ParallelLayout()) is mb  # [1, 10] fields
    dense = _dense(mb)
    assert localize(dense, ParallelLayout()) is dense
    with pytest.raises(ValueError, match=r"input_ids covers 8 slots but \{'position_ids': \(3, 2, 6\)\}"):
        localize(_dense(mb, position_ids=torch.zeros(3, 2, 6, dtype=torch.long)), ParallelLayout())


def test_cp1_exempts_the_fields_the_adapter_keeps_full():
    from dataclasses import replace

    mb = _packed(cp_size=1)
    longer_ids = replace(mb, input_ids=torch.zeros(1, 20, dtype=torch.long))
    assert localize(longer_ids, ParallelLayout(), LocalizeNeeds(full_input_ids=True)) is longer_ids
    # hand-built boundaries and full ids: the first field localize would cut is the reference
    hand = _with_params(longer_ids, **_all_boundaries([0, 5, 7, 10], [0, 5, 7, 10]))
    with pytest.raises(ValueError, match=r"position_ids covers 10 slots but \{'labels': \(1, 4\)\}"):
        localize(replace(hand, labels=torch.zeros(1, 4, dtype=torch.long)), ParallelLayout(),
                 LocalizeNeeds(full_input_ids=True))
    everything = LocalizeNeeds(full_input_ids=True, full_position_ids=True, full_labels=True)
    expanded = replace(hand, labels=torch.zeros(1, 40, dtype=torch.long))  # e.g. LLaVA's expanded space
    assert localize(expanded, ParallelLayout(), everything) is expanded


# Boundaries on another device than the fields: index_select raised a RuntimeError (CPU index, CUDA
# fields) far from the cause, or passed silently (meta fields). Meta stands in for CUDA here.

def _on(mb, device, names=("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")):
    from dataclasses import replace

    return replace(mb, **{name: getattr(mb, name).to(device) for name in names})


def test_boundaries_on_another_device_than_the_fields_are_refused():
    mb = _on(_packed(), "meta")  # the plan's PackIndices and boundaries stay on the CPU
    with pytest.raises(ValueError, match=r"the CP index \(from packed_seq_params.cu_seqlens_q_padded\) is on cpu "
                                         r"but \{'input_ids': 'meta', 'position_ids': 'meta'"):
        localize(mb, ParallelLayout(cp_size=2, cp_rank=0))
    hand = _with_params(mb, **_all_boundaries([0, 5, 7, 10], [0, 8, 12, 16]))  # hand-built, read on the CPU
    with pytest.raises(ValueError, match=r"is on cpu but \{'input_ids': 'meta'"):
        localize(hand, ParallelLayout(cp_size=2, cp_rank=1))


def test_one_field_on_another_device_is_named_and_full_ids_are_checked_too():
    mb = _on(_packed(), "meta", names=("loss_mask",))
    with pytest.raises(ValueError, match=r"is on cpu but \{'loss_mask': 'meta'\} are on another device"):
        localize(mb, ParallelLayout(cp_size=2, cp_rank=0))
    # kept full, the ids are still where the model applies cp_index (to their embeddings)
    ids = _on(_packed(), "meta", names=("input_ids",))
    with pytest.raises(ValueError, match=r"\{'input_ids': 'meta'\}"):
        localize(ids, ParallelLayout(cp_size=2, cp_rank=0), LocalizeNeeds(full_input_ids=True))
    dense = _dense(_packed(), labels=torch.zeros(2, 8, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match=r"from input_ids' length, on its device\) is on cpu but \{'labels': 'meta'\}"):
        localize(dense, ParallelLayout(cp_size=2, cp_rank=1))


# At CP = 1 no index is built, so nothing compared the boundaries' device with the fields': CPU boundaries
# beside CUDA fields failed deep inside TE's attention (or synced silently). Meta stands in for CUDA.

def _params_on(mb, device):
    from dataclasses import replace

    params = mb.packed_seq_params
    moved = {name: getattr(params, name).to(device)
             for name in ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded")}
    return replace(mb, packed_seq_params=replace(params, **moved), rope_cu_seqlens=mb.rope_cu_seqlens.to(device))


def test_cp1_refuses_boundaries_on_another_device_than_the_fields():
    mb = _on(_packed(cp_size=1), "meta")  # the plan's boundaries stay on the CPU
    with pytest.raises(ValueError, match=r"packed_seq_params.cu_seqlens_q_padded is on cpu but \{'input_ids': 'meta', "
                                         r"'position_ids': 'meta'"):
        localize(mb, ParallelLayout())
    hand = _with_params(_packed(cp_size=1), **_all_boundaries([0, 5, 7, 10], [0, 5, 7, 10]))
    with pytest.raises(ValueError, match=r"packed_seq_params.cu_seqlens_q_padded is on meta but \{'input_ids': 'cpu'"):
        localize(_params_on(hand, "meta"), ParallelLayout())
    # kept full, the ids are still what attention's query is built from
    with pytest.raises(ValueError, match=r"is on cpu but \{'input_ids': 'meta'\} are on another device"):
        localize(_on(_packed(cp_size=1), "meta", names=("input_ids",)), ParallelLayout(),
                 LocalizeNeeds(full_input_ids=True))
    on_meta = _params_on(_on(hand, "meta"), "meta")  # everything on one device passes as before
    assert localize(on_meta, ParallelLayout()) is on_meta


@pytest.mark.parametrize("cp_size", [1, 2])
def test_boundary_sets_on_two_devices_are_refused(cp_size):
    mb = _packed(cp_size=cp_size)
    kv = _with_params(mb, cu_seqlens_kv=mb.packed_seq_params.cu_seqlens_kv.to("meta"))
    with pytest.raises(ValueError, match=r"boundary sets must all be on one device, got \{'cu_seqlens_q': 'cpu', "
                                         r"'cu_seqlens_q_padded': 'cpu', 'cu_seqlens_kv': 'meta'"):
        localize(kv, ParallelLayout(cp_size=cp_size, cp_rank=0))


# A packed micro-batch is one row: only the token dim was compared, so a hand-built [2, T] field passed
# (at CP > 1 both rows were cut as if one) and [2, T/2] fields passed where T was taken from input_ids.

@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("field, shape, message", [
    ("labels", (2, 0), r"\{'labels': \(2, TOTAL\)\} have another batch dim or rank"),
    ("loss_mask", (0,), r"\{'loss_mask': \(TOTAL,\)\} have another batch dim or rank"),
    ("position_ids", (3, 2, 0), r"\{'position_ids': \(3, 2, TOTAL\)\}"),
    ("input_ids", (1, 1, 0), r"\{'input_ids': \(1, 1, TOTAL\)\}"),
    ("extras", (2, 0, 4), r"\{\"extras\['vision_embeds'\]\": \(2, TOTAL, 4\)\}"),
])
def test_a_packed_field_with_another_batch_dim_is_refused(cp_size, field, shape, message):
    from dataclasses import replace

    mb = _packed(cp_size=cp_size)
    total = mb.input_ids.shape[-1]
    value = torch.zeros(*(total if n == 0 else n for n in shape), dtype=torch.long)
    mb = replace(mb, **{field: {"vision_embeds": value} if field == "extras" else value})
    expected = r"a packed micro-batch is one row of T slots: .*" + message.replace("TOTAL", str(total))
    with pytest.raises(ValueError, match=expected):
        localize(mb, ParallelLayout(cp_size=cp_size, cp_rank=0))


def test_hand_built_packed_fields_of_two_half_rows_are_refused_at_cp1():
    from dataclasses import replace

    hand = _with_params(_packed(cp_size=1), **_all_boundaries([0, 5, 7, 10], [0, 5, 7, 10]))
    rows = {name: getattr(hand, name).reshape(*getattr(hand, name).shape[:-2], 2, 5)
            for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")}
    with pytest.raises(ValueError, match=r"but \{'input_ids': \(2, 5\), 'position_ids': \(2, 5\), 'labels': \(2, 5\)"):
        localize(replace(hand, **rows), ParallelLayout())
    mrope = replace(hand, position_ids=torch.zeros(3, 1, 10, dtype=torch.long))  # [3, 1, T] is one row
    assert localize(mrope, ParallelLayout()) is mrope


@pytest.mark.parametrize("field, needs", [("input_ids", LocalizeNeeds()),
                                          ("labels", LocalizeNeeds(full_input_ids=True, full_position_ids=True))])
def test_cp1_hand_built_boundaries_beside_a_0d_field_name_it(field, needs):
    # at CP = 1 with boundaries that are not the plan's, T is the length of the first field localize would cut:
    # a 0-d one raised IndexError ('tuple index out of range') before the one-row check could name it
    from dataclasses import replace

    hand = _with_params(_packed(cp_size=1), **_all_boundaries([0, 5, 7, 10], [0, 5, 7, 10]))
    with pytest.raises(ValueError, match=rf"one row of T slots: .* but \{{'{field}': \(\)\}} have another batch dim"):
        localize(replace(hand, **{field: torch.tensor(1)}), ParallelLayout(), needs)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32])
@pytest.mark.parametrize("cp_size", [1, 2])
def test_a_padding_mask_that_is_not_bool_is_refused(dtype, cp_size):
    """A hand-built int mask reached the model: Megatron-Core's MoE router takes `~padding_mask`, which is
    -1 / -2 for an int 0 / 1, and counted pad slots with negative weights."""
    import dataclasses

    mb = pack_batch(batch(), cp_size=cp_size, label_style="hf")
    cast = dataclasses.replace(mb, padding_mask=mb.padding_mask.to(dtype))
    with pytest.raises(ValueError, match=rf"padding_mask must be torch.bool \(True at pad slots\), got {dtype}"):
        localize(cast, ParallelLayout(cp_size=cp_size, cp_rank=0))
