"""Core attention on torch's `varlen_attn` (CUDA, torch >= 2.10): packed THD without TE.

Why the boundaries passed are exact for real tokens: `varlen_attn` takes one boundary set, and we
give it the *physical* one (`cu_seqlens_padded`). Each document's real tokens are the first slots
of its physical span, so a causal query at a real slot only sees earlier slots of its own span,
which are all real. Pad slots attend to real tokens and pads; their outputs are never used (labels
are -100 and the loss mask is 0 there). Context parallelism is not supported by this backend.

Shape legend: T = packed tokens, H = query heads, Hk = key/value heads, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


class TorchVarlenCoreAttention(MegatronModule):
    """Megatron-Core core attention on `torch.nn.attention.varlen.varlen_attn` (THD) and SDPA (BSHD)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
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

            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            if kv_heads != heads:  # GQA: repeat K/V heads (varlen_attn wants equal head counts)
                key = key.repeat_interleave(heads // kv_heads, dim=1)
                value = value.repeat_interleave(heads // kv_heads, dim=1)
            out = varlen_attn(query, key, value, cu, cu, packed_seq_params.max_seqlen_q,
                              packed_seq_params.max_seqlen_kv, scale=self.softmax_scale,
                              window_size=(-1, 0) if causal else (-1, -1))
            out = out[0] if isinstance(out, tuple) else out  # [T, H, D]
            return out.reshape(out.shape[0], -1)
        # Dense rows: [S, B, H, D] -> SDPA wants [B, H, S, D].
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask.bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                             scale=self.softmax_scale, enable_gqa=kv_heads != heads,
                                             dropout_p=self.dropout if self.training else 0.0)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
