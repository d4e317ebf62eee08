"""Packing in a DataLoader worker, end to end: `PackingCollator` against Megatron-Bridge 0.6.2's row loop.

    python benchmarks/loader_vs_bridge.py [--batches 4 8 16 32 64] [--seqs 2048 4096 8192 16384 32768]
                                          [--steps 200] [--rounds 3] [--out benchmarks/results/loader_vs_bridge.md]

What a trainer waits for is the packed micro-batch in its own process, not the packer's call: a
DataLoader worker collates, packs, and sends the result, one tensor storage at a time through
shared memory (each storage a shared-memory file, mapped again in the main process). Both arms run
in a real `DataLoader(num_workers=1)` over a dataset that yields the same collated batch
(`pack_vs_bridge.make_batch`: Megatron-style, position_ids included), one arm with
`PackingCollator(label_style="megatron")` as `collate_fn` (which packs with
`pack_batch(host_reads=True)` and lays the micro-batch out in one storage, `packing/arena.py`),
the other with `pack_vs_bridge.bridge_row_loop` (the re-implemented Bridge packer; its dict holds
6 storages). The time is the main process's wall time per micro-batch received, over `--steps`
micro-batches after the first (the worker's start is not counted); the arms alternate for
`--rounds` rounds and the table gives each arm's median and the median of the per-round ratios.
The worker and the main process each have a core of their own on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pack_vs_bridge import bridge_row_loop, make_batch  # noqa: E402
from timing import grid_table  # noqa: E402


class RepeatedBatch(Dataset):
    """`steps` times the same collated batch (`batch_size=None`: each item is a whole batch)."""

    def __init__(self, batch: dict, steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> dict:
        return self.batch


def ms_per_micro_batch(collate_fn, batch: dict, steps: int) -> float:
    loader = DataLoader(RepeatedBatch(batch, steps + 1), batch_size=None, num_workers=1, collate_fn=collate_fn,
                        prefetch_factor=4)
    received = iter(loader)
    next(received)  # the worker has started
    start = time.perf_counter()
    count = sum(1 for _ in received)
    return (time.perf_counter() - start) / count * 1e3


def storages(value) -> int:
    """Distinct tensor storages in a dict's values or a micro-batch (what a worker sends)."""
    from megatron_vlm_packing.packing.collate import tensors_of

    tensors = list(value.values()) if isinstance(value, dict) else tensors_of(value)
    return len({t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)})


def check_same(batch: dict, collator) -> None:
    """The micro-batch a worker sends is what `pack_batch` packs, and the row loop agrees on real tokens."""
    from megatron_vlm_packing import pack_batch

    received = next(iter(DataLoader(RepeatedBatch(batch, 1), batch_size=None, num_workers=1, collate_fn=collator)))
    expected = pack_batch(batch, label_style="megatron")
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        if not torch.equal(getattr(received, name), getattr(expected, name)):
            raise AssertionError(f"{name} differs after the worker sent it")
    theirs, real = bridge_row_loop(batch), ~expected.padding_mask[0]
    if not torch.equal(theirs["input_ids"][0][real], expected.input_ids[0][real]):
        raise AssertionError("the row loop packs other ids")


def main() -> None:
    from megatron_vlm_packing.packing.collate import PackingCollator

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="append the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    collator = PackingCollator(label_style="megatron")
    header = [f"torch {torch.__version__}, 1 worker, {args.steps} micro-batches per run, {args.rounds} rounds",
              "| B x S | storages sent (bridge / ours) | bridge row loop ms | PackingCollator ms | speedup |",
              "|---|---|---|---|---|"]

    def row(b: int, s: int) -> str:
        batch = make_batch(b, s)
        check_same(batch, collator)
        theirs, ours = [], []
        for _ in range(args.rounds):
            theirs.append(ms_per_micro_batch(bridge_row_loop, batch, args.steps))
            ours.append(ms_per_micro_batch(collator, batch, args.steps))
        ratio = statistics.median(t / o for t, o in zip(theirs, ours))
        return (f"| {b} x {s} | {storages(bridge_row_loop(batch))} / {storages(collator(batch))} | "
                f"{statistics.median(theirs):.2f} | {statistics.median(ours):.2f} | {ratio:.2f}x |")

    grid_table(header, args.batches, args.seqs, row, args.out)

if __name__ == "__main__":
    main()
