"""GPTModel forward + backward: padded to S, padded to the batch max, packed THD; Megatron's rotary vs ours.

    python benchmarks/step_pack_vs_pad.py --preset cpu                  # tiny, CPU, ratios (minutes)
    python benchmarks/step_pack_vs_pad.py --preset smoke --repeats 1    # seconds: does the script run
    python benchmarks/step_pack_vs_pad.py --preset h100 --rope mrope --backends te \\
        --out benchmarks/results/step_pack_vs_pad_mrope_h100.md

`--rope mrope` builds a Qwen-VL-shaped model (mRoPE, sections (16, 24, 24) of a 128-wide head in
the h100 preset) fed [3, B, S] positions from Qwen2-VL's `get_rope_index` on rows with image
placeholder blocks; `--rope 1d` a plain rope GPT. Rotary fusion stays off (Megatron-Core's fused
kernels take no 3D positions). One run, the same micro-batches for every mode:

- padded to S / padded to batch max: dense rows (the rotary is Megatron-Core's in both: dense is not
  what this project changes);
- packed THD, megatron rotary: Megatron-Core's own rotary and THD rope (per-document loop with host
  syncs in every layer; for mRoPE at CP = 1 the whole-pack table is right);
- packed THD, ours: `rope.use_packed_mrope` (mRoPE) or `patches.apply_thd_rotary` (1D): the table
  gathered once per micro-batch, every layer one rotation, no host sync;
- packed THD, ours, loader-packed: the same, with `pack_batch` done beforehand (as a DataLoader's
  `PackingCollator` does in its workers), so the step only runs the model.

Columns: ms per step (median; on the CPU one thread's CPU time, see timing.py), speedup over padded to batch max, the token-ideal speedup
(batch-max slots / real tokens: what packing would give if cost were linear in tokens), and the
fraction of it reached (target: >= 0.9 for packed).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from timing import wall_ms  # benchmarks/timing.py (the script's folder is on sys.path)

PRESETS = {
    "cpu": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=256,
                vocab_size=1024, seq_lengths=(512,), batch=8, dtype=torch.float32, mrope_section=(2, 3, 3)),
    # A run in seconds that goes through every mode: tests/perf/test_step_benchmark.py keeps the script working.
    "smoke": dict(num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=64,
                  vocab_size=256, seq_lengths=(64,), batch=4, dtype=torch.float32, mrope_section=(2, 3, 3)),
    "h100": dict(num_layers=8, hidden_size=2048, num_attention_heads=16, num_query_groups=16, ffn_hidden_size=8192,
                 vocab_size=32768, seq_lengths=(2048, 4096, 8192), batch=8, dtype=torch.bfloat16,
                 mrope_section=(16, 24, 24)),
}


def lognormal_lengths(batch: int, seq: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    median = seq / 5
    x = torch.exp(torch.randn(batch, generator=g) * 0.9 + torch.log(torch.tensor(median)))
    return x.clamp(16, seq).long().tolist()


def make_batch(lengths, seq, vocab, *, mrope: bool, seed: int) -> dict:
    """Right-padded rows; with mRoPE, one image block of 8x8 merged patches (4x4 tokens per 16) per row
    where it fits, and [3, B, S] positions from Qwen2-VL's rule."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
    ids = torch.randint(1, vocab - 3, (len(lengths), seq), generator=g)  # the top 3 ids are the image specials
    batch = {"input_ids": torch.where(keep, ids, 0), "labels": torch.where(keep, ids, -100),
             "attention_mask": keep.long()}
    if not mrope:
        return batch
    from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

    image, start, end = (vocab - 3, vocab - 2, vocab - 1)
    grids = []
    for row, n in enumerate(lengths):
        if n >= 8 * 8 // 4 + 4:  # an 8x8-patch image: 16 placeholder tokens after the 2x2 merge
            batch["input_ids"][row, 1] = start
            batch["input_ids"][row, 2:18] = image
            batch["input_ids"][row, 18] = end
            batch["labels"][row, 1:19] = -100
            grids.append([1, 8, 8])
    rope = MRopeConfig(family="qwen2_vl", image_token_id=image, video_token_id=vocab + 1,
                       vision_start_token_id=start, mrope_section=(1, 1, 2))
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    batch["position_ids"] = get_rope_index(batch["input_ids"], rope, image_grid_thw=grid if grids else None,
                                           attention_mask=batch["attention_mask"]).position_ids
    return batch


def on(device, batch: dict) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def dense_step(model, batch, length):
    ids, labels = batch["input_ids"][:, :length], batch["labels"][:, :length]
    labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    if "position_ids" in batch:
        pos = batch["position_ids"][..., :length]
    else:
        pos = torch.arange(length, device=ids.device).expand_as(ids)
    loss = model(ids, pos, None, labels=labels.clamp_min(0))
    (loss * (labels != -100)).sum().backward()


def pack(batch):
    from megatron_vlm_packing import pack_batch

    return pack_batch(batch, label_style="hf")


def packed_step(model, batch=None, packed=None):
    packed = packed if packed is not None else pack(batch)
    loss = model(packed.input_ids, packed.position_ids, None, labels=packed.labels.clamp_min(0),
                 packed_seq_params=packed.packed_seq_params)
    (loss * packed.loss_mask).sum().backward()


def timed(fn, device, repeats):
    """Median ms per step after 2 warm-ups, and the peak CUDA memory of the timed steps (GiB)."""
    fn()
    fn()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    samples = wall_ms(fn, device=device, repeats=repeats, warmup=0, clock="wall" if device == "cuda" else "thread")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(samples), peak


