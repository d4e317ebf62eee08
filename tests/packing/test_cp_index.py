import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing import cp_partition_index, dense_cp_partition_index


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
    ],
)
def test_bad_boundaries_raise(cu, cp_size, cp_rank, expected):
    with pytest.raises(ValueError, match=expected):
        cp_partition_index(torch.tensor(cu), cp_size, cp_rank)


def test_dense_bad_length_raises():
    with pytest.raises(ValueError, match=r"seq_len=10 must be a positive multiple of 2\*cp_size=4"):
        dense_cp_partition_index(10, 2, 0)
