"""Hostile inputs to `pack_batch`: each is packed right or refused with a ValueError naming the field and
the numbers, the same on every path: `host_reads=True` (the plain path, `packing/plain_host.py`, for a
plain batch, else the general host path) and `host_reads=False` (the one-read step path).

Each case runs on both `host_reads` values and, where the batch's form picks the host path, on a plain
batch and one with an extra key (which the plain path leaves to the general one).
"""

import numpy as np
import pytest
import torch

from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.packing.lengths import lengths_from_keep_mask, right_padded_reads
from tests.packing.test_plain_host import assert_identical, plain_path_spied

M = 2**63 - 1  # int64's maximum: M + M + 5 wraps to 3
ROUTES = [(True, "plain"), (True, "general"), (False, "plain"), (False, "general")]  # (host_reads, batch form)


def rows_batch(mask=None, *, batch_size=2, row_length=4, **fields) -> dict:
    """A Megatron-style batch of `batch_size` x `row_length` rows (labels are not the ids), with `mask`."""
    ids = torch.arange(1, batch_size * row_length + 1).reshape(batch_size, row_length)
    batch = {"input_ids": ids, "labels": ids + 100, **fields}
    if mask is not None:
        batch["attention_mask"] = mask
    return batch


def packed(batch: dict, host_reads: bool, form: str, **kwargs):
    """pack_batch on `batch` as `form` ("plain", or "general": an extra key the plain path leaves alone)."""
    if form == "general":
        batch = {**batch, "token_type": torch.zeros_like(batch["input_ids"])}
        kwargs["extra_keys"] = ("token_type",)
    taken = []
    with plain_path_spied(taken):
        result = pack_batch(batch, host_reads=host_reads, **kwargs)
    assert any(taken) == (host_reads and form == "plain"), "the batch took another path than the test means"
    return result


# -- 1. attention_mask values outside {0, 1} ------------------------------------------------------------------------

WRAPPING_MASKS = [
    ([[M, M, 5, 0], [1, 1, 0, 0]], M, 0, 0),  # row sum wraps to 3 == the first zero: read as length 3
    ([[1, M, M, 3], [1, 1, 0, 0]], M, 0, 1),  # no zero: row sum wraps to 4 == S, read as a full row
    ([[1, 1, 0, 0], [2**62, 2**62, 2**62, 2**62 + 4]], 2**62, 1, 0),  # sum 2**64 + 4 wraps to 4 == S
]


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("rows, value, row, column", WRAPPING_MASKS)
def test_int64_mask_whose_row_sums_wrap_is_refused(host_reads, form, rows, value, row, column):
    mask = torch.tensor(rows, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"attention_mask row {row} has values other than 0 and 1: {value} at "
                                         rf"column {column}$"):
        packed(rows_batch(mask), host_reads, form)


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_narrow_mask_with_large_values_names_the_value(host_reads, form, dtype):
    top = torch.iinfo(dtype).max
    mask = torch.tensor([[1, 1, 0, 0], [1, top, 5, 0]], dtype=dtype)
    with pytest.raises(ValueError, match=rf"attention_mask row 1 has values other than 0 and 1: {top} at column 1$"):
        packed(rows_batch(mask), host_reads, form)


def test_feature_attention_mask_reads_refuse_wrapping_int64_sums():
    """The device reads shared with `feature_attention_mask` (Qwen-Omni audio) fail on a wrapping int64 mask."""
    mask = torch.tensor([[M, M, 5, 0], [1, 1, 0, 0]])
    values, fails = right_padded_reads(mask, "feature_attention_mask")
    assert fails(torch.cat([values[0], values[1], values[2], values[3][None]]).tolist())
    with pytest.raises(ValueError, match=rf"feature_attention_mask row 0 .*: {M} at column 0"):
        lengths_from_keep_mask(mask, field="feature_attention_mask")


