import numpy as np
import pytest
import torch

from megatron_vlm_packing.packing import (
    dense_packed_seq_params, pad_or_truncate_attention_mask_4d, pad_or_truncate_keep_mask,
    pad_or_truncate_positions, pad_or_truncate_rows, padded_length,
)


def test_padded_length():
    assert padded_length(13, 4) == 16
    assert padded_length(16, 4) == 16
    assert padded_length(13, 4, seq_length=8) == 8  # truncation is asked for explicitly
    with pytest.raises(ValueError, match="seq_length=10 must be a positive multiple of 4"):
        padded_length(13, 4, seq_length=10)
    with pytest.raises(ValueError, match="multiple >= 1"):
        padded_length(3, 0)


def test_pad_and_truncate_rows_and_masks():
    x = torch.tensor([[1, 2, 3], [4, 5, 0]])
    assert pad_or_truncate_rows(x, 5, pad_value=-100).tolist() == [[1, 2, 3, -100, -100], [4, 5, 0, -100, -100]]
    assert pad_or_truncate_rows(x, 2).tolist() == [[1, 2], [4, 5]]
    assert pad_or_truncate_keep_mask(torch.tensor([[1, 1, 0]]), 4).tolist() == [[1, 1, 0, 0]]
    mask = torch.zeros(1, 1, 2, 2, dtype=torch.bool)
    out = pad_or_truncate_attention_mask_4d(mask, 3)
    assert out.shape == (1, 1, 3, 3) and out[0, 0].tolist() == [[False, False, True], [False, False, True], [True, True, True]]
    assert pad_or_truncate_attention_mask_4d(out, 2).shape == (1, 1, 2, 2)


def test_pad_positions_continue_the_arange():
    assert pad_or_truncate_positions(torch.tensor([[0, 1, 2], [0, 1, 0]]), 5).tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 2, 3]]
    pos3 = torch.tensor([[[0, 1]], [[0, 3]], [[0, 2]]])  # [3, 1, 2]
    out = pad_or_truncate_positions(pos3, 4)
    assert out.shape == (3, 1, 4) and out[:, 0, 2:].tolist() == [[4, 5]] * 3
    assert pad_or_truncate_positions(pos3, 1).shape == (3, 1, 1)


def test_dense_packed_seq_params_are_uniform():
    params = dense_packed_seq_params(3, 4)
    assert params.cu_seqlens_q.tolist() == [0, 4, 8, 12] and params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 12]
    assert params.max_seqlen_q == 4 and params.qkv_format == "thd"
    with pytest.raises(ValueError, match="batch_size >= 1"):
        dense_packed_seq_params(0, 4)


@pytest.mark.parametrize("batch_size, seq_length", [(2, 2**30), (1, 2**31), (2**62, 4)])
def test_dense_boundaries_past_int32_are_refused(batch_size, seq_length):
    """cu_seqlens are int32: [0, 2**30, 2**31] was written as [0, 1073741824, -2147483648], silently; 2**62 rows
    were an OverflowError."""
    with pytest.raises(ValueError, match=rf"the pack has {batch_size * seq_length} slots, more than int32 "
                                         rf"cu_seqlens can hold \(< 2\*\*31\): a smaller pad_to or seq_length"):
        dense_packed_seq_params(batch_size, seq_length)
    assert dense_packed_seq_params(1, 2**31 - 1).cu_seqlens_q.tolist() == [0, 2**31 - 1]


@pytest.mark.parametrize("batch_size, seq_length", [(2, 4.0), (2.5, 4), (True, 4), ("2", 4), (None, 4)])
def test_dense_boundaries_need_int_sizes(batch_size, seq_length):
    """A float or bool size was taken (max_seqlen 4.0; 2.5 rows gave 3 boundaries); a str was a TypeError."""
    with pytest.raises(ValueError, match=r"dense_packed_seq_params needs int batch_size and seq_length, got "):
        dense_packed_seq_params(batch_size, seq_length)
    params = dense_packed_seq_params(2, np.int64(4))  # a numpy int is read as its int, as pad_to is
    assert type(params.max_seqlen_q) is int and params.cu_seqlens_q.tolist() == [0, 4, 8]
    with pytest.raises(ValueError, match=r"pass Python ints \(int\(\.\.\.\)\), not tensors"):  # as pad_to is too
        dense_packed_seq_params(2, torch.tensor(4))


def test_a_dense_row_length_past_int64_is_named():
    """Was a TypeError ('Overflow when unpacking long long') from allocating the rows."""
    from megatron_vlm_packing.packing import pad_batch

    batch = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.full((2, 4), 2)}
    with pytest.raises(ValueError, match=rf"2 rows of {2**70} slots: more than torch can index \(int64\)"):
        pad_batch(batch, seq_length=2**70)
    with pytest.raises(ValueError, match=rf"2 rows of {2**71} slots: more than torch can index"):
        pad_batch(batch, cp_size=2**70)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("seq_length", [None, 8])
def test_pad_batch_drops_the_loss_values_of_pad_slots(bad, seq_length):
    """A pad slot's loss value is never checked (pack_batch drops it): pad_batch multiplied it by 0, and
    NaN or inf times 0 is NaN, so one garbage value at a pad slot made the step's loss sum NaN."""
    from megatron_vlm_packing.packing import pack_batch, pad_batch

    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    loss = torch.ones(2, 4)
    loss[0, 3] = bad  # the pad slot of row 0
    batch = {"input_ids": ids, "labels": torch.where(ids != 0, ids, -100), "attention_mask": (ids != 0).long(),
             "loss_mask": loss}
    dense = pad_batch(batch, label_style="hf", seq_length=seq_length)
    assert torch.isfinite(dense.loss_mask).all() and dense.loss_mask.dtype == torch.float32
    assert dense.loss_mask[:, :4].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]  # HF: no target after a row's last token
    assert dense.loss_mask.sum() == pack_batch(batch, label_style="hf").loss_mask.sum()
