"""GPTModel forward + backward: padded to a fixed S, padded to the batch max, packed THD.

    python benchmarks/step_pack_vs_pad.py                       # small CPU sizes (about a minute)
    python benchmarks/step_pack_vs_pad.py --preset h100 --out benchmarks/results/step_pack_vs_pad_h100.md

One run, the same micro-batches (lognormal real lengths) for every mode, timed side by side.
Prints ms per step, peak memory (CUDA), the ratio to packed, and the token-ideal ratio (slots
computed / real tokens): what padding would cost if attention were free.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

import torch
from timing import wall_ms  # benchmarks/timing.py (the script's folder is on sys.path)

PRESETS = {
    "cpu": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=256,
                vocab_size=1024, seq_lengths=(512,), batch=8, dtype=torch.float32),
    "h100": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=8192,
                 vocab_size=32768, seq_lengths=(2048, 4096, 8192), batch=8, dtype=torch.bfloat16),
}


def lognormal_lengths(batch: int, seq: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    median = seq / 5
    x = torch.exp(torch.randn(batch, generator=g) * 0.9 + torch.log(torch.tensor(median)))
    return x.clamp(16, seq).long().tolist()


def make_batch(lengths, seq, vocab, device):
    keep = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
    ids = torch.randint(1, vocab, (len(lengths), seq))
    return {"input_ids": ids.to(device), "labels": torch.where(keep, ids, -100).to(device),
            "attention_mask": keep.long().to(device)}


def dense_step(model, batch, length):
    ids, labels = batch["input_ids"][:, :length], batch["labels"][:, :length]
    labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    pos = torch.arange(length, device=ids.device).expand_as(ids)
    loss = model(ids, pos, None, labels=labels.clamp_min(0))
    (loss * (labels != -100)).sum().backward()


def packed_step(model, batch):
    from megatron_vlm_packing import pack_batch

    packed = pack_batch(batch, label_style="hf")
    loss = model(packed.input_ids, packed.position_ids, None, labels=packed.labels.clamp_min(0),
                 packed_seq_params=packed.packed_seq_params)
    (loss * packed.loss_mask).sum().backward()


def timed(fn, device, repeats):
    """Median ms per step after 2 warm-ups, and the peak CUDA memory of the timed steps (GiB)."""
    fn()
    fn()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    samples = wall_ms(fn, device=device, repeats=repeats, warmup=0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(samples), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--backends", default="auto", help="comma list of reference,torch,te or 'auto' (all that run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-fusion", action="store_true",
                        help="fused rotary kernels (TE/apex; THD rope then runs without a per-document Python loop)")
    parser.add_argument("--out")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    from megatron_vlm_packing.attention import resolve_backend
    from megatron_vlm_packing.demo import setup_distributed
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt

    setup_distributed(device, 1, 1, args.seed)
    backends = ["te", "torch", "reference"] if args.backends == "auto" else args.backends.split(",")
    runnable = []
    for b in backends:
        try:
            resolve_backend(b)
            runnable.append(b)
        except ValueError:
            pass
    if device == "cuda" and len(runnable) > 1 and "reference" in runnable:
        runnable.remove("reference")  # O(T^2) float32 masks: a truth, not a contender on GPU
    lines = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}, "
             f"preset {args.preset}, batch {preset['batch']}, {args.repeats} timed steps (median), "
             f"rope fusion {'on (te)' if args.rope_fusion else 'off'}", "",
             "| backend | S | mode | slots | real tokens | token-ideal ratio | ms/step | vs packed | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = TinyGPTConfig(num_layers=preset["num_layers"], hidden_size=preset["hidden_size"],
                         num_attention_heads=preset["num_attention_heads"], num_query_groups=preset["num_query_groups"],
                         ffn_hidden_size=preset["ffn_hidden_size"], vocab_size=preset["vocab_size"],
                         max_sequence_length=max(preset["seq_lengths"]), params_dtype=preset["dtype"])
    for backend in runnable:
        torch.manual_seed(args.seed)
        extra = {"apply_rope_fusion": True} if args.rope_fusion and backend == "te" else {}
        model = build_tiny_gpt(replace(base, backend=backend, extra=extra)).to(device=device, dtype=preset["dtype"])
        for seq in preset["seq_lengths"]:
            lengths = lognormal_lengths(preset["batch"], seq, args.seed + seq)
            batch = make_batch(lengths, seq, preset["vocab_size"], device)
            real, longest = sum(lengths), max(lengths)
            modes = [("padded to S", lambda: dense_step(model, batch, seq), len(lengths) * seq),
                     ("padded to batch max", lambda: dense_step(model, batch, longest), len(lengths) * longest),
                     ("packed THD", lambda: packed_step(model, batch), real)]
            results = [(name, slots, *timed(fn, device, args.repeats)) for name, fn, slots in modes]
            packed_ms = results[-1][2]
            for name, slots, ms, peak in results:
                peak_text = f"{peak:.2f}" if device == "cuda" else "-"  # torch keeps no CPU allocator peak
                lines.append(f"| {backend} | {seq} | {name} | {slots} | {real} | {slots / real:.2f} | {ms:.1f} | "
                             f"{ms / packed_ms:.2f}x | {peak_text} |")
            model.zero_grad(set_to_none=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# GPTModel step: padded vs packed\n\n`python benchmarks/step_pack_vs_pad.py "
                    f"--preset {args.preset}`\n\n{text}\n")


if __name__ == "__main__":
    main()
