"""`megatron-vlm-packing demo`: train a tiny VLM with packing on embedded synthetic data.

The model (`demo/model.py`: a 2-layer GPTModel with vision and audio towers) trains on images,
videos and audio clips through the shipped `make_forward_step` and `loss_func`. Runs on the CPU by
default (the product runtime: gloo, the CPU shims, the reference attention) and on the GPU when
one is present. Under torchrun, `--tp/--cp/--sp` select the parallel layout. Each step prints the
loss, real vs physical tokens, packing efficiency and tokens/s; the run ends with packed vs
unpacked loss parity on a held-out batch.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_vlm_packing.demo.model import DEMO_DATA, build_demo_model
from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
from megatron_vlm_packing.train.step import make_forward_step

MICRO_BATCHES_PER_STEP = 2


def setup_distributed(device: str, tp: int, cp: int, seed: int) -> None:
    from megatron_vlm_packing.runtime.launcher import initialize_parallel

    if device == "cpu":
        from megatron_vlm_packing.runtime.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain single-process run
            os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            from megatron_vlm_packing.runtime.launcher import free_port

            os.environ["MASTER_PORT"] = str(free_port())
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    initialize_parallel(tp=tp, cp=cp, seed=seed)


def summed_over_data_and_context(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over the DP x CP ranks: `loss_func` reports this rank's CP share of the tokens."""
    from megatron.core import parallel_state as ps

    total = values.detach().clone()
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    return total


def finalize_grads(model: torch.nn.Module, num_tokens: torch.Tensor) -> None:
    """Sum grads over DP x CP, SP-norm grads over TP, then divide by `num_tokens`, the global token
    count (already summed over DP x CP)."""
    from megatron.core import parallel_state as ps

    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    for param in model.parameters():
        if param.grad is None:
            continue
        if dist.get_world_size(dp_cp) > 1:
            dist.all_reduce(param.grad, group=dp_cp)
        if getattr(param, "sequence_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(param.grad, group=ps.get_tensor_model_parallel_group())
        param.grad /= num_tokens.clamp_min(1)


def train_step(model, optimizer, step_fn, micro_batches) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    optimizer.zero_grad(set_to_none=True)
    reports = get_forward_backward_func()(
        forward_step_func=step_fn, data_iterator=iter(micro_batches), model=[model],
        num_microbatches=len(micro_batches), seq_length=0, micro_batch_size=1, forward_only=False)
    loss_sum = sum(r["lm loss"][0] for r in reports)
    tokens = sum(r["lm loss"][1] for r in reports)
    real = sum(r["packing efficiency"][0] for r in reports)
    physical = sum(r["packing efficiency"][1] for r in reports)
    padded = sum(r["padding efficiency"][1] for r in reports)
    # Every rank's loss, over every CP rank's tokens: rank 0's alone was its CP half's mean.
    loss_sum, tokens = summed_over_data_and_context(torch.stack([loss_sum, tokens]))
    finalize_grads(model, tokens)
    optimizer.step()
    return dict(loss=(loss_sum / tokens).item(), real=int(real), physical=int(physical), padded=int(padded))


@torch.no_grad()
def held_out_parity(model, samples: list[dict]) -> tuple[float, float]:
    """Mean per-token loss of the samples packed into one micro-batch, and of each sample alone
    (over every CP rank's tokens)."""
    def mean_loss(step, batches):
        sums = []
        for b in batches:
            output, loss_fn = step(iter([b]), model)
            loss_sum, num, _ = loss_fn(output)
            sums.append(torch.stack([loss_sum.double(), num.double()]))  # float64, as Python sums them
        total, tokens = summed_over_data_and_context(torch.stack(sums).sum(0)).tolist()
        return total / tokens

    model.eval()
    try:
        return (mean_loss(make_forward_step(pack=True), [collate(samples)]),
                mean_loss(make_forward_step(pack=False), [collate([s]) for s in samples]))
    finally:
        model.train()


def run_demo(args: argparse.Namespace) -> int:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.sp and args.tp < 2:
        raise ValueError(f"--sp needs --tp > 1, got --tp {args.tp}")
    if device == "cuda" and not torch.cuda.is_available():  # else torch.cuda.set_device's driver error, as a traceback
        raise ValueError("--device cuda, but torch sees no CUDA device here; use --device cpu (or auto)")
    for flag, value in (("--steps", args.steps), ("--micro-batch-size", args.micro_batch_size), ("--tp", args.tp),
                        ("--cp", args.cp)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    setup_distributed(device, args.tp, args.cp, args.seed)
    rank0 = dist.get_rank() == 0
    data_cfg = DEMO_DATA
    model = build_demo_model(tp=args.tp, cp=args.cp, sp=args.sp, seed=args.seed, device=device, data=data_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    step_fn = make_forward_step(pack=not args.no_pack)
    mb = args.micro_batch_size
    samples = synthetic_samples(args.steps * MICRO_BATCHES_PER_STEP * mb, seed=args.seed, cfg=data_cfg)
    if rank0:
        print(f"demo: tiny VLM (2-layer GPT, hidden 64, vision tower for images and videos, audio tower) on {device}, "
              f"tp={args.tp} cp={args.cp} sp={args.sp}, packing {'off' if args.no_pack else 'on'}, "
              f"{args.steps} steps x {MICRO_BATCHES_PER_STEP} micro-batches of {mb} samples")
    for step in range(args.steps):
        chunk = samples[step * MICRO_BATCHES_PER_STEP * mb:(step + 1) * MICRO_BATCHES_PER_STEP * mb]
        micro_batches = [collate(chunk[i * mb:(i + 1) * mb]) for i in range(MICRO_BATCHES_PER_STEP)]
        start = time.perf_counter()
        stats = train_step(model, optimizer, step_fn, micro_batches)
        seconds = time.perf_counter() - start
        if rank0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step + 1:3d}/{args.steps}  loss {stats['loss']:.4f}  real {stats['real']:5d} / physical "
                  f"{stats['physical']:5d} tokens  efficiency {stats['real'] / stats['physical']:.3f} "
                  f"(padded rows: {stats['real'] / stats['padded']:.3f})  "
                  f"{stats['real'] / seconds:,.0f} tokens/s", flush=True)
    packed, alone = held_out_parity(model, synthetic_samples(mb, seed=args.seed + 1, cfg=data_cfg))
    if rank0:
        print(f"parity on a held-out batch of {mb}: packed loss {packed:.6f}, each sample alone {alone:.6f}, "
              f"|diff| {abs(packed - alone):.2e}")
    dist.destroy_process_group()
    return 0 if abs(packed - alone) < 1e-4 * max(1.0, abs(alone)) else 1
