"""Hostile `PackedSeqParams` at the core attentions (the real Megatron-Core config and enums): each
case was computed silently (wrong) or failed far from the cause; now a ValueError naming the field."""

import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_vlm_packing.attention.reference import ReferenceCoreAttention
from megatron_vlm_packing.attention.torch_varlen import TorchVarlenCoreAttention

CU, CU_PADDED = torch.tensor([0, 5, 7, 10], dtype=torch.int32), torch.tensor([0, 8, 12, 16], dtype=torch.int32)
PARAMS = PackedSeqParams(qkv_format="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU, cu_seqlens_q_padded=CU_PADDED,
                         cu_seqlens_kv_padded=CU_PADDED, max_seqlen_q=8, max_seqlen_kv=8)


def config():
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, kv_channels=8, attention_dropout=0.0)


def qkv(tokens=16):
    torch.manual_seed(0)
    return torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)


def reference():
    return ReferenceCoreAttention(config(), 1, AttnMaskType.causal, "self")


def both(real, padded):
    real, padded = torch.tensor(real, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
    return dict(cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)


@pytest.mark.parametrize("fields, message", [
    # each of these ran and returned numbers
    (both([0, 9, 11, 14], [0, 8, 12, 16]),
     r"cu_seqlens_q has more real tokens than cu_seqlens_q_padded has slots: "
     r"\(document, \(real, physical\)\) \[\(0, \(9, 8\)\)\]"),
    (both([0, 5, 4, 10], [0, 8, 12, 16]),
     r"cu_seqlens_q must be non-decreasing, got lengths \(document, value\) \[\(1, -1\)\]"),
    (both([1, 5, 7, 10], [0, 8, 12, 16]), r"cu_seqlens_q and cu_seqlens_q_padded must start at 0, got 1 and 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 7, 10, 11]), cu_seqlens_kv=torch.tensor([0, 5, 7, 10, 11])),
     r"cu_seqlens_q_padded has 4 entries but cu_seqlens_q has 5"),
    (dict(cu_seqlens_q_padded=CU_PADDED.float() + 0.5, cu_seqlens_kv_padded=None),
     r"cu_seqlens_q_padded must be an integer tensor \(int32\), got torch.float32"),
    (dict(cu_seqlens_kv=torch.tensor([0, 6, 7, 10])), r"cu_seqlens_kv=\[0, 6, 7, 10\] differs from cu_seqlens_q"),
    # TE and varlen kernels size their grid by max_seqlen and leave a longer document's tail uncomputed
    (dict(max_seqlen_q=4, max_seqlen_kv=4),
     r"\{'max_seqlen_q': 4, 'max_seqlen_kv': 4\} below the longest physical document \(8 slots\)"),
    (dict(max_seqlen_q=torch.tensor(4)), r"\{'max_seqlen_q': 4\} below the longest physical document"),
    (dict(max_seqlen_q=8.0), r"max_seqlen_q must be a positive int, got float 8.0"),
    (dict(max_seqlen_kv=True), r"max_seqlen_kv must be a positive int, got bool True"),
    # loud before, but an einsum / broadcast error far from the cause
    (both([0, 5, 7], [0, 8, 12]), r"cu_seqlens_q_padded\[-1\]=12 but attention was given 16 tokens x cp_size 1 = 16"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 7])), r"cu_seqlens_q_padded has 4 entries but cu_seqlens_q has 3"),
])
def test_reference_thd_refuses_inconsistent_boundaries(fields, message):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=message):
        reference()(q, k, v, None, packed_seq_params=replace(PARAMS, **fields))


def test_reference_thd_refuses_a_query_of_the_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"takes query \[Tq, H, D\].*'query': \(16, 1, 2, 8\)"):
        reference()(q[:, None], k[:, None], v[:, None], None, packed_seq_params=PARAMS)


def test_reference_thd_accepts_the_legal_forms_unchanged():
    q, k, v = qkv()
    attention = reference()
    expected = attention(q, k, v, None, packed_seq_params=PARAMS)
    for fields in (dict(max_seqlen_q=None, max_seqlen_kv=None), dict(max_seqlen_q=np.int64(8)),
                   dict(max_seqlen_q=torch.tensor(8), max_seqlen_kv=torch.tensor(9)),  # Bridge's vision towers
                   dict(cu_seqlens_q=CU.long(), cu_seqlens_kv=CU.long(), cu_seqlens_q_padded=CU_PADDED.long(),
                        cu_seqlens_kv_padded=None)):
        torch.testing.assert_close(attention(q, k, v, None, packed_seq_params=replace(PARAMS, **fields)), expected)
    # no padded set: the real one is the physical one (zero-length real documents are legal)
    cu = torch.tensor([0, 8, 8, 16], dtype=torch.int32)
    unpadded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    with pytest.raises(ValueError, match=r"positive multiple of 2\*cp_size=1, got \(document, value\) \[\(1, 0\)\]"):
        attention(q, k, v, None, packed_seq_params=unpadded)
    cu = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    out = attention(q, k, v, None, packed_seq_params=replace(unpadded, cu_seqlens_q=cu, cu_seqlens_kv=cu))
    assert out.shape == (16, 16)


