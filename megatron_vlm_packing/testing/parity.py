"""Parity helpers: packed vs each sample alone, parallel vs one process.

The reference is always the simplest thing that is obviously right: a TP=CP=PP=1 model running
each sample alone, batch size 1, unpadded. Parallel runs gather their shards back into full
tensors named like the reference, so every parameter gradient can be compared.

Shape legend: B = rows, S = row length, T = physical packed tokens, R = real tokens.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def token_mult_prob_error(logp_a: torch.Tensor, logp_b: torch.Tensor) -> float:
    """exp(mean |logp_a - logp_b|) over tokens: 1.0 means identical token probabilities."""
    return math.exp((logp_a.double() - logp_b.double()).abs().mean().item())


def max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, tiny): a scale-aware error for whole tensors."""
    scale = b.abs().max().clamp_min(1e-12)
    return ((a - b).abs().max() / scale).item()


def variable_batch(lengths: list[int], seq_len: int, *, vocab_size: int, seed: int) -> dict:
    """Megatron-style right-padded batch: random tokens, next-token-aligned random labels."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(1, vocab_size, (len(lengths), seq_len), generator=g), 0)
    labels = torch.where(keep, torch.randint(1, vocab_size, (len(lengths), seq_len), generator=g), -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": keep.long()}


def global_name(model: torch.nn.Module, name: str) -> str:
    """Parameter name with pipeline-local layer indices replaced by global ones."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        layers = model.get_submodule(".".join(parts[:i + 1]))
        layer = layers[int(parts[i + 1])]
        if hasattr(layer, "layer_number"):  # Megatron layers; plain torch ones (HF towers) keep their index
            parts[i + 1] = str(layer.layer_number - 1)
    return ".".join(parts)


def is_gated_fc1(model: torch.nn.Module, name: str) -> bool:
    """True for the weight/bias of a gated (SwiGLU) `linear_fc1`: two matrices [gate; up] stacked
    on dim 0, each split over TP separately (rank r holds [gate_r; up_r])."""
    module_name, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias") or not module_name.endswith("linear_fc1"):
        return False
    config = getattr(model.get_submodule(module_name), "config", None)
    return bool(getattr(config, "gated_linear_unit", False))


def tp_shard(full: torch.Tensor, param: torch.Tensor, *, gated: bool, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of a full (TP=1) tensor, laid out like `param` (gated fc1: per half)."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if gated:
        halves = full.chunk(2, dim=dim)
        return torch.cat([half.chunk(tp_size, dim=dim)[tp_rank] for half in halves], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_unshard(parts: list[torch.Tensor], param: torch.Tensor, *, gated: bool) -> torch.Tensor:
    """Every TP rank's shard (rank order) -> the full tensor (inverse of `tp_shard`)."""
    dim = param.partition_dim
    if gated:
        halves = [part.chunk(2, dim=dim) for part in parts]
        return torch.cat([torch.cat([h[i] for h in halves], dim=dim) for i in range(2)], dim=dim)
    return torch.cat(parts, dim=dim)


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor], *, tp_rank: int, tp_size: int) -> None:
    """Copy full (TP=1) weights, named like `global_name`, into a TP-sharded / PP-stage model."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = state[global_name(model, name)]
            param.copy_(tp_shard(full, param, gated=is_gated_fc1(model, name), tp_rank=tp_rank, tp_size=tp_size))


def _summed_over_tp(name: str, param: torch.Tensor, config) -> bool:
    """Grads Megatron sums over TP (finalize_model_grads): norms under SP, and q/k layernorm, whose
    TP ranks each hold the grad from their own heads only."""
    if getattr(param, "tensor_model_parallel", False):
        return False
    qk = bool(getattr(config, "qk_layernorm", False)) and ("q_layernorm" in name or "k_layernorm" in name)
    return qk or bool(getattr(param, "sequence_parallel", False))


def full_gradients(model: torch.nn.Module, *, tp_group=None, cp_group=None,
                   reduced_by_megatron: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the single-process model would have it.

    - TP-split parameters are all-gathered over TP along their partition dim (a gated `linear_fc1`
      per half: see `tp_shard`).
    - Parameters whose TP ranks hold partial grads (norms under SP, marked `sequence_parallel`;
      q/k layernorm, by name, when the model's config has `qk_layernorm`) are summed over TP.
    - Under CP every rank saw part of the tokens: grads are summed over CP.

    With `reduced_by_megatron` the grads are read from `main_grad` (Megatron's
    `DistributedDataParallel`), where `finalize_model_grads` already did the SP / q-k layernorm and
    DP x CP reductions: only the TP gather is left to do here.
    """
    config = getattr(model, "config", None)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    grads = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if reduced_by_megatron else param.grad
        grad = (grad if grad is not None else torch.zeros_like(param)).detach().clone()
        if cp_group is not None and not reduced_by_megatron and dist.get_world_size(cp_group) > 1:
            dist.all_reduce(grad, group=cp_group)
        if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = tp_unshard(parts, param, gated=is_gated_fc1(model, name))
        elif tp_size > 1 and not reduced_by_megatron and _summed_over_tp(name, param, config):
            dist.all_reduce(grad, group=tp_group)
        grads[global_name(model, name)] = grad
    return grads


def gather_in_order(local: torch.Tensor, order: torch.Tensor, cp_group) -> torch.Tensor:
    """[R, L/cp, ...] CP-local values -> [R, L, ...] in global order (no autograd).

    Args:
        order: [L] long, every CP rank's partition index concatenated in rank order.
    """
    if dist.get_world_size(cp_group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    gathered = torch.cat(parts, dim=1)
    out = torch.empty_like(gathered)
    out[:, order] = gathered
    return out


def gather_cp_tokens(local: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_group) -> torch.Tensor:
    """[1, T/cp, ...] zigzag-local values -> [1, T, ...] in packed order (no autograd)."""
    from megatron_vlm_packing.parallel.cp import cp_partition_index

    cp_size = dist.get_world_size(cp_group)
    order = torch.cat([cp_partition_index(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
    return gather_in_order(local, order, cp_group)