def runnable_backends(requested: str, device: str) -> list[str]:
    from megatron_vlm_packing.attention import resolve_backend

    wanted = ["te", "torch", "reference"] if requested == "auto" else requested.split(",")
    runnable = []
    for backend in wanted:
        try:
            resolve_backend(backend)
            runnable.append(backend)
        except ValueError:
            pass
    if device == "cuda" and len(runnable) > 1 and "reference" in runnable:
        runnable.remove("reference")  # O(T^2) float32 masks: a truth, not a contender on GPU
    return runnable


def ours_on(model, rope: str):
    """Install our rotary path; returns the undo."""
    from megatron_vlm_packing.patches.thd_rotary import apply_thd_rotary, undo_thd_rotary

    if rope == "mrope":
        from megatron_vlm_packing.rope import use_packed_mrope

        handle = use_packed_mrope(model)
        return lambda: (handle.undo(), undo_thd_rotary())
    apply_thd_rotary()
    return undo_thd_rotary


def modes_for(model, batch, seq, rope):
    """(name, step, slots) for every mode; the 'ours' ones install our rotary first (see run_modes)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    prepacked = pack(batch)
    return [("padded to S", "megatron", lambda: dense_step(model, batch, seq), len(lengths) * seq),
            ("padded to batch max", "megatron", lambda: dense_step(model, batch, max(lengths)),
             len(lengths) * max(lengths)),
            ("packed THD", "megatron", lambda: packed_step(model, batch), sum(lengths)),
            ("packed THD", "ours", lambda: packed_step(model, batch), sum(lengths)),
            ("packed THD, loader-packed", "ours", lambda: packed_step(model, packed=prepacked), sum(lengths))]


def run_modes(model, batch, seq, rope, device, repeats):
    results, undo = [], None
    for name, rotary, step, slots in modes_for(model, batch, seq, rope):
        if rotary == "ours" and undo is None:
            undo = ours_on(model, rope)
        results.append((name, rotary, slots, *timed(step, device, repeats)))
        model.zero_grad(set_to_none=True)
    undo()
    return results


def table_rows(backend, seq, results, real):
    batch_max_ms, batch_max_slots = next((r[3], r[2]) for r in results if r[0] == "padded to batch max")
    ideal = batch_max_slots / real
    rows = []
    for name, rotary, slots, ms, peak in results:
        speedup = batch_max_ms / ms
        peak_text = f"{peak:.2f}" if peak == peak else "-"  # torch keeps no CPU allocator peak
        rows.append(f"| {backend} | {seq} | {name} | {rotary} | {slots} | {ms:.1f} | {speedup:.2f}x | {ideal:.2f}x | "
                    f"{speedup / ideal:.2f} | {peak_text} |")
    return rows


def build_model(preset: dict, rope: str, backend: str, device: str, *, seed: int, rope_fusion: bool = False,
                extra: dict | None = None):
    """The preset's GPTModel (`rope` "mrope" or "1d") with attention `backend`, on `device` in the preset's
    dtype; `extra`: more TransformerConfig fields. Needs Megatron's parallel state (`demo.setup_distributed`)."""
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt

    config = TinyGPTConfig(num_layers=preset["num_layers"], hidden_size=preset["hidden_size"],
                           num_attention_heads=preset["num_attention_heads"],
                           num_query_groups=preset["num_query_groups"], ffn_hidden_size=preset["ffn_hidden_size"],
                           vocab_size=preset["vocab_size"], max_sequence_length=max(preset["seq_lengths"]),
                           params_dtype=preset["dtype"], position_embedding_type="mrope" if rope == "mrope" else "rope",
                           mrope_section=preset["mrope_section"], backend=backend,
                           extra={**({"apply_rope_fusion": True} if rope_fusion and rope == "1d" and backend == "te"
                                     else {}), **(extra or {})})
    torch.manual_seed(seed)
    return build_tiny_gpt(config).to(device=device, dtype=preset["dtype"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--rope", choices=["mrope", "1d"], default="mrope")
    parser.add_argument("--backends", default="auto", help="comma list of reference,torch,te or 'auto' (all that run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope-fusion", action="store_true",
                        help="1D rope with TE's fused kernels (the THD rotary then never reaches Python)")
    parser.add_argument("--out")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(1) if device == "cpu" else None

    from megatron_vlm_packing.demo.main import setup_distributed

    setup_distributed(device, 1, 1, args.seed)
    lines = [f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (1 thread)'}, torch "
             f"{torch.__version__}, preset {args.preset}, rope {args.rope} ({'fused' if args.rope_fusion else 'unfused'}), batch {preset['batch']}, "
             f"{args.repeats} timed steps (median)", "",
             "| backend | S | mode | rotary | slots | ms/step | speedup vs batch max | token-ideal | "
             "fraction of ideal | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for backend in runnable_backends(args.backends, device):
        model = build_model(preset, args.rope, backend, device, seed=args.seed, rope_fusion=args.rope_fusion)
        for seq in preset["seq_lengths"]:
            lengths = lognormal_lengths(preset["batch"], seq, args.seed + seq)
            batch = on(device, make_batch(lengths, seq, preset["vocab_size"], mrope=args.rope == "mrope",
                                          seed=args.seed + seq))
            results = run_modes(model, batch, seq, args.rope, device, args.repeats)
            lines += table_rows(backend, seq, results, sum(lengths))
            print("\n".join(lines[-len(results):]), flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = " ".join(["python benchmarks/step_pack_vs_pad.py", f"--preset {args.preset}", f"--rope {args.rope}",
                            f"--backends {args.backends}", f"--repeats {args.repeats}"]
                           + (["--rope-fusion"] if args.rope_fusion else []))
        with open(args.out, "w") as f:
            f.write(f"# GPTModel step: padded vs packed, Megatron's rotary vs ours\n\n`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
