"""LLaVA: boundaries after image expansion (bug class 2), as the original report measured it."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.models.llava import image_expansion, llava_expanded_lengths, remap_packed_seq_params
from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.testing.llava_parity import run_llava_parity

IMG = 127


def test_packed_llava_equals_batched_with_variable_tiles():
    r = run_distributed(run_llava_parity, 1)
    assert r["images"] >= 5 and r["tiles"][:5] == [1, 2, 1, 3, 1]
    assert r["patch_active"]
    assert r["patched"] <= 1.000001, r
    assert r["unpatched"] > 1.000001, r  # collapsed boundaries on the expanded sequence: wrong or a crash


def test_remap_moves_both_boundary_sets_into_the_expanded_space():
    ids = torch.tensor([[5, IMG, 6, 0, 7, IMG, IMG, 8]])  # doc 0: slots 0-3 (3 real), doc 1: slots 4-7
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=4, max_seqlen_kv=4)
    out = remap_packed_seq_params(params, ids, torch.tensor([2, 1, 3]), img_seq_len=4, image_token_index=IMG)
    # doc 0 grows by 2*4-1 = 7; doc 1 by (1*4-1) + (3*4-1) = 14
    assert out.cu_seqlens_q.tolist() == [0, 10, 28] and out.cu_seqlens_q_padded.tolist() == [0, 11, 29]
    assert out.cu_seqlens_kv.tolist() == out.cu_seqlens_q.tolist() and out.max_seqlen_q == 18
    assert out.cu_seqlens_q.dtype == torch.int32
    aligned = remap_packed_seq_params(params, ids, torch.tensor([2, 1, 3]), img_seq_len=4, image_token_index=IMG,
                                      total_multiple=8)
    assert aligned.cu_seqlens_q_padded.tolist() == [0, 11, 32]  # LLaVA's total padding joins the last doc
    with pytest.raises(ValueError, match=r"expanded documents \[0, 1\] have physical lengths \[11, 18\] that do not divide by 4"):
        remap_packed_seq_params(params, ids, torch.tensor([2, 1, 3]), img_seq_len=4, image_token_index=IMG,
                                segment_multiple=4)


def test_planner_path_gives_expanded_lengths_and_checks_counts():
    ids = torch.tensor([[5, IMG, 6, 0], [IMG, IMG, 7, 8]])
    assert llava_expanded_lengths(ids, [3, 4], torch.tensor([3, 1, 2]), img_seq_len=4, image_token_index=IMG) == [14, 14]
    with pytest.raises(ValueError, match="3 image tokens in input_ids but 2 entries in num_image_tiles"):
        image_expansion(ids, torch.tensor([1, 1]), img_seq_len=4, image_token_index=IMG)
