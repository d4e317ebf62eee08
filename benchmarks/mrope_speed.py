"""Our vectorised get_rope_index vs the Hugging Face model's own, on one CPU batch.

    python benchmarks/mrope_speed.py [--family qwen2_5_vl|qwen2_vl|qwen3_vl|all] [--batch 64] [--images 4] [--out FILE]

Both compute the same positions (checked before timing) for `batch` samples with `images` images
each (random grids) and text around them; timed side by side, median of repeats.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
from pathlib import Path

import torch
from timing import wall_ms  # benchmarks/timing.py (the script's folder is on sys.path)

from megatron_vlm_packing.rope import MRopeConfig, get_rope_index, token_types


def make_batch(batch: int, images: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for _ in range(batch):
        tokens = torch.randint(1, 1000, (int(torch.randint(8, 64, (1,), generator=g)),), generator=g).tolist()
        for _ in range(images):
            h, w = (2 * int(x) for x in torch.randint(4, 17, (2,), generator=g))
            grids.append([1, h, w])
            tokens += [151652] + [151655] * (h * w // 4) + [151653]
            tokens += torch.randint(1, 1000, (int(torch.randint(4, 32, (1,), generator=g)),), generator=g).tolist()
        rows.append(tokens)
    width = max(map(len, rows))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask, torch.tensor(grids)


def timed(fn, repeats):
    return min(wall_ms(fn, device="cpu", repeats=repeats, warmup=1))  # the least disturbed run: shared cores


def run_family(family: str, args) -> str:
    """Check identical outputs, then time both; returns a markdown section."""
    from tests.rope.conftest import hf_config, hf_get_rope_index

    hf = hf_config(family)
    cfg = MRopeConfig.from_hf_config(hf)
    ids, mask, grids = make_batch(args.batch, args.images, 0)
    types_ = token_types(ids, cfg)
    reference = hf_get_rope_index(family, hf)
    ours_fn = functools.partial(get_rope_index, ids, cfg, image_grid_thw=grids, attention_mask=mask)
    ref_fn = functools.partial(reference, ids, mm_token_type_ids=types_, image_grid_thw=grids, attention_mask=mask)
    assert torch.equal(ours_fn().position_ids, ref_fn()[0]), "positions differ: not timing a wrong answer"
    ours_ms, ref_ms = timed(ours_fn, args.repeats), timed(ref_fn, args.repeats)
    return (f"## {family}\n\n{args.batch} samples x {args.images} images ({ids.numel()} slots, "
            f"{int(mask.sum())} real tokens)\n\n"
            f"| implementation | ms (best of {args.repeats}) |\n|---|---|\n"
            f"| transformers get_rope_index | {ref_ms:.1f} |\n| megatron_vlm_packing.rope.get_rope_index | {ours_ms:.1f} |\n\n"
            f"speed-up: {ref_ms / ours_ms:.1f}x (identical outputs checked first)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "all"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadiest timings)")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import transformers

    families = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"] if args.family == "all" else [args.family]
    machine = (f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, torch threads "
               f"{args.threads}; Python {platform.python_version()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}\n")
    text = machine + "".join("\n" + run_family(family, args) for family in families)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# mRoPE index speed\n\n`python benchmarks/mrope_speed.py --family {args.family} "
                    f"--repeats {args.repeats}`\n\n" + text)


if __name__ == "__main__":
    main()
