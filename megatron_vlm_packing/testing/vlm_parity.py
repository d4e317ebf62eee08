"""Packed VLM parity: `make_forward_step` + `PackedVLM` under TP/CP/SP/PP vs each sample alone.

`run_vlm_parity(rank, world_size, cases)` is a `run_distributed` target. For each `VLMCase` the
reference is the single-process model running each sample (text + its images, videos, audio)
alone, through the same shipped step with packing off; the parallel run packs micro-batches
through `get_forward_backward_func` with the shipped step and loss. Gradients include the vision
and audio towers. With `mrope=True` the language model uses mRoPE (Qwen2-VL rule) and `PackedVLM`
installs the packed rotary itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.audio import TinyAudioTower
from megatron_vlm_packing.models.packed_vlm import PackedVLM
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.models.vision import TinyVisionTower
from megatron_vlm_packing.rope import MRopeConfig
from megatron_vlm_packing.step import make_forward_step
from megatron_vlm_packing.runtime.launcher import initialize_parallel
from megatron_vlm_packing.testing.parity import full_gradients, max_relative_error
from megatron_vlm_packing.testing.parity_cases import load_sharded

DATA = SyntheticVLMConfig(max_text=24, max_images=2, grid_choices=(2, 4))
MEDIA = SyntheticVLMConfig(max_text=12, max_images=2, grid_choices=(2, 4), max_videos=1, max_audios=2)
LM = TinyGPTConfig(vocab_size=DATA.vocab_size, hidden_size=32, max_sequence_length=512)
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=MEDIA.image_token_id, video_token_id=MEDIA.video_token_id,
                   vision_start_token_id=MEDIA.vision_start_id, mrope_section=(1, 1, 2))
PIPELINE_PAD_TO = 256  # a fixed packed length: pipeline stages exchange static shapes


@dataclass(frozen=True)
class VLMCase:
    """One parallel layout; `media` adds videos and audio clips to the images; `mrope` the 3D rotary."""

    tp: int = 1
    cp: int = 1
    sp: bool = False
    broadcast: bool = False
    pp: int = 1
    media: bool = False
    mrope: bool = False

    @property
    def name(self) -> str:
        parts = [f"tp={self.tp} cp={self.cp} sp={self.sp}"]
        parts += ["broadcast"] * self.broadcast + [f"pp={self.pp}"] * (self.pp > 1)
        parts += ["images+videos+audio"] * self.media + ["mrope"] * self.mrope
        return " ".join(parts)


def build_vlm(cfg: TinyGPTConfig, seed: int, *, media: bool = False, mrope: bool = False, pre_process: bool = True,
              post_process: bool = True) -> PackedVLM:
    """The towers live on the first pipeline stage only."""
    torch.manual_seed(seed)
    if mrope:
        cfg = replace(cfg, position_embedding_type="mrope", mrope_section=ROPE.mrope_section)
    lm = build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False, pre_process=pre_process,
                        post_process=post_process)
    data = MEDIA if media else DATA
    vision = TinyVisionTower(patch_features=data.patch_features, width=16, out_hidden=cfg.hidden_size, heads=2) \
        if pre_process else None
    audio = TinyAudioTower(mel_bins=data.mel_bins, width=16, out_hidden=cfg.hidden_size, n_window=data.audio_n_window) \
        if pre_process and media else None
    return PackedVLM(lm, vision, image_token_id=data.image_token_id, video_token_id=data.video_token_id if media else None,
                     audio=audio, audio_token_id=data.audio_token_id if media else None, mrope=ROPE if mrope else None)


class _NotThisRank:
    """The iterator of a rank that must not read data (TP rank > 0 when rank 0 broadcasts)."""

    def __iter__(self):
        return self

    def __next__(self):
        raise AssertionError("only TP rank 0 reads the data iterator when broadcasting")


def run_steps(model, batches, *, pack: bool, broadcast: bool = False, pad_to: int | None = None):
    """Forward + backward of every batch through Megatron's schedule with the shipped step.

    Returns [batches, 2] (loss sum, tokens) on the last pipeline stage, None on the others.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reader = iter(batches) if not broadcast or ps.get_tensor_model_parallel_rank() == 0 else _NotThisRank()
    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(pack=pack, broadcast_from_tp_rank0=broadcast, pad_to=pad_to),
        data_iterator=reader, model=[model],
        num_microbatches=len(batches), seq_length=pad_to or 0, micro_batch_size=1, forward_only=False)
    if not reports:  # not the last pipeline stage
        return None
    return torch.stack([r["lm loss"] for r in reports])  # [num_batches, 2] = (loss_sum, tokens)