def varlen():
    return TorchVarlenCoreAttention(config(), 1, AttnMaskType.causal, "self")


@pytest.mark.parametrize("cls", [ReferenceCoreAttention, TorchVarlenCoreAttention])
@pytest.mark.parametrize("size", [True, 2.0, "2", None, 0, -1, torch.tensor(2)])
def test_a_config_context_parallel_size_that_is_not_a_positive_int_is_refused(cls, size):
    # read from the Megatron config unchecked: True == 1 ran as CP off, None / 0 were taken as CP off
    # (reference) and 2.0 as CP on, "2" / None raised a TypeError (varlen); refused as resolve_backend refuses
    cfg = config()
    cfg.context_parallel_size = size
    with pytest.raises(ValueError, match=re.escape(f"context_parallel_size must be a positive int, got {size!r}")):
        cls(cfg, 1, AttnMaskType.causal, "self")


@pytest.mark.parametrize("attention", [reference, varlen])
@pytest.mark.parametrize("qkv_format", [None, "sbhd", "bshd"])
def test_boundaries_a_dense_call_would_ignore_are_refused(attention, qkv_format):
    # PackedSeqParams' qkv_format defaults to None: Megatron then runs dense rows, and the pack of three
    # documents trained as one causal document (the outputs differed from the packed ones, no error)
    q, k, v = qkv()
    params = replace(PARAMS, qkv_format=qkv_format)
    with pytest.raises(ValueError, match=rf"qkv_format is {qkv_format!r}, so attention runs on dense rows and ignores "
                                         r"the boundaries, but cu_seqlens_q holds 3 documents for a query of shape "
                                         r"\(16, 1, 2, 8\) \(1 rows\).*set qkv_format='thd'"):
        attention()(q[:, None], k[:, None], v[:, None], None, packed_seq_params=params)


def test_per_row_boundaries_of_a_dense_call_are_left_alone():
    # Megatron's LLaVA passes qkv_format="sbhd" with one (real-length) boundary per row: causal rows are exact
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 2, 2, 8), torch.randn(8, 2, 2, 8), torch.randn(8, 2, 2, 8)
    rows = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 5, 13], dtype=torch.int32))
    attention = reference()
    torch.testing.assert_close(attention(q, k, v, None, packed_seq_params=rows), attention(q, k, v, None))


@pytest.mark.parametrize("fields, message", [
    (dict(cu_seqlens_q_padded=CU_PADDED.float(), cu_seqlens_kv_padded=None),
     r"cu_seqlens_q_padded must be an integer tensor \(int32\), got torch.float32"),  # .int() truncated it
    (dict(cu_seqlens_q_padded=CU_PADDED[None]),
     r"cu_seqlens_q_padded must be \[N\+1\] with N >= 1, got shape \(1, 4\)"),
    (dict(max_seqlen_q=None), r"\['max_seqlen_q'\] are None: varlen_attn needs the longest physical document"),
    (dict(max_seqlen_kv=8.5), r"max_seqlen_kv must be a positive int, got float 8.5"),
    (dict(cu_seqlens_q=None), r"cu_seqlens_q is None"),
])
def test_torch_varlen_checks_the_boundaries_from_metadata(fields, message):
    pytest.importorskip("torch.nn.attention.varlen")
    q, k, v = qkv()
    attention = TorchVarlenCoreAttention(config(), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match=message):
        attention(q, k, v, None, packed_seq_params=replace(PARAMS, **fields))


def test_torch_varlen_refuses_boundaries_on_another_device():
    pytest.importorskip("torch.nn.attention.varlen")
    q, k, v = qkv()
    attention = TorchVarlenCoreAttention(config(), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match=r"cu_seqlens_q_padded is on meta but the query is on cpu"):
        attention(q, k, v, None, packed_seq_params=replace(PARAMS, cu_seqlens_q_padded=CU_PADDED.to("meta")))
