"""Core attention on torch's `varlen_attn` (CUDA, torch >= 2.10): packed THD without TE.

Why the boundaries passed are exact for real tokens: `varlen_attn` takes one boundary set, and we
give it the *physical* one (`cu_seqlens_padded`). Each document's real tokens are the first slots
of its physical span, so a causal query at a real slot only sees earlier slots of its own span,
which are all real. Pad slots attend to real tokens and pads; their outputs are never used (labels
are -100 and the loss mask is 0 there). Context parallelism is not supported by this backend.

Keyword arguments are chosen from `varlen_attn`'s signature (features, not versions): torch 2.10
takes `is_causal` and always scales by 1/sqrt(D); later releases take `scale`, `window_size`
(causal is (-1, 0)) and `enable_gqa`.

Shape legend: T = packed tokens, H = query heads, Hk = key/value heads, D = head dim.
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_vlm_packing.attention.boundaries import (
    check_max_seqlen_type, check_thd_query, physical_boundaries_of, refuse_ignored_boundaries,
)
from megatron_vlm_packing.attention.spec import check_context_parallel_size


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class VarlenCall(NamedTuple):
    """How to call a given `varlen_attn`: its keyword arguments and what to do before it."""

    kwargs: dict
    query_scale: float  # multiply the query by this (1.0: the kernel applies our scale itself)
    repeat_kv: int  # repeat K/V heads this many times (1: the kernel does GQA itself, or no GQA)


def varlen_call(parameters, *, causal: bool, scale: float, head_dim: int, heads: int, kv_heads: int) -> VarlenCall:
    """Map our attention settings onto the keyword arguments a `varlen_attn` signature accepts.

    Args:
        parameters: names of `varlen_attn`'s parameters (`inspect.signature(varlen_attn).parameters`).
    """
    kwargs, query_scale = {}, 1.0
    if "window_size" in parameters:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in parameters:
        kwargs["is_causal"] = causal
    else:
        raise ValueError(f"varlen_attn takes neither window_size nor is_causal: {sorted(parameters)}")
    if "scale" in parameters:
        kwargs["scale"] = scale
    else:  # the kernel scales by 1/sqrt(D): fold the rest of our scale into q
        query_scale = scale * math.sqrt(head_dim)
    repeat_kv = heads // kv_heads
    if repeat_kv > 1 and "enable_gqa" in parameters:
        kwargs["enable_gqa"], repeat_kv = True, 1
    return VarlenCall(kwargs, query_scale, repeat_kv)


class TorchVarlenCoreAttention(MegatronModule):
    """Megatron-Core core attention on `torch.nn.attention.varlen.varlen_attn` (THD) and SDPA (BSHD)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config)
        if check_context_parallel_size(config.context_parallel_size) > 1:
            raise ValueError(f"the torch varlen backend has no context parallelism "
                             f"(context_parallel_size={config.context_parallel_size}); use 'te' or 'reference'")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = attention_dropout if attention_dropout is not None else config.attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        heads, kv_heads = query.shape[-2], key.shape[-2]
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            from torch.nn.attention.varlen import varlen_attn

            cu = self._checked_boundaries(query, key, value, packed_seq_params)
            call = varlen_call(inspect.signature(varlen_attn).parameters, causal=causal, scale=self.softmax_scale,
                               head_dim=query.shape[-1], heads=heads, kv_heads=kv_heads)
            if call.repeat_kv > 1:  # GQA on a kernel without enable_gqa: repeat K/V heads
                key = key.repeat_interleave(call.repeat_kv, dim=1)
                value = value.repeat_interleave(call.repeat_kv, dim=1)
            if call.query_scale != 1.0:
                query = query * call.query_scale
            out = varlen_attn(query, key, value, cu.int(), cu.int(), packed_seq_params.max_seqlen_q,
                              packed_seq_params.max_seqlen_kv, **call.kwargs)
            out = out[0] if isinstance(out, tuple) else out  # [T, H, D]
            return out.reshape(out.shape[0], -1)
        refuse_ignored_boundaries(packed_seq_params, query)
        # Dense rows: [S, B, H, D] -> SDPA wants [B, H, S, D].
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                             scale=self.softmax_scale, enable_gqa=kv_heads != heads,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    @staticmethod
    def _checked_boundaries(query, key, value, params) -> torch.Tensor:
        """[N+1] the physical boundaries `varlen_attn` gets, checked from metadata only (no host read:
        this is the hot path). A float set was truncated by `.int()`; a set on another device, a None
        or float `max_seqlen_*` failed inside the kernel. Values (monotonic, covering T, `max_seqlen_*`
        covering every document) are not read here: `pack_batch` builds them right, `localize` checks
        a plan's `max_seqlen_*`, and the reference backend checks them all."""
        check_thd_query(query, key, value)
        name, cu = physical_boundaries_of(params)
        if cu.device != query.device:
            raise ValueError(f"packed_seq_params.{name} is on {cu.device} but the query is on {query.device}")
        check_max_seqlen_type(params, allow_tensor=True)
        missing = [n for n in ("max_seqlen_q", "max_seqlen_kv") if getattr(params, n) is None]
        if missing:
            raise ValueError(f"packed_seq_params {missing} are None: varlen_attn needs the longest physical document")
        return cu
