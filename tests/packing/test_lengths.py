import numpy as np
import pytest
import torch

from megatron_vlm_packing.packing import keep_mask_from_4d, lengths_from_keep_mask, real_lengths


def causal_padding_mask_4d(lengths, seq_len):
    """Megatron convention: True = masked; a pad token cannot even see itself."""
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    keep = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]
    allowed = causal[None] & keep[:, None, :] & keep[:, :, None]
    return (~allowed)[:, None]


def test_lengths_from_2d_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert lengths_from_keep_mask(mask) == [3, 1, 0, 4]
    assert lengths_from_keep_mask(mask.bool()) == [3, 1, 0, 4]


def test_lengths_from_4d_mask_match_2d():
    mask4d = causal_padding_mask_4d([3, 1, 0, 4], 4)
    assert keep_mask_from_4d(mask4d).long().tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert real_lengths(batch_size=4, row_length=4, attention_mask=mask4d) == [3, 1, 0, 4]


def test_no_source_means_full_rows():
    assert real_lengths(batch_size=2, row_length=7) == [7, 7]


def test_seq_lens_used_as_given():
    assert real_lengths(batch_size=3, row_length=5, seq_lens=torch.tensor([5, 0, 2])) == [5, 0, 2]


@pytest.mark.parametrize(
    "mask, expected",
    [
        ([[1, 0, 1, 0]], r"row 0.*holes at positions \[1\]"),
        ([[0, 1, 1, 0]], r"row 0.*left padding: first real token at position 1"),
        ([[1, 1, 0, 0], [0, 0, 1, 1]], r"bad row\(s\) \[1\].*left padding"),
        ([[1, 2, 0, 0]], r"row 0 has values other than 0 and 1"),
    ],
)
def test_bad_masks_name_the_row_and_positions(mask, expected):
    with pytest.raises(ValueError, match=expected):
        lengths_from_keep_mask(torch.tensor(mask))


def test_mask_values_never_inferred_from_tokens():
    # pad id == eos == 0: token values must not matter, only the mask.
    mask = torch.tensor([[1, 1, 1, 1]])
    assert real_lengths(batch_size=1, row_length=4, attention_mask=mask) == [4]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(attention_mask=torch.ones(2, 5)), r"attention_mask covers \(2, 5\).*input_ids is \(2, 4\)"),
        (dict(attention_mask=torch.ones(2, 4, 4)), r"\[B, S\] or \[B, 1, S, S\]"),
        (dict(seq_lens=[1, 2, 3]), r"seq_lens has 3 entries but input_ids has 2 rows"),
        (dict(seq_lens=[1, 9]), r"seq_lens must lie in \[0, 4\].*\(1, 9\)"),
        (dict(seq_lens=[1, 1], attention_mask=torch.ones(2, 4)), r"either attention_mask or seq_lens"),
        (dict(attention_mask=torch.zeros(2, 1, 4, 4)), r"must be bool with True = masked"),
        (dict(seq_lens=np.array([1.5, 2.0])), r"seq_lens row 0 is 1\.5: lengths must be whole numbers"),
        (dict(seq_lens=[np.True_, 2]), r"seq_lens row 0 is np\.True_: lengths must be whole numbers"),
        (dict(seq_lens=np.array([[1], [2]])), r"seq_lens must be \[B\].*got shape \(2, 1\)"),
    ],
)
def test_bad_sources_raise(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        real_lengths(batch_size=2, row_length=4, **kwargs)


@pytest.mark.parametrize("seq_lens", [np.array([3, 0]), [np.int64(3), np.int32(0)], np.array([3.0, 0.0])],
                         ids=["numpy array", "numpy ints", "whole floats"])
def test_seq_lens_from_numpy(seq_lens):
    # A dataset built with numpy hands over numpy lengths: read as the same ints as a list.
    lengths = real_lengths(batch_size=2, row_length=4, seq_lens=seq_lens)
    assert lengths == [3, 0] and all(type(n) is int for n in lengths)
