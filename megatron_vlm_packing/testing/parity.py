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


def full_gradients(model: torch.nn.Module, *, tp_group=None, cp_group=None,
                   reduced_by_megatron: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the single-process model would have it.

    - TP-split parameters are all-gathered over TP along their partition dim.
    - Parameters marked `sequence_parallel` (norms under SP) hold partial grads: summed over TP.
    - Under CP every rank saw part of the tokens: grads are summed over CP.

    With `reduced_by_megatron` the grads are read from `main_grad` (Megatron's
    `DistributedDataParallel`), where `finalize_model_grads` already did the SP and DP x CP
    reductions: only the TP gather is left to do here.
    """
    grads = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if reduced_by_megatron else param.grad
        grad = (grad if grad is not None else torch.zeros_like(param)).detach().clone()
        if reduced_by_megatron:
            cp_group = None
        if cp_group is not None and dist.get_world_size(cp_group) > 1:
            dist.all_reduce(grad, group=cp_group)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            if getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(tp_group))]
                dist.all_gather(parts, grad.contiguous(), group=tp_group)
                grad = torch.cat(parts, dim=param.partition_dim)
            elif getattr(param, "sequence_parallel", False) and not reduced_by_megatron:
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
