"""layer_spec / resolve_backend choose only backends that run here; varlen_attn calls follow its signature."""

import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_vlm_packing.attention import layer_spec, resolve_backend
from megatron_vlm_packing.attention import torch_varlen
from megatron_vlm_packing.attention.reference import ReferenceCoreAttention
from megatron_vlm_packing.attention.torch_varlen import varlen_call


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")
def test_cpu_resolves_to_reference_and_refuses_gpu_backends():
    assert resolve_backend("auto") == "reference" and resolve_backend("reference") == "reference"
    with pytest.raises(ValueError, match="Transformer Engine"):
        resolve_backend("te")
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend("torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("flash")


def test_auto_never_picks_torch_varlen_under_context_parallelism(monkeypatch):
    monkeypatch.setattr(torch_varlen, "varlen_available", lambda: True)
    monkeypatch.setattr("megatron_vlm_packing.attention.spec.te_available", lambda: False)
    assert resolve_backend("auto") == "torch"
    assert resolve_backend("auto", context_parallel_size=2) == "reference"
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        resolve_backend("torch", context_parallel_size=2)


def test_reference_spec_swaps_only_core_attention_and_leaves_megatron_spec_alone():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    ours = layer_spec("reference").submodules.self_attention.submodules
    stock = get_gpt_layer_local_spec().submodules.self_attention.submodules
    assert ours.core_attention is ReferenceCoreAttention
    assert ours.linear_qkv is stock.linear_qkv and ours.linear_proj is stock.linear_proj
    assert stock.core_attention is not ReferenceCoreAttention  # Megatron's own spec was copied, not mutated


def _old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn signature."""


def _new(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
         window_size=(-1, -1), enable_gqa=False):
    """torch >= 2.12's varlen_attn signature."""


def test_varlen_call_follows_the_signature():
    params = inspect.signature(_new).parameters
    call = varlen_call(params, causal=True, scale=0.1, head_dim=16, heads=8, kv_heads=2)
    assert call.kwargs == {"window_size": (-1, 0), "scale": 0.1, "enable_gqa": True}
    assert call.query_scale == 1.0 and call.repeat_kv == 1
    call = varlen_call(inspect.signature(_old).parameters, causal=True, scale=0.1, head_dim=16, heads=8, kv_heads=2)
    assert call.kwargs == {"is_causal": True} and call.repeat_kv == 4
    assert math.isclose(call.query_scale, 0.1 * 4.0)
    with pytest.raises(ValueError, match="neither window_size nor is_causal"):
        varlen_call({"query": None}, causal=True, scale=0.1, head_dim=16, heads=8, kv_heads=8)


def test_folding_the_scale_into_q_is_exact_for_a_kernel_that_scales_by_rsqrt_d():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 16, dtype=torch.float64) for _ in range(3))
    call = varlen_call({"is_causal": None}, causal=True, scale=0.05, head_dim=16, heads=4, kv_heads=4)
    folded = F.scaled_dot_product_attention(q * call.query_scale, k, v, is_causal=True)  # default 1/sqrt(16)
    torch.testing.assert_close(folded, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.05))


def test_installed_varlen_attn_signature_is_understood():
    pytest.importorskip("torch.nn.attention.varlen")
    from torch.nn.attention.varlen import varlen_attn

    call = varlen_call(inspect.signature(varlen_attn).parameters, causal=True, scale=0.1, head_dim=16,
                       heads=4, kv_heads=2)
    assert call.kwargs.get("window_size", (-1, 0)) == (-1, 0) and call.kwargs.get("is_causal", True)


@pytest.mark.parametrize("size", [True, False, 2.0, "2", None, 0, -1, torch.tensor(2)])
def test_context_parallel_size_must_be_a_positive_int(size):
    # True == 1 ran as CP = 1 and 2.0 as CP > 1 unchecked; refused as ParallelLayout and PackMultiples refuse
    # a bool or a non-int (numpy ints included), naming the argument and the value
    with pytest.raises(ValueError, match=re.escape(f"context_parallel_size must be a positive int, got {size!r}")):
        resolve_backend("reference", context_parallel_size=size)
    with pytest.raises(ValueError, match="context_parallel_size must be a positive int"):
        layer_spec("auto", context_parallel_size=size)