@pytest.mark.parametrize("host_reads, form", ROUTES)
def test_bool_mask_holding_other_bytes_is_refused(host_reads, form):
    """A bool tensor viewed from bytes other than 0/1 (torch's ops disagree on it: `!= 1` says False, `sum`
    counts 2) is a ValueError naming the byte, not an IndexError, nor packed as truthy."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 2, 1, 0]], dtype=torch.uint8).view(torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask row 1 has values other than 0 and 1: byte 2 at column 1 of "
                                         r"a torch.bool tensor"):
        packed(rows_batch(mask), host_reads, form)


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("dtype_name", ["uint16", "uint32"])
def test_wide_unsigned_mask_packs_as_int64(host_reads, dtype_name):
    """uint16 / uint32 masks (torch cannot reduce them) are read as int64: exact, the same pack."""
    rows = [[1, 1, 1, 0], [1, 1, 0, 0]]
    mask = torch.tensor(rows).to(getattr(torch, dtype_name))
    expected = pack_batch(rows_batch(torch.tensor(rows)), host_reads=host_reads)
    assert_identical(pack_batch(rows_batch(mask), host_reads=host_reads), expected)
    bad = torch.tensor([[1, 1, 1, 0], [1, 300, 0, 0]]).to(getattr(torch, dtype_name))
    with pytest.raises(ValueError, match=r"attention_mask row 1 has values other than 0 and 1: 300 at column 1$"):
        pack_batch(rows_batch(bad), host_reads=host_reads)


@pytest.mark.parametrize("host_reads", [True, False])
def test_uint64_mask_is_refused(host_reads):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).to(torch.uint64)
    with pytest.raises(ValueError, match=r"attention_mask has dtype torch.uint64"):
        pack_batch(rows_batch(mask), host_reads=host_reads)


# -- 2. pad_token_id (and placeholder ids) beyond int64 --------------------------------------------------------------

@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("pad_token_id, message", [(2**63, r"at most 2\*\*63 - 1 \(ids are int64\)"),
                                                   (2**64 + 5, r"at most 2\*\*63 - 1 \(ids are int64\)"),
                                                   (-2**63 - 1, r"a non-negative int \(the id written at pad slots\)")])
def test_pad_token_id_beyond_int64_is_refused(host_reads, form, pad_token_id, message):
    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=rf"pad_token_id must be {message}, got {pad_token_id}$"):
        packed(batch, host_reads, form, pad_token_id=pad_token_id)


@pytest.mark.parametrize("host_reads", [True, False])
def test_pad_token_id_at_int64_max_is_written(host_reads):
    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    micro_batch = pack_batch(batch, host_reads=host_reads, pad_token_id=M, pad_to=8)
    assert micro_batch.input_ids[0, 5:].tolist() == [M] * 3


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("name", ["image_token_id", "video_token_id", "audio_token_id"])
def test_placeholder_id_beyond_int64_is_refused(host_reads, name):
    with pytest.raises(ValueError, match=rf"{name} must be a non-negative int \(at most 2\*\*63 - 1.*got {2**64}$"):
        pack_batch(rows_batch(), host_reads=host_reads, **{name: 2**64})


# -- 3. packed length T >= 2**31 (int32 cu_seqlens) -----------------------------------------------------------------

def test_plan_of_2_to_the_31_tokens_is_refused():
    """Checked from the lengths alone (no tensor is made): T = 2**31 would wrap cu_seqlens' int32."""
    from megatron_vlm_packing.packing.plan import PackMultiples, make_pack_plan

    with pytest.raises(ValueError, match=r"T = 2147483648 physical tokens \(2147483648 real\); its int32 cu_seqlens "
                                         r"need T < 2\*\*31"):
        make_pack_plan([2**30, 2**30], row_capacity=2**30)
    with pytest.raises(ValueError, match=r"T = 2147483648 physical tokens \(2147483647 real\)"):
        make_pack_plan([2**30, 2**30 - 1], row_capacity=2**30, multiples=PackMultiples(segment=2, total=2))
    largest = make_pack_plan([2**30, 2**30 - 1], row_capacity=2**30)
    assert largest.cu_seqlens_padded()[-1].item() == 2**31 - 1
    # A plan built by hand is checked by PackPlan itself (make_pack_plan's skips that second check).
    from megatron_vlm_packing.packing.plan import PackPlan

    with pytest.raises(ValueError, match=r"T = 2147483648 physical tokens \(2147483648 real\)"):
        PackPlan(row_lengths=(2**30, 2**30), row_capacity=2**30, segment_rows=(0, 1), real_lengths=(2**30, 2**30),
                 physical_lengths=(2**30, 2**30), multiples=PackMultiples())


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("pad_to", [2**31, 2**64])
def test_pad_to_beyond_int32_is_refused(host_reads, form, pad_to):
    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=rf"T = {pad_to} physical tokens \(5 real\); its int32 cu_seqlens"):
        packed(batch, host_reads, form, pad_to=pad_to)


@pytest.mark.parametrize("pad_to", [2**31, 2**31 + 6, 2**64])
def test_llava_expanded_pack_beyond_int32_is_refused(pad_to):
    """LLaVA's boundaries are expanded ones (each image token grows): the collapsed plan stays below 2**31
    (PackPlan's check passes) while the expanded T reaches it, which was a RuntimeError (int32 overflow)
    when the model's patch built the expanded cu_seqlens."""
    from megatron_vlm_packing.models.llava import LlavaSpace, llava_pack_plan

    space = LlavaSpace(img_seq_len=4, image_token_index=9)
    with pytest.raises(ValueError, match=rf"the pack expands to T = {pad_to} tokens; its int32 cu_seqlens need "
                                         r"T < 2\*\*31"):
        llava_pack_plan([5, 3], row_capacity=8, row_expansion=[3, 3], opens_with_image=[False, False], space=space,
                        pad_to=pad_to)
    largest = llava_pack_plan([5, 3], row_capacity=8, row_expansion=[3, 3], opens_with_image=[False, False],
                              space=space, pad_to=2**31 - 1)
    assert largest.total == 2**31 - 1 - 6  # collapsed: the 6 expanded slots come from the images
