"""Step time of Bridge's Qwen3-VL: our packed step vs Bridge's `qwen3_vl_step` vs Bridge's `vlm_step`.

    python benchmarks/bridge_step_vs_bridge.py --preset cpu --out benchmarks/results/bridge_step_vs_bridge_cpu.md
    python benchmarks/bridge_step_vs_bridge.py --preset gpu --out benchmarks/results/bridge_step_vs_bridge_h100.md

One run, one model (Megatron-Bridge 0.6.2's own `Qwen3VLModel`, built by its provider), the same
micro-batches (lognormal text lengths, images and videos per sample) for every arm, the arms
alternating step by step (rotated order), forward + loss + backward, no optimizer:

- ours: `make_forward_step(pack=True, label_style="hf")` on the collated batch (packing in the step);
- ours, loader-packed: the same step fed a `MicroBatch` packed beforehand (as `PackingCollator` does
  in DataLoader workers): like for like with `vlm_step`, whose packing also runs at collate time;
- qwen3_vl_step: Bridge's Qwen3-VL step with `enable_in_batch_packing=True` (its recipes set
  `defer_in_batch_packing_to_step=True`): the collate pads rows to the batch max rounded up to 128
  (`data/collators/sequence_padding.py` `pad_or_truncate_sequence_batch`, called for real), the step
  pads to a multiple of 16 and declares uniform boundaries [0, S, 2S, ...] (bug class 4);
- vlm_step: Bridge's generic VLM step on a batch packed at collate time at real lengths by Bridge's
  `data.packing.in_batch.build_mcore_thd_sequence_batch_from_rows` (called for real).

What is Bridge's code and what is rewritten: see `bridge_steps.py`. Bridge's two `forward_step`
modules cannot be imported without Hugging Face `datasets` (through `training/config.py`), so their
argument plumbing is rewritten there, with file:line of what it follows; the model, the collate-time
packer and padder, `get_packed_seq_params`, `GenericVisualInputs` and the loss are Bridge's, called.
Where `qwen3_vl_step` does import (a full Bridge install), its `_pad_and_pack_qwen3_vl_step` is
checked equal to the rewrite on the first batch.

CPU: TE-free build (`megatron_vlm_packing.bridge.build`) with `SegmentAttention` below (one SDPA per
document: cost follows sum(len^2) as a varlen kernel's does, where the project's reference attention
builds a T x T mask for the whole pack), fp32, gloo, one thread, thread CPU time. GPU: Bridge's TE
specs untouched, bf16, wall time with CUDA synchronised. Correctness on the first batch: each arm's
loss sum and every parameter gradient vs each sample run alone (dense, unpadded).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch
from bridge_steps import (  # benchmarks/bridge_steps.py (the script's folder is on sys.path)
    check_against_real_qwen3_vl_step, collate_for_qwen3_vl_step, collate_for_vlm_step, lognormal_batches, qwen3_vl_step,
    vlm_step,
)
from timing import wall_ms  # benchmarks/timing.py

MODEL_GPU = dict(num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=2816,
                 vocab_size=4096, mrope_section=(24, 20, 20), vision_depth=4, vision_hidden=256, vision_heads=4,
                 patch_size=16, deepstack_visual_indexes=(0, 1, 2))
PRESETS = {
    "cpu": dict(model=dict(hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                           mrope_section=(4, 6, 6)),
                batch=8, batches=4, repeats=8, median_text=80, max_text=512, grids=(4, 8), video_grids=(4,)),
    "tiny": dict(model={}, batch=3, batches=1, repeats=1, median_text=12, max_text=24, grids=(2, 4), video_grids=(2,)),
    "gpu": dict(model=MODEL_GPU, batch=8, batches=4, repeats=5, median_text=1024, max_text=6144, grids=(16, 32),
                video_grids=(16,)),
}
ARMS = ("ours", "ours, loader-packed", "qwen3_vl_step", "vlm_step")


# --- CPU attention whose cost follows the boundaries --------------------------------------------

class SegmentAttention(torch.nn.Module):
    """Megatron-Core core attention (DotProductAttention's constructor and forward), one SDPA per
    declared document: THD computes each document's real slots (`cu_seqlens`) inside its physical
    span (`cu_seqlens_padded`), pad slots give 0, as a varlen kernel does. BSHD: one causal SDPA per
    row, no mask. No CP, no dropout. q: [T, H, D] (THD) or [S, B, H, D]; k, v: [.., Hk, D]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__()
        if (config.context_parallel_size or 1) > 1 or (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("SegmentAttention takes context_parallel_size=1 and attention_dropout=0")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def _sdpa(self, q, k, v, causal):  # [n, H, D], [n, Hk, D] -> [n, H*D]
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, scale=self.softmax_scale)
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if attention_mask is not None or attention_bias is not None:
                raise ValueError("SegmentAttention's dense path takes no attention_mask / attention_bias")
            return torch.stack([self._sdpa(query[:, b], key[:, b], value[:, b], causal)
                                for b in range(query.shape[1])], dim=1)
        cu = packed_seq_params.cu_seqlens_q.tolist()
        padded = packed_seq_params.cu_seqlens_q_padded
        starts = padded.tolist() if padded is not None else cu
        out = query.new_zeros(query.shape[0], query.shape[1] * query.shape[2])
        for i in range(len(cu) - 1):
            s, n = starts[i], cu[i + 1] - cu[i]
            out[s:s + n] = self._sdpa(query[s:s + n], key[s:s + n], value[s:s + n], causal)
        return out


# --- our step, the arms, correctness ---------------------------------------------------------------

def our_step():
    """`model, batch -> loss sum` through `make_forward_step(pack=True, label_style="hf")` and its loss."""
    from megatron_vlm_packing import make_forward_step

    step = make_forward_step(pack=True, label_style="hf")

    def run(model, batch, device, dtype):
        output, loss_func = step(iter([batch]), model)
        return loss_func(output)[0]
    return run


def arm_inputs(model, samples: list[dict], dtype) -> dict:
    """{arm: (step, host-side input, physical tokens, attention pairs, collate-side ms)} for one micro-batch."""
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.bridge.adapters import qwen3_vl_mrope
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl

    ours = collate_qwen_vl(samples)
    for key in ("pixel_values", "pixel_values_videos"):
        if key in ours:
            ours[key] = ours[key].to(dtype)
    loader, loader_ms = _host_ms(lambda: pack_batch(ours, label_style="hf", mrope=qwen3_vl_mrope(model)))
    padded, padded_ms = _host_ms(lambda: collate_for_qwen3_vl_step(samples))
    packed, packed_ms = _host_ms(lambda: collate_for_vlm_step(samples))
    rows, target = padded["input_ids"].shape[0], math.ceil(padded["input_ids"].shape[1] / 16) * 16

    def pairs(cu):
        lengths = cu.diff().tolist()
        return sum(n * (n + 1) // 2 for n in lengths)
    ours_shape = (loader.input_ids.shape[-1], pairs(loader.packed_seq_params.cu_seqlens_q))
    step = our_step()
    return {"ours": (step, ours, *ours_shape, 0.0), "ours, loader-packed": (step, loader, *ours_shape, loader_ms),
            "qwen3_vl_step": (qwen3_vl_step, padded, rows * target, rows * target * (target + 1) // 2, padded_ms),
            "vlm_step": (vlm_step, packed, packed["input_ids"].shape[1], pairs(packed["cu_seqlens_q"]), packed_ms)}


def _host_ms(fn):
    """(fn(), this thread's CPU ms for a second call): collate-side work, outside the timed step."""
    fn()  # first call pays lazy imports
    start = time.thread_time()
    out = fn()
    return out, (time.thread_time() - start) * 1e3


def alone_loss_sum(model, sample: dict, device, dtype) -> torch.Tensor:
    """Next-token loss sum of one sample run alone, dense, unpadded (the model computes its mRoPE)."""
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl
    from megatron_vlm_packing.bridge.smoke import call_bridge_vlm

    batch = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
             for k, v in collate_qwen_vl([sample]).items()}
    targets = torch.cat([batch["labels"][:, 1:], torch.full_like(batch["labels"][:, :1], -100)], dim=1)
    losses = call_bridge_vlm(model, "qwen3_vl", batch, input_ids=batch["input_ids"], position_ids=None,
                             labels=targets.clamp_min(0))
    return (losses.float() * (targets != -100)).sum()


def _loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def correctness(model, samples: list[dict], inputs: dict, device, dtype) -> dict:
    """{arm: (|loss - alone|, relative, max relative gradient error)} vs each sample alone."""
    from megatron_vlm_packing.testing.parity import max_relative_error

    ref_loss, ref_grads = _loss_and_grads(model, lambda: sum(alone_loss_sum(model, s, device, dtype)
                                                             for s in samples))
    out = {}
    for arm, (step, batch, *_) in inputs.items():
        loss, grads = _loss_and_grads(model, lambda: step(model, batch, device, dtype))
        worst = max((max_relative_error(grads[n], g) if n in grads else float("inf")) for n, g in ref_grads.items())
        dloss = abs(loss - ref_loss).item()
        out[arm] = (dloss, dloss / abs(ref_loss.item()), worst)
    model.zero_grad(set_to_none=True)
    return out


# --- timing ----------------------------------------------------------------------------------------

def time_arms(model, inputs: list[dict], device, dtype, repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """ms of forward + backward per arm; `warmup` untimed rounds, then `repeats` rounds over every batch
    with the arms in rotated order (load on a shared machine hits every arm alike)."""
    clock = "wall" if device == "cuda" else "thread"
    times = {arm: [] for arm in ARMS}
    step_index = 0
    for round_ in range(warmup + repeats):
        for per_arm in inputs:
            order = ARMS[step_index % len(ARMS):] + ARMS[:step_index % len(ARMS)]
            step_index += 1
            for arm in order:
                step, batch = per_arm[arm][:2]
                model.zero_grad(set_to_none=True)
                ms = wall_ms(lambda: step(model, batch, device, dtype).backward(), device=device, repeats=1,
                             warmup=0, clock=clock)[0]
                if round_ >= warmup:
                    times[arm].append(ms)
    model.zero_grad(set_to_none=True)
    return times


# --- build, report, main ---------------------------------------------------------------------------

def build_model(cfg, device: str, cpu_attention: str):
    """Bridge's Qwen3VLModel: TE specs untouched on CUDA (bf16), TE-free local specs on the CPU (fp32)."""
    from megatron_vlm_packing.bridge.build import build_with_provider, qwen3_vl_te_free_swaps
    from megatron_vlm_packing.bridge.tiny import build_tiny_bridge_model, qwen3_vl_provider

    if device == "cuda":
        from bridge_qwen3_vl_gpu import build  # benchmarks/bridge_qwen3_vl_gpu.py: Bridge's TE build, bf16

        return build(cfg).train(), torch.bfloat16
    if cpu_attention == "reference":
        return build_tiny_bridge_model(cfg, seed=0), torch.float32
    swaps = qwen3_vl_te_free_swaps(SegmentAttention)
    return build_with_provider(qwen3_vl_provider(cfg), swaps=swaps, seed=0), torch.float32


def setup(device: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if device == "cpu":
        from megatron_vlm_packing.testing.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def report(times: dict, shapes: dict, checks: dict, real_check: str, tolerance: tuple[float, float]) -> list[str]:
    """Markdown: the timing table (ratios ours / arm) and the correctness table."""
    med = {arm: statistics.median(t) for arm, t in times.items()}
    lines = ["| arm | real tokens / step | physical tokens / step | attention pairs / step | ms / step (median) "
             "| ours / arm (medians) | ours / arm (paired median) | collate-side ms (not in the step) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        real, physical, pairs, collate = (statistics.mean(s) for s in zip(*shapes[arm]))
        paired = statistics.median(a / b for a, b in zip(times["ours"], times[arm]))
        lines.append(f"| {arm} | {real:.0f} | {physical:.0f} | {pairs:.3g} | {med[arm]:.1f} | "
                     f"{med['ours'] / med[arm]:.2f} | {paired:.2f} | {collate:.1f} |")
    like_for_like = statistics.median(a / b for a, b in zip(times["ours, loader-packed"], times["vlm_step"]))
    lines += ["", f"Like for like with `vlm_step` (both packed at collate time): ours, loader-packed / vlm_step = "
              f"{like_for_like:.2f} (paired median over {len(times['vlm_step'])} steps per arm)."]
    loss_tol, grad_tol = tolerance
    lines += ["", f"| arm | abs(loss - alone) | relative | max rel grad err vs alone | equals each sample alone "
              f"(relative loss < {loss_tol:g}, grads < {grad_tol:g}) |", "|---|---|---|---|---|"]
    for arm in ARMS:
        dloss, rel, grad = checks[arm]
        verdict = "yes" if rel < loss_tol and grad < grad_tol else "NO"
        lines.append(f"| {arm} | {dloss:.2e} | {rel:.1e} | {grad:.1e} | {verdict} |")
    lines += ["", f"Our rewrite of `_pad_and_pack_qwen3_vl_step` vs Bridge's: {real_check}."]
    return lines


def run(preset_name: str, *, cpu_attention: str = "segmented", seed: int = 0, repeats: int | None = None,
        batches: int | None = None, warmup: int = 1) -> tuple[list[str], dict]:
    """Build, make the batches, check correctness on the first, time all; (markdown lines, raw)."""
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig

    preset = dict(PRESETS[preset_name])
    preset.update({k: v for k, v in (("repeats", repeats), ("batches", batches)) if v is not None})
    device = "cuda" if preset_name == "gpu" else "cpu"
    setup(device)
    cfg = TinyBridgeConfig(family="qwen3_vl", **preset["model"])
    model, dtype = build_model(cfg, device, cpu_attention)
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    batches_ = lognormal_batches(cfg, preset, seed)
    inputs = [arm_inputs(model, samples, dtype) for samples in batches_]
    real = [sum(len(s["input_ids"]) for s in samples) for samples in batches_]
    shapes = {arm: [(r, *per[arm][2:]) for r, per in zip(real, inputs)] for arm in ARMS}
    checks = correctness(model, batches_[0], inputs[0], device, dtype)
    real_check = check_against_real_qwen3_vl_step(inputs[0]["qwen3_vl_step"][1])
    times = time_arms(model, inputs, device, dtype, preset["repeats"], warmup)
    head = [_head(device, cfg, cpu_attention, preset, batches_), ""]
    tolerance = (1e-4, 1e-3) if dtype == torch.float32 else (1e-2, 5e-2)
    return head + report(times, shapes, checks, real_check, tolerance), dict(times=times, shapes=shapes, checks=checks)


def _head(device: str, cfg, cpu_attention: str, preset: dict, batches: list[list[dict]]) -> str:
    """One line: device, versions, model, batches, media counts."""
    from megatron_vlm_packing.bridge.imports import bridge_version

    where = torch.cuda.get_device_name() if device == "cuda" else "cpu (1 thread, thread CPU time)"
    images = sum(len(s["image_grid_thw"]) for b in batches for s in b)
    videos = sum(len(s["video_grid_thw"]) for b in batches for s in b)
    return (f"device: {where}, torch {torch.__version__}, megatron-bridge {bridge_version()}, model "
            f"{model_summary(cfg, device, cpu_attention)}, {preset['batches']} micro-batches of {preset['batch']} "
            f"samples, {preset['repeats']} timed rounds (arms alternating), images {images}, videos {videos}")


def model_summary(cfg, device: str, cpu_attention: str) -> str:
    precision = "TE, bf16" if device == "cuda" else f"TE-free local specs + {cpu_attention} attention, fp32"
    return (f"Qwen3VLModel {cfg.num_layers} layers x {cfg.hidden_size} (heads {cfg.num_attention_heads}/"
            f"{cfg.num_query_groups}), vision {cfg.vision_depth} x {cfg.vision_hidden}, deepstack "
            f"{list(cfg.deepstack_visual_indexes)}, {precision}")


NOTES = """Arms, columns and what is Bridge's code: see the docstrings of `benchmarks/bridge_step_vs_bridge.py`
and `benchmarks/bridge_steps.py`. In short: the model, Bridge's collate-time packer
(`build_mcore_thd_sequence_batch_from_rows`) and padder (`pad_or_truncate_sequence_batch`),
`padding_utils`, `get_packed_seq_params`, `GenericVisualInputs` and the loss are Bridge 0.6.2's own,
called; the argument plumbing of `qwen3_vl_step` / `vlm_step` is rewritten (their modules import Hugging
Face `datasets` through `training/config.py`), following `models/qwen_vl/qwen3_vl_step.py:155-210, 290-353`
and `training/vlm_step.py:278-321`. Physical tokens: what the language model runs; attention pairs:
causal query-key pairs over the boundaries the step declares. Ratios below 1 mean ours is faster.
Collate-side ms: host work done in DataLoader workers, outside the timed step (ours, loader-packed:
`pack_batch` incl. mRoPE positions; qwen3_vl_step: row padding; vlm_step: Bridge's packer, positions
left to the model). Correctness: the first micro-batch, each arm's loss sum and every parameter
gradient vs each sample run alone (dense, unpadded).

GPU variant (Transformer Engine, bf16, Bridge's TE specs untouched, 4 layers x 1024, vision 4 x 256,
8 samples per micro-batch with lognormal text of median 1024 tokens and 16/32-patch images), on one
GPU with megatron-bridge 0.6.2 and TE installed (`scripts/setup.sh`):

    python benchmarks/bridge_step_vs_bridge.py --preset gpu --out benchmarks/results/bridge_step_vs_bridge_h100.md
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--cpu-attention", choices=("segmented", "reference"), default="segmented")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batches", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds over every batch first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.preset == "gpu" and not torch.cuda.is_available():
        parser.error("--preset gpu needs a CUDA GPU (and Transformer Engine)")
    lines, _ = run(args.preset, cpu_attention=args.cpu_attention, seed=args.seed, repeats=args.repeats,
                   batches=args.batches, warmup=args.warmup)
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = "python benchmarks/bridge_step_vs_bridge.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.out, "w") as f:
            f.write(f"# Bridge Qwen3-VL step time: ours vs qwen3_vl_step vs vlm_step\n\n`{command}`\n\n{text}\n\n{NOTES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
