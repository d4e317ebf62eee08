import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing import cp_partition_index, dense_cp_partition_index
from megatron_vlm_packing.parallel.cp import cp_partition_index_from_lengths


def te_rule(cu_seqlens_padded, cp_size, cp_rank):
    """The rule written out the slow way: each document in 2*cp chunks, keep r and 2cp-1-r."""
    out = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


def test_hand_worked_examples():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert cp_partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert cp_partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]
    # TE docstring-style example: cu_seqlens [0, 8, 16, 24, 40], cp 4 -> chunks of 1, 1, 1, 2
    cu = torch.tensor([0, 8, 16, 24, 40])
    assert cp_partition_index(cu, 4, 1).tolist() == [1, 6, 9, 14, 17, 22, 26, 27, 36, 37]
    assert dense_cp_partition_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert dense_cp_partition_index(12, 3, 2).tolist() == [4, 5, 6, 7]


def test_cp_size_one_is_identity():
    cu = torch.tensor([0, 3, 4, 9])
    assert cp_partition_index(cu, 1, 0).tolist() == list(range(9))


@settings(max_examples=60, deadline=None)
@given(
    cp_size=st.integers(1, 4),
    doc_chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
def test_every_rank_gets_its_share_and_ranks_cover_all(cp_size, doc_chunks):
    lengths = [2 * cp_size * c for c in doc_chunks]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    pieces = []
    for rank in range(cp_size):
        idx = cp_partition_index(cu, cp_size, rank)
        assert idx.dtype == torch.long and idx.numel() == total // cp_size
        assert idx.tolist() == te_rule(cu.tolist(), cp_size, rank)
        pieces.append(idx)
    assert sorted(torch.cat(pieces).tolist()) == list(range(total))


@pytest.mark.parametrize(
    "cu, cp_size, cp_rank, expected",
    [
        ([0, 6, 12], 2, 0, r"multiple of 2\*cp_size=4"),
        ([0, 8, 8], 2, 0, r"positive multiple"),
        ([2, 10], 2, 0, r"start at 0"),
        ([0, 8], 2, 2, r"cp_rank must be an int in \[0, 2\)"),
        ([0, 8], 0, 0, r"cp_size must be a positive int"),
        # bool sizes passed as 1: cp_size=True ran as CP=1, cp_rank=True as rank 1
        ([0, 8], True, 0, r"cp_size must be a positive int, got True"),
        ([0, 8], 2, True, r"cp_rank must be an int in \[0, 2\), got True"),
        # float boundaries were truncated by .long(): a document of 8.5 slots became 8
        ([0.0, 8.5, 16.0], 2, 0, r"cu_seqlens_padded must be an integer tensor \(int32\), got torch.float32"),
        ([False, True], 1, 0, r"cu_seqlens_padded must be an integer tensor \(int32\), got torch.bool"),
        ([[0, 8]], 2, 0, r"cu_seqlens_padded must be \[N\+1\] with N >= 1, got shape \(1, 2\)"),
    ],
)
def test_bad_boundaries_raise(cu, cp_size, cp_rank, expected):
    with pytest.raises(ValueError, match=expected):
        cp_partition_index(torch.tensor(cu), cp_size, cp_rank)


@pytest.mark.parametrize(
    "call, expected",
    [
        # a float length gave a float index (index_select refuses it far from here)
        (lambda: dense_cp_partition_index(8.0, 2, 0), r"seq_len must be a Python int, got float 8.0"),
        (lambda: dense_cp_partition_index(torch.tensor(8), 2, 0), r"seq_len must be a Python int, got Tensor"),
        (lambda: dense_cp_partition_index(8, True, 0), r"cp_size must be a positive int, got True"),
        (lambda: cp_partition_index_from_lengths([8.0], 1, 0), r"physical_lengths must be Python ints, got "
                                                                r"\(document, value\) \[\(0, 8.0\)\]"),
        (lambda: cp_partition_index_from_lengths([4, True], 1, 0), r"\[\(1, True\)\]"),
        (lambda: cp_partition_index_from_lengths(np.array([8, 4]), 2, 0), r"physical_lengths must be Python ints"),
        (lambda: cp_partition_index_from_lengths([], 2, 0), r"got 0 lengths"),
    ],
)
def test_bad_sizes_and_lengths_raise(call, expected):
    with pytest.raises(ValueError, match=expected):
        call()


def test_layout_refuses_a_bool_cp_rank():
    from megatron_vlm_packing.parallel.layout import ParallelLayout

    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\), got True"):
        ParallelLayout(cp_size=2, cp_rank=True)


def test_dense_bad_length_raises():
    with pytest.raises(ValueError, match=r"seq_len=10 must be a positive multiple of 2\*cp_size=4"):
        dense_cp_partition_index(10, 2, 0)
