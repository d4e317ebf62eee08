"""Bridge parity: Megatron-Bridge's Qwen-VL models packed through our adapters vs each sample alone.

`run_bridge_parity(rank, world_size, cases)` is a `testing.run_distributed` target. For each family
the reference is the TP = CP = 1 model (Bridge's own, built by its provider) running every sample
alone as one dense unpadded row, with Bridge's own mRoPE positions. Each case then builds the model
at its layout, loads the reference weights (SwiGLU-aware TP shards), packs the micro-batch at real
lengths with images and videos, localizes it for this CP rank, and calls the model through the
family's adapter; every parameter gradient (vision tower included) is gathered back and compared.

A case is (family, tp, cp, sp[, "unpatched"]): "unpatched" runs without the Bridge patches (the
adapter's refusal bypassed) to show that a patch is necessary.

Shape legend: T = packed physical tokens, Tl = T / cp.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
from megatron_vlm_packing.bridge.smoke import alone_loss_sum
from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, build_tiny_bridge_model

SEED = 3
NUM_SAMPLES = 4


def _reference(family: str, samples: list[dict]):
    """(loss sum, grads, state) of the TP = CP = 1 model, every sample alone."""
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    initialize_parallel(seed=SEED)
    model = build_tiny_bridge_model(TinyBridgeConfig(family=family), seed=SEED)
    total = sum(alone_loss_sum(model, family, s) for s in samples)
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return total.detach(), grads, state


def micro_batch_of(batch: dict, cfg: TinyBridgeConfig, layout):
    """The packed `MicroBatch` of `batch` for `layout` (full length; `localize` cuts it)."""
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.packing.micro_batch import BatchStats, MicroBatch, VisionInputs

    packed = pack_batch(batch, tp_size=layout.tp_size, cp_size=layout.cp_size,
                        sequence_parallel=layout.sequence_parallel, label_style="hf", mrope=cfg.mrope_config())
    if isinstance(packed, MicroBatch) and packed.vision is not None:
        return packed
    # The first `PackedBatch` (before the typed seam): vision inputs passed through untouched.
    vision = VisionInputs(**{k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                   "video_grid_thw", "second_per_grid_ts") if k in batch})
    stats = BatchStats(real_tokens=packed.num_real_tokens, physical_tokens=packed.num_physical_tokens,
                       row_tokens=batch["input_ids"].numel())
    return MicroBatch(input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
                      position_ids=packed.position_ids, padding_mask=packed.padding_mask,
                      packed_seq_params=packed.packed_seq_params, rope_cu_seqlens=packed.rope_cu_seqlens,
                      stats=stats, vision=vision, plan=packed.plan, indices=packed.indices)


def _packed_step(model, batch: dict, cfg: TinyBridgeConfig, *, check: bool):
    """Forward + backward of one packed micro-batch through the family's adapter; the loss sum of
    this rank's tokens."""
    from megatron_vlm_packing.models.adapter import adapter_for, qualified_name
    from megatron_vlm_packing.packing.localize import localize
    from megatron_vlm_packing.parallel.layout import ParallelLayout

    layout = ParallelLayout.from_megatron(model.config)
    if check:
        adapter = adapter_for(model)
    else:  # "unpatched": the adapter would refuse; call its forward as it is
        from megatron_vlm_packing.models.adapter import _BUILTIN, _resolve

        adapter = object.__new__(_resolve(_BUILTIN[qualified_name(type(model))]))
    mb = localize(micro_batch_of(batch, cfg, layout), layout, adapter.needs)
    if check:
        adapter.check(mb)
    out = adapter.forward(model, mb)
    losses, mask = out if isinstance(out, tuple) else (out, mb.loss_mask)
    loss = (losses.float() * mask).sum()
    loss.backward()
    return loss.detach()


def _run_case(case: tuple, samples: list[dict], reference) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.parity import full_gradients, load_full_state, max_relative_error

    family, tp, cp, sp = case[:4]
    unpatched = "unpatched" in case[4:]
    ref_loss, ref_grads, state = reference
    initialize_parallel(tp=tp, cp=cp, seed=SEED)
    cfg = TinyBridgeConfig(family=family, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    undo_bridge_patches()
    if not unpatched:
        apply_bridge_patches()
    try:
        model = build_tiny_bridge_model(cfg, seed=SEED + 1)  # other weights: load_full_state must set them all
        load_full_state(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
        loss = _packed_step(model, collate_qwen_vl(samples), cfg, check=not unpatched)
    finally:
        undo_bridge_patches()
    dist.all_reduce(loss, group=ps.get_context_parallel_group())
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(), cp_group=ps.get_context_parallel_group())
    errors = {n: max_relative_error(g, ref_grads[n]) for n, g in grads.items()}
    vision = [n for n in errors if n.startswith(("vision_model.", "visual."))]
    worst = torch.tensor([abs(loss - ref_loss).item(), max(errors.values()), max(errors[n] for n in vision),
                          sum(errors[n] > 1e-3 for n in vision)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(case=case, loss=ref_loss.item(), abs_dloss=worst[0].item(), max_rel_grad_err=worst[1].item(),
                max_rel_vision_grad_err=worst[2].item(), vision_params_off=int(worst[3]),
                params=len(errors), vision_params=len(vision), missing=sorted(set(ref_grads) - set(grads)))


def run_bridge_parity(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """Every case of `cases` (grouped by family, one reference per family); results in order."""
    results, references = [], {}
    for case in cases:
        family = case[0]
        samples = qwen_vl_samples(TinyBridgeConfig(family=family), NUM_SAMPLES, seed=SEED)
        if family not in references:
            references[family] = _reference(family, samples)
        results.append(_run_case(case, samples, references[family]))
    return results
