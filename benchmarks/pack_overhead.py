"""Cost of `pack_batch` against the floor: one `index_select` copy of the same tensors.

    python benchmarks/pack_overhead.py [--batch 16] [--seq 8192] [--device cpu|cuda] [--out FILE]

The floor gathers input_ids, labels and loss_mask with an index that is already built: any packer
has to move those bytes. The ratio (pack_batch / floor) is what planning, validation, label
shifting and positions cost on top. Both are timed side by side in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import torch

from megatron_vlm_packing import pack_batch
from timing import wall_ms  # benchmarks/timing.py (the script's folder is on sys.path)


def make_batch(batch: int, seq: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    # Lognormal real lengths, as in instruction / multimodal data; clipped to the row.
    torch.manual_seed(seed)  # the lognormal sampler draws from the global generator
    lengths = torch.distributions.LogNormal(torch.log(torch.tensor(seq / 4.0)), 0.8).sample((batch,))
    lengths = lengths.clamp(16, seq).long()
    ids = torch.randint(1, 32000, (batch, seq), generator=g)
    keep = torch.arange(seq)[None] < lengths[:, None]
    return {
        "input_ids": torch.where(keep, ids, 0).to(device),
        "labels": torch.where(keep, ids, -100).to(device),
        "attention_mask": keep.long().to(device),
    }


def timed(fn, device: str, repeats: int) -> float:
    """Median wall time in ms over `repeats` calls after 3 warm-ups."""
    return statistics.median(wall_ms(fn, device=device, repeats=repeats))


def run(batch: int, seq: int, device: str, repeats: int) -> dict:
    data = make_batch(batch, seq, device)
    packed = pack_batch(data, label_style="hf")
    source = packed.indices.source

    def floor():
        return [data[k].reshape(-1).index_select(0, source) for k in ("input_ids", "labels", "attention_mask")]

    pack_ms = timed(lambda: pack_batch(data, label_style="hf"), device, repeats)
    floor_ms = timed(floor, device, repeats)
    return dict(device=device, batch=batch, seq=seq, real_tokens=packed.num_real_tokens,
                physical_tokens=packed.num_physical_tokens, pack_ms=pack_ms, floor_ms=floor_ms,
                ratio=pack_ms / floor_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="append a markdown row per device to this file")
    args = parser.parse_args()
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    rows = [run(args.batch, args.seq, d, args.repeats) for d in devices]
    header = "| device | B x S | real / physical tokens | pack_batch ms | index_select ms | ratio |"
    lines = [header, "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['device']} | {r['batch']} x {r['seq']} | {r['real_tokens']} / {r['physical_tokens']} "
                     f"| {r['pack_ms']:.3f} | {r['floor_ms']:.3f} | {r['ratio']:.2f} |")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
