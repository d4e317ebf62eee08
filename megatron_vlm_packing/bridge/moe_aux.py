"""Bridge's Qwen3-VL MoE under packing: the router's load-balancing loss must not count pad slots.

`run_bridge_moe_aux_loss(rank, world_size, layouts)` is a `run_distributed` target. For each (tp, cp, sp)
layout it builds the tiny Qwen3-VL MoE as Bridge's provider does, with the router's aux loss on, and records
the aux loss Megatron-Core attaches for the same real tokens (images and videos included) packed through the
shipped step three ways: with only the layout's alignment pads, padded to a fixed length (`pad_to`, many pad
slots), and as dense right-padded rows (`pack=False`). With `patches.apply_bridge_patches()` the two agree; the adapter's refusal without the pads patch is
recorded too.
"""

from __future__ import annotations

import torch

PAD_TO = 256
SEED = 3


def _moe_model(tp: int, cp: int, sp: bool):
    """The tiny Qwen3-VL MoE with the router's aux loss on (the parity suite runs it off)."""
    from megatron_vlm_packing.bridge.build import build_with_provider
    from megatron_vlm_packing.bridge.tiny import (TinyBridgeConfig, packed_core_attention, qwen3_vl_te_free_swaps,
                                                  tiny_bridge_provider)

    cfg = TinyBridgeConfig(family="qwen3_vl_moe", tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    provider = tiny_bridge_provider(cfg)
    provider.moe_aux_loss_coeff = 1.0
    provider.moe_router_load_balancing_type = "aux_loss"
    swaps = qwen3_vl_te_free_swaps(packed_core_attention(cfg.attention_backend))
    return cfg, build_with_provider(provider, swaps=swaps, seed=SEED).train()


def _aux_loss(model, batch: dict, *, pad_to: int | None, cp: int, pack: bool = True) -> float:
    """The router's aux losses of one micro-batch (forward + backward) summed over the TP x CP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.testing.moe_parity import recorded_aux_losses

    step = make_forward_step(pack=pack, label_style="hf", pad_to=pad_to, with_state=cp > 1)
    with recorded_aux_losses() as values:
        args = (None, iter([dict(batch)]), model) if cp > 1 else (iter([dict(batch)]), model)
        output, loss_func = step(*args)
        loss_func(output)[0].backward()
    aux = torch.stack([v.sum() for v in values]).sum().reshape(1)
    dist.all_reduce(aux, group=ps.get_tensor_and_context_parallel_group())
    return float(aux)


def run_bridge_moe_aux_loss(rank: int, world_size: int, layouts: list[tuple[int, int, bool]]) -> list[dict]:
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.patches.bridge_qwen3_vl_moe_pads import undo_bridge_qwen3_vl_moe_pads
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    results = []
    for tp, cp, sp in layouts:
        initialize_parallel(tp=tp, cp=cp, seed=SEED)
        cfg, model = _moe_model(tp, cp, sp)
        batch = collate_qwen_vl(qwen_vl_samples(cfg, 4, seed=SEED))
        result = dict(layout=(tp, cp, sp), real=int(batch["attention_mask"].sum()))
        undo_bridge_patches()
        apply_bridge_patches()
        try:
            result["aligned"] = _aux_loss(model, batch, pad_to=None, cp=cp)
            result["padded"] = _aux_loss(model, batch, pad_to=PAD_TO, cp=cp)
            result["dense"] = _aux_loss(model, batch, pad_to=None, cp=cp, pack=False)  # right-padded rows
            undo_bridge_qwen3_vl_moe_pads()
            try:
                _aux_loss(model, batch, pad_to=PAD_TO, cp=cp)
                result["refused_without_patch"] = None
            except ValueError as err:
                result["refused_without_patch"] = str(err)
        finally:
            undo_bridge_patches()
        results.append(result)
    return results
