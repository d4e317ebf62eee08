"""Packed VLM parity: `make_forward_step` + `PackedVLM` under TP/CP/SP vs each sample alone.

`run_vlm_parity(rank, world_size, layouts)` is a `run_distributed` target. The reference is the
single-process model running each sample (text + its images) alone through the dense path; the
parallel run packs micro-batches with images and goes through `get_forward_backward_func`.
Gradients include the vision tower.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_vlm_packing.data import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.packed_vlm import PackedVLM
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.models.vision import TinyVisionTower
from megatron_vlm_packing.step import make_forward_step
from megatron_vlm_packing.testing.distributed import initialize_parallel
from megatron_vlm_packing.testing.parity import full_gradients, max_relative_error
from megatron_vlm_packing.testing.parity_cases import load_sharded

DATA = SyntheticVLMConfig(max_text=24, max_images=2, grid_choices=(2, 4))
LM = TinyGPTConfig(vocab_size=DATA.vocab_size, hidden_size=32, max_sequence_length=512)


PIPELINE_PAD_TO = 256  # a fixed packed length: pipeline stages exchange static shapes


def build_vlm(cfg: TinyGPTConfig, seed: int, *, pre_process: bool = True, post_process: bool = True) -> PackedVLM:
    """The vision tower lives on the first pipeline stage only."""
    torch.manual_seed(seed)
    lm = build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False, pre_process=pre_process,
                        post_process=post_process)
    vision = TinyVisionTower(patch_features=DATA.patch_features, width=16, out_hidden=cfg.hidden_size, heads=2) \
        if pre_process else None
    return PackedVLM(lm, vision, image_token_id=DATA.image_token_id)


class _NotThisRank:
    """The iterator of a rank that must not read data (TP rank > 0 when rank 0 broadcasts)."""

    def __iter__(self):
        return self

    def __next__(self):
        raise AssertionError("only TP rank 0 reads the data iterator when broadcasting")


def run_steps(model, batches, *, pack: bool, broadcast: bool = False, pad_to: int | None = None):
    """Forward + backward of every batch through Megatron's schedule; returns [batches, 2] (loss sum,
    tokens), zeros on pipeline stages other than the last."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reader = iter(batches) if not broadcast or ps.get_tensor_model_parallel_rank() == 0 else _NotThisRank()
    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(pack=pack, broadcast_from_tp_rank0=broadcast, pad_to=pad_to),
        data_iterator=reader, model=[model],
        num_microbatches=len(batches), seq_length=pad_to or 0, micro_batch_size=1, forward_only=False)
    if not reports:  # not the last pipeline stage
        return torch.zeros(len(batches), 2)
    return torch.stack([r["lm loss"] for r in reports])  # [num_batches, 2] = (loss_sum, tokens)


def reference(samples_per_batch, seed):
    initialize_parallel(seed=seed)
    model = build_vlm(LM, seed)
    sums = []
    for samples in samples_per_batch:
        sums.append(run_steps(model, [collate([s]) for s in samples], pack=False).sum(0))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(sums), grads, state


def run_vlm_parity(rank: int, world_size: int, layouts: list[tuple], seed: int = 7):
    """For each (tp, cp, sp[, broadcast[, pp]]): worst |d loss_sum| and relative grad error vs one process.

    With `broadcast`, only TP rank 0 reads the data iterator and broadcasts each micro-batch; with
    pp > 1 the packs have a fixed length (`pad_to`) and the vision tower sits on the first stage.
    """
    from megatron.core import parallel_state as ps

    samples_per_batch = [synthetic_samples(4, seed=seed + i, cfg=DATA) for i in range(2)]
    ref_sums, ref_grads, state = reference(samples_per_batch, seed)
    results = []
    for layout in layouts:
        tp, cp, sp = layout[:3]
        broadcast = len(layout) > 3 and layout[3]
        pp = layout[4] if len(layout) > 4 else 1
        initialize_parallel(tp=tp, cp=cp, pp=pp, seed=seed)
        cfg = replace(LM, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp, pipeline_parallel=pp)
        model = build_vlm(cfg, seed, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        load_sharded(model, state, ps.get_tensor_model_parallel_rank(), tp)
        sums = run_steps(model, [collate(s) for s in samples_per_batch], pack=True, broadcast=broadcast,
                         pad_to=PIPELINE_PAD_TO if pp > 1 else None)
        dist.all_reduce(sums, group=ps.get_context_parallel_group())  # each CP rank holds part of the tokens
        dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())  # only the last stage has losses
        grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(),
                               cp_group=ps.get_context_parallel_group())
        grad_err = max(max_relative_error(g, ref_grads[n]) for n, g in grads.items())
        vision_params = sum(1 for n in grads if n.startswith("vision."))
        worst = torch.tensor([(sums - ref_sums).abs().max().item(), grad_err, vision_params])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        name = f"tp={tp} cp={cp} sp={sp}" + (" broadcast" if broadcast else "") + (f" pp={pp}" if pp > 1 else "")
        results.append(dict(layout=name, max_dloss_sum=worst[0].item(), max_rel_grad_err=worst[1].item(),
                            tokens=ref_sums[:, 1].tolist(), vision_params=int(worst[2])))
    return results
