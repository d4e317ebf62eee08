"""Fit the planner's language-model cost terms from timed forward + backward steps.

A Megatron-Core GPTModel runs packed THD micro-batches of several document-length mixes (one long
document, many short ones, lognormal, half and half) at several pack lengths T. Each step's time
is fitted by least squares to the cost model's form

    ms = a * T + b * sum_d s_d^2 + c * documents + d

(the fastest of --repeats interleaved rounds per case) and the report gives the coefficients, each case's measured and predicted time, the relative
error of the fit (and of leave-one-out predictions), and b / a next to the FLOP model's ratio
`lm_attention / lm_linear` for the same shape.

On the CPU the core attention is per-document SDPA (the exact reference attention is O(T^2) over
the whole pack, which is not what a varlen kernel costs); on CUDA it is the library's "auto"
backend (Transformer Engine, else torch varlen). GPU fit (bf16, larger model):

  python benchmarks/planner_cost_fit.py --device cuda --dtype bf16 --hidden 1024 --ffn 4096 \
      --layers 4 --heads 8 --lengths 4096,8192,16384 --out benchmarks/results/planner_cost_fit_h100.md

CPU run that produced benchmarks/results/planner_cost_fit_cpu.md:

  python benchmarks/planner_cost_fit.py --out benchmarks/results/planner_cost_fit_cpu.md
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import time

from megatron_vlm_packing.attention.torch_varlen import TorchVarlenCoreAttention


class PerDocumentAttention(TorchVarlenCoreAttention):
    """Causal SDPA over each document of a THD pack in turn: cost sum_d s_d^2, like a varlen kernel."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params, **unused)
        cu = packed_seq_params.cu_seqlens_q.tolist()  # one host read per layer call: a benchmark, not a kernel
        out = torch.zeros_like(query)
        for start, end in zip(cu[:-1], cu[1:]):
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [H, s, D]
            out[start:end] = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[0] != q.shape[0]).transpose(0, 1)
        return out.reshape(out.shape[0], -1)


