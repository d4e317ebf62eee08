"""One launch of 2 processes for the LLaVA checks added after the PP=2 / CP=2 suite
(`testing.llava_parity.run_llava_parity`):

- host syncs of a packed forward + backward through the step at CP=2, counted per source
  (tests/perf/test_llava_sync_budget.py holds the assertions).

`launch()` runs it once per test session.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from megatron_vlm_packing.testing.distributed import run_distributed

UPSTREAM = "megatron/core/"  # Megatron-Core's own code (LLaVAModel._preprocess_data, TP embedding)


@functools.cache
def launch() -> dict:
    return run_distributed(run_llava_checks, 2, timeout_s=900)


class _PartitionKernel(nn.Module):
    """TE's `thd_get_partitioned_indices` on the CPU (a module, so that the sync counter can leave it out:
    on a GPU it is a TE kernel that reads nothing back)."""

    def forward(self, cu_seqlens_padded, total, cp_size, cp_rank):
        from megatron_vlm_packing.parallel.cp import cp_partition_index

        return cp_partition_index(cu_seqlens_padded, cp_size, cp_rank)


def _count_kernel_apart(kernel: _PartitionKernel) -> None:
    """Inside `llava_cp_without_te`: route LLaVA's CP partition through `kernel` (when the stand-in is ours)."""
    from megatron.core.models.multimodal import llava_model

    if llava_model.HAVE_TEX and getattr(llava_model.tex, "__name__", "") == "_Tex":
        llava_model.tex = type("_CountedTex", (), {"thd_get_partitioned_indices": staticmethod(kernel)})


def _split(syncs) -> dict:
    """Counts of `syncs` by source: Megatron-Core's own code, and ours (the step, packer, adapter, patch)."""
    ours = [e for e in syncs.events if UPSTREAM not in e.where]
    return dict(ours=len(ours), upstream=syncs.total - len(ours),
                ours_in=sorted({e.where.rsplit("/", 1)[-1].split(":")[0] for e in ours}), report=syncs.report())


def _counted(model, step, item, exclude):
    """(loss, grads, syncs) of one forward + backward of `item` through `step`."""
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    model.zero_grad(set_to_none=True)
    with count_host_syncs(exclude=exclude) as syncs:
        output, loss_fn = step(iter([item]), model)
        loss = loss_fn(output)[0]
        loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return loss.detach(), grads, syncs


def batched_syncs(model, batch):
    """LLaVA's own batched forward + backward (right-padded rows, no packing) on one process, counted."""
    from megatron_vlm_packing.testing.llava_parity import batched_targets
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    labels, loss_mask = batched_targets(batch, "hf")
    ids = batch["input_ids"]
    exclude = [layer.self_attention.core_attention
               for stack in (model.language_model.decoder, model.vision_model.decoder) for layer in stack.layers]
    with count_host_syncs(exclude=exclude) as syncs:
        losses, mask = model(batch["images"], ids, torch.arange(ids.shape[1])[None].expand_as(ids), None,
                             labels=labels, loss_mask=loss_mask, num_image_tiles=batch["num_image_tiles"])
        (losses * mask).sum().backward()
    return syncs


def sync_row(model, batch, kernel, batched) -> dict:
    """Syncs (by source) in the step packing and with a LlavaPackingCollator micro-batch; `batched`:
    LLaVA's own batched forward, counted on one process (megatron-core 0.16.1 runs batched CP only
    with megatron.training installed)."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator
    from megatron_vlm_packing.train.step import make_forward_step

    exclude = [layer.self_attention.core_attention  # the reference attention stands in for TE's
               for stack in (model.language_model.decoder, model.vision_model.decoder) for layer in stack.layers]
    exclude.append(kernel)
    step = make_forward_step(label_style="hf")
    row = {}
    for name, item in (("in_step", batch), ("loader", LlavaPackingCollator(space=LlavaSpace.of(model))(batch))):
        if name == "in_step":
            _counted(model, step, item, exclude)  # warm-up: the adapter is built on the first call
        loss, grads, syncs = _counted(model, step, item, exclude)
        row[name] = dict(_split(syncs), loss=loss.item(), grads=grads)
    row["batched"] = _split(batched)
    row["loss_diff"] = abs(row["in_step"]["loss"] - row["loader"]["loss"])
    row["grad_diff"] = (row["in_step"].pop("grads") - row["loader"].pop("grads")).abs().max().item()
    return row


def run_llava_checks(rank: int, world_size: int, seed: int = 11) -> dict:
    """Every check in one launch (2 processes); what rank 0 saw (reductions make the parity global)."""
    from megatron_vlm_packing.patches import (
        apply_llava_packed_boundaries, apply_thd_rotary, undo_llava_packed_boundaries, undo_thd_rotary,
    )
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.llava_parity import batches, build_tiny_llava, llava_cp_without_te

    result, clock = {"patches": (apply_llava_packed_boundaries(), apply_thd_rotary())}, [time.perf_counter()]
    kernel = _PartitionKernel()

    def lap(name):
        clock.append(time.perf_counter())
        result.setdefault("seconds", {})[name] = round(clock[-1] - clock[-2], 2)

    try:
        initialize_parallel(seed=seed)
        batched = batched_syncs(build_tiny_llava(seed), batches("hf", seed)[0])
        initialize_parallel(cp=2, seed=seed)
        with llava_cp_without_te():
            _count_kernel_apart(kernel)
            model = build_tiny_llava(seed, cp=2)
            result["syncs CP=2"] = sync_row(model, batches("hf", seed)[0], kernel, batched)
        lap("CP=2 syncs")
    finally:
        undo_thd_rotary()
        undo_llava_packed_boundaries()
    return result
