"""The reference attention's masks and maths against plain per-sample SDPA (no Megatron needed)."""

import torch
import torch.nn.functional as F

from megatron_vlm_packing.attention.masks import packed_attention_mask, slot_documents
from megatron_vlm_packing.attention.reference import masked_attention


def test_slot_documents():
    cu, cu_p = torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8])
    doc, off, real = slot_documents(torch.arange(8), cu, cu_p)
    assert doc.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert off.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert real.tolist() == [True, True, True, False, True, True, False, False]


def test_mask_is_causal_within_real_tokens_of_each_document():
    cu, cu_p = torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8])
    allowed = packed_attention_mask(torch.arange(8), cu, cu_p, causal=True)
    assert allowed[2].tolist() == [True, True, True, False, False, False, False, False]
    assert allowed[5].tolist() == [False, False, False, False, True, True, False, False]
    assert not allowed[3].any() and not allowed[7].any()  # pad queries see nothing


def test_packed_reference_matches_per_sample_sdpa_with_gqa():
    torch.manual_seed(0)
    cu, cu_p = torch.tensor([0, 5, 6, 13]), torch.tensor([0, 8, 12, 16])
    q = torch.randn(16, 4, 8)
    k, v = torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    out = masked_attention(q, k, v, packed_attention_mask(torch.arange(16), cu, cu_p, causal=True), 8 ** -0.5)
    for start, n in ((0, 5), (8, 1), (12, 7)):
        sl = slice(start, start + n)
        expected = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].repeat_interleave(2, 1).transpose(0, 1),
            v[sl].repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
        torch.testing.assert_close(out[sl], expected, rtol=1e-5, atol=1e-6)
    assert out[5:8].abs().sum() == 0 and not out.isnan().any()


def test_dense_mask_combines_causal_and_megatron_padding_mask():
    from megatron_vlm_packing.attention.masks import dense_attention_mask

    torch.manual_seed(0)
    seq = 6
    masked = torch.zeros(2, 1, seq, seq, dtype=torch.bool)
    masked[1, :, :, 4:] = True  # row 1: keys 4 and 5 are padding (True = masked, Megatron's convention)
    allowed = dense_attention_mask(torch.arange(seq), seq, causal=True, attention_mask=masked)
    q, k, v = torch.randn(seq, 2, 8), torch.randn(seq, 2, 8), torch.randn(seq, 2, 8)
    for row in range(2):
        out = masked_attention(q, k, v, allowed[row], 8 ** -0.5)
        sdpa_mask = ~masked[row, 0] & torch.ones(seq, seq, dtype=torch.bool).tril()
        expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                  attn_mask=sdpa_mask).transpose(0, 1)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