def samples_for(case: VLMCase, seed: int) -> list[list[dict]]:
    return [synthetic_samples(4, seed=seed + i, cfg=MEDIA if case.media else DATA) for i in range(2)]


def reference(case: VLMCase, seed: int):
    """Each sample alone (dense path, batch of one), one process: loss sums, grads and weights."""
    initialize_parallel(seed=seed)
    model = build_vlm(LM, seed, media=case.media, mrope=case.mrope)
    sums = [run_steps(model, [collate([s]) for s in samples], pack=False).sum(0) for samples in samples_for(case, seed)]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return torch.stack(sums), grads, state


def run_case(case: VLMCase, seed: int, truth) -> dict:
    from megatron.core import parallel_state as ps

    ref_sums, ref_grads, state = truth
    initialize_parallel(tp=case.tp, cp=case.cp, pp=case.pp, seed=seed)
    cfg = replace(LM, tensor_parallel=case.tp, context_parallel=case.cp, sequence_parallel=case.sp,
                  pipeline_parallel=case.pp)
    model = build_vlm(cfg, seed, media=case.media, mrope=case.mrope, pre_process=ps.is_pipeline_first_stage(),
                      post_process=ps.is_pipeline_last_stage())
    load_sharded(model, state, ps.get_tensor_model_parallel_rank(), case.tp)
    sums = run_steps(model, [collate(s) for s in samples_for(case, seed)], pack=True, broadcast=case.broadcast,
                     pad_to=PIPELINE_PAD_TO if case.pp > 1 else None)
    sums = torch.zeros_like(ref_sums) if sums is None else sums  # stages before the last add nothing
    dist.all_reduce(sums, group=ps.get_context_parallel_group())  # each CP rank holds part of the tokens
    dist.all_reduce(sums, group=ps.get_pipeline_model_parallel_group())  # only the last stage has losses
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(), cp_group=ps.get_context_parallel_group())
    grad_err = max(max_relative_error(g, ref_grads[n]) for n, g in grads.items())
    towers = [sum(1 for n in grads if n.startswith(prefix)) for prefix in ("vision.", "audio.")]
    worst = torch.tensor([(sums - ref_sums).abs().max().item(), grad_err, *towers], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(layout=case.name, max_dloss_sum=worst[0].item(), max_rel_grad_err=worst[1].item(),
                tokens=ref_sums[:, 1].tolist(), vision_params=int(worst[2]), audio_params=int(worst[3]))


def run_vlm_parity(rank: int, world_size: int, cases: list, seed: int = 7):
    """For each case: worst |d loss_sum| and relative grad error vs one process, each sample alone.

    `cases` holds `VLMCase`s (or (tp, cp, sp[, broadcast[, pp]]) tuples). With `broadcast`, only TP
    rank 0 reads the data iterator; with pp > 1 the packs have a fixed length (`pad_to`) and the
    towers sit on the first stage.
    """
    cases = [c if isinstance(c, VLMCase) else VLMCase(*c) for c in cases]
    truths, results = {}, []
    for case in cases:
        key = (case.media, case.mrope)
        if key not in truths:
            truths[key] = reference(case, seed)
        results.append(run_case(case, seed, truths[key]))
    return results