def mixes(total: int, rng: np.random.Generator) -> dict[str, list[int]]:
    """Document lengths summing to `total` for each mix."""
    def fill(draw):
        lengths = []
        while sum(lengths) < total:
            lengths.append(int(min(draw(), total - sum(lengths))))
        return [n for n in lengths if n > 0]

    return {
        "one document": [total],
        "short (64)": [64] * (total // 64),
        "lognormal": fill(lambda: max(8, rng.lognormal(np.log(total / 8), 1.0))),
        "half long, half short": [total // 2] + [64] * (total // 2 // 64),
    }


def setup(device: str, seed: int) -> None:
    from megatron_vlm_packing.testing.distributed import free_port, initialize_parallel

    if device == "cpu":
        from megatron_vlm_packing.testing.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    initialize_parallel(tp=1, cp=1, seed=seed)


def build_model(args, device: str, dtype: torch.dtype):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.patches import apply_thd_rotary

    # The packed step runs with our loop-free THD rotary (patches.apply_all); without it Megatron-Core's
    # THD rope costs a host sync per document per layer, which the fit would book as model cost.
    apply_thd_rotary()
    cfg = TinyGPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                        num_query_groups=args.heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab,
                        max_sequence_length=max(args.lengths), params_dtype=dtype,
                        backend="auto" if device == "cuda" else "reference")
    kwargs = {}
    if device == "cpu":
        spec = copy.deepcopy(get_gpt_layer_local_spec())
        spec.submodules.self_attention.submodules.core_attention = PerDocumentAttention
        kwargs["transformer_layer_spec"] = spec
    torch.manual_seed(args.seed)
    return build_tiny_gpt(replace(cfg), **kwargs).to(device=device, dtype=dtype), cfg


def step_fn(model, lengths: list[int], vocab: int, device: str):
    from megatron_vlm_packing import pack_batch

    total = sum(lengths)
    ids = torch.randint(1, vocab, (1, total), device=device)
    batch = {"input_ids": ids.expand(len(lengths), total).contiguous(), "labels": ids.expand(len(lengths), total).contiguous(),
             "seq_lens": torch.tensor(lengths, device=device)}
    packed = pack_batch(batch, label_style="hf")

    def run():
        loss = model(packed.input_ids, packed.position_ids, None, labels=packed.labels.clamp_min(0),
                     packed_seq_params=packed.packed_seq_params)
        (loss * packed.loss_mask).sum().backward()

    return run


def timed_ms(run, device: str) -> float:
    """One step's time: CPU time of this process on the CPU (other load on a shared machine does not
    count; run with OMP_NUM_THREADS=1), wall time between CUDA synchronisations on the GPU."""
    if device == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3
    start = time.process_time()
    run()
    return (time.process_time() - start) * 1e3


def fit(features: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """Least squares weighted by 1/ms (relative error), coefficients [a, b, c, d]."""
    weights = 1.0 / ms
    coef, *_ = np.linalg.lstsq(features * weights[:, None], ms * weights, rcond=None)
    return coef


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    setup(args.device, args.seed)
    model, cfg = build_model(args, args.device, dtype)
    rng = np.random.default_rng(args.seed)
    cases = [(total, name, lengths, step_fn(model, lengths, args.vocab, args.device))
             for total in args.lengths for name, lengths in mixes(total, rng).items()]
    times = [[] for _ in cases]
    for repeat in range(args.repeats + 1):  # cases interleaved; the first round warms up
        for i, (total, name, lengths, run) in enumerate(cases):
            ms = timed_ms(run, args.device)
            model.zero_grad(set_to_none=True)
            if repeat:
                times[i].append(ms)
                print(f"T={total} {name}: {len(lengths)} docs, {ms:.1f} ms", file=sys.stderr)
    rows = [(total, name, len(lengths), float(sum(n * n for n in lengths)), min(t))  # min: least disturbed
            for (total, name, lengths, _), t in zip(cases, times)]
    features = np.asarray([[t, sq, n, 1.0] for t, _, n, sq, _ in rows])
    ms = np.asarray([r[-1] for r in rows])
    coef = fit(features, ms)
    predicted = features @ coef
    loo = np.asarray([features[i] @ fit(np.delete(features, i, 0), np.delete(ms, i)) for i in range(len(ms))])
    rel, rel_loo = np.abs(predicted / ms - 1), np.abs(loo / ms - 1)

    from megatron_vlm_packing.planner import TransformerShape

    shape = TransformerShape(hidden=args.hidden, layers=args.layers, heads=args.heads,
                             head_dim=args.hidden // args.heads, kv_groups=args.heads, ffn=args.ffn, gated=False,
                             vocab=args.vocab)
    flop_ratio = shape.attention_flops_per_pair(causal=True) / shape.linear_flops_per_token()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    lines = [
        f"# Planner cost fit ({device_name}, {args.dtype}, GPTModel hidden {args.hidden}, ffn {args.ffn}, "
        f"{args.layers} layers, {args.heads} heads, vocab {args.vocab})", "",
        f"Command: `python benchmarks/planner_cost_fit.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
        f"Fit: ms = a*T + b*sum(s^2) + c*docs + d with a = {coef[0]:.4g} ms/token, b = {coef[1]:.4g} ms/token^2, "
        f"c = {coef[2]:.4g} ms/document, d = {coef[3]:.4g} ms.", "",
        f"b / a = {coef[1] / coef[0]:.3g} per token (FLOP model for this shape: {flop_ratio:.3g}).", "",
        f"Fit error: RMS {100 * np.sqrt(np.mean(rel ** 2)):.1f}%, max {100 * rel.max():.1f}%; "
        f"leave-one-out RMS {100 * np.sqrt(np.mean(rel_loo ** 2)):.1f}%, max {100 * rel_loo.max():.1f}%.", "",
        "| T | mix | documents | measured ms | fitted ms | error | leave-one-out error |",
        "|---|---|---|---|---|---|---|",
    ]
    for (total, name, n, _, m), p, e, el in zip(rows, predicted, rel, rel_loo):
        lines.append(f"| {total} | {name} | {n} | {m:.1f} | {p:.1f} | {100 * e:.1f}% | {100 * el:.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
