"""Reference core attention: exact masked attention for Megatron-Core, on CPU or GPU, with CP.

Plugged in at `self_attention.submodules.core_attention` of a GPT layer spec. It is the truth
for parity tests: plain softmax attention in float32 over an explicit mask built from both boundary
sets (causal within the real tokens of each document), GQA by repeating K/V heads, and context
parallelism by all-gathering K/V over the CP group and restoring the global order with the same
zigzag index the data was partitioned with. Memory is O(Tq * T): for tests and small models.

Shape legend: T = physical packed tokens (all CP ranks), Tq = local tokens, H = query heads,
Hk = key/value heads, D = head dim, S = dense row length, B = batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_vlm_packing.attention.boundaries import check_thd_query, read_thd_boundaries, refuse_ignored_boundaries
from megatron_vlm_packing.attention.masks import dense_attention_mask, packed_attention_mask
from megatron_vlm_packing.attention.spec import check_context_parallel_size
from megatron_vlm_packing.parallel.cp import dense_cp_partition_index, zigzag_index


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 with the exact backward (sum every rank's grad, keep our chunk).

    An autograd.Function because torch's functional all_gather backward needs reduce_scatter,
    which gloo lacks; all_reduce + slice is exact and works on every backend.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, x.contiguous(), group=group)
        return torch.cat(chunks, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * size:(rank + 1) * size], None


def gather_sequence_for_cp(x: torch.Tensor, order: torch.Tensor, group) -> torch.Tensor:
    """[Tq, ...] local zigzag tokens -> [T, ...] global order. `order`: [T] concat of all ranks' indices."""
    gathered = _AllGatherSeq.apply(x, group)  # [cp * Tq, ...] in rank order
    return gathered[torch.argsort(order)]


def masked_attention(q, k, v, allowed, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over `allowed`, float32; fully masked queries give 0.

    Args:
        q: [Tq, H, D]; k, v: [T, Hk, D] with H a multiple of Hk; allowed: [Tq, T] bool.

    Returns:
        [Tq, H, D] in q's dtype.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} must be a multiple of key/value heads {kv_heads}")
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed[None], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1) * allowed.any(dim=-1)[None, :, None]
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


class ReferenceCoreAttention(MegatronModule):
    """Megatron-Core core attention (same constructor and forward as `DotProductAttention`)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("ReferenceCoreAttention is exact attention: attention_dropout must be 0")
        check_context_parallel_size(getattr(config, "context_parallel_size", 1))
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.pg_collection = pg_collection

    def _cp_group(self):
        """The CP group, or None when this module's config has CP off.

        Decided from the config, as TE's attention does: a module built with
        context_parallel_size = 1 (e.g. a vision tower beside a CP language model) may still hold
        the language model's CP group in its process-group collection.
        """
        if check_context_parallel_size(getattr(self.config, "context_parallel_size", 1)) == 1:
            return None
        group = getattr(self.pg_collection, "cp", None)
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        return group

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if attention_bias is not None:
            raise ValueError("ReferenceCoreAttention does not support attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        group = self._cp_group()
        cp_size, cp_rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd(query, key, value, packed_seq_params, causal, group, cp_size, cp_rank)
        refuse_ignored_boundaries(packed_seq_params, query)
        return self._bshd(query, key, value, attention_mask, causal, group, cp_size, cp_rank)

    def _thd(self, q, k, v, params, causal, group, cp_size, cp_rank):
        """q: [Tq, H, D]; k, v: [Tq, Hk, D] -> [Tq, H*D]."""
        check_thd_query(q, k, v)
        local = q.shape[0]
        # One host read checks both boundary sets against each other, the tokens and max_seqlen_*.
        bounds = read_thd_boundaries(params, local_tokens=local, cp_size=cp_size, device=q.device)
        cu, cu_padded = bounds.cu_seqlens, bounds.cu_seqlens_padded
        q_positions = zigzag_index(cu_padded, cp_size, cp_rank, local_total=local).index
        if cp_size > 1:
            order = torch.cat([zigzag_index(cu_padded, cp_size, r, local_total=local).index for r in range(cp_size)])
            k, v = gather_sequence_for_cp(k, order, group), gather_sequence_for_cp(v, order, group)
        allowed = packed_attention_mask(q_positions, cu, cu_padded, causal=causal, total=bounds.total)
        out = masked_attention(q, k, v, allowed, self.softmax_scale)  # [Tq, H, D]
        return out.reshape(out.shape[0], -1)

    def _bshd(self, q, k, v, attention_mask, causal, group, cp_size, cp_rank):
        """q: [Sq, B, H, D]; k, v: [Sq, B, Hk, D] -> [Sq, B, H*D]."""
        seq_local = q.shape[0]
        seq_len = seq_local * cp_size
        if cp_size > 1:
            if attention_mask is not None:
                raise ValueError("ReferenceCoreAttention with CP > 1 takes no dense attention_mask")
            order = torch.cat([dense_cp_partition_index(seq_len, cp_size, r, device=q.device) for r in range(cp_size)])
            k, v = gather_sequence_for_cp(k, order, group), gather_sequence_for_cp(v, order, group)
            q_positions = dense_cp_partition_index(seq_len, cp_size, cp_rank, device=q.device)
        else:
            q_positions = torch.arange(seq_len, device=q.device)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.bool()
        allowed = dense_attention_mask(q_positions, seq_len, causal=causal, attention_mask=attention_mask)
        outs = [masked_attention(q[:, b], k[:, b], v[:, b], allowed[min(b, allowed.shape[0] - 1)], self.softmax_scale)
                for b in range(q.shape[1])]
        out = torch.stack(outs, dim=1)  # [Sq, B, H, D]
        return out.reshape(out.shape[0], out.shape[1], -1)
