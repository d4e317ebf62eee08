"""`pack_batch` against Megatron-Bridge 0.6.2's row-loop packer, side by side, on CPU, one thread.

    python benchmarks/pack_vs_bridge.py [--batches 4 8 16 32 64] [--seqs 2048 4096 8192 16384 32768]
                                        [--cp 1] [--repeats 7] [--order fixed|shuffled] [--evict]
                                        [--out benchmarks/results/pack_vs_bridge.md]

The baseline is Megatron-Bridge's own
`megatron.bridge.data.packing.in_batch.pack_right_padded_sequence_batch_to_mcore_thd` when
megatron-bridge is installed (`scripts/setup.sh` installs 0.6.2; imported through
`bridge.imports`, without Transformer Engine; it packs in place, so each call gets a shallow copy of
the batch dict). `bridge_row_loop` re-implements it step for step (read in megatron-bridge 0.6.2):
lengths from the mask (sum, an `arange < length` mask, `torch.equal` against it, one `.item()` per
row), one dict of row slices per sample (tokens, position_ids, labels, loss_mask; each checked 1D
and of the row's length), `torch.full` outputs, then a Python loop copying each row's slices into
them (and an `arange` of pad positions where a row is padded to the CP multiple), and the boundary
tensors. It is timed beside the real one (it leaves out Bridge's checks of optional keys and its
`max_seqlen_kv` / `total_tokens` outputs), and is the baseline where Bridge is not installed.

Ours is timed twice. "pack_batch (loader)" is `pack_batch(host_reads=True)`, what `PackingCollator`
runs in a DataLoader worker, the same place Bridge's collate-time packer runs: the batch is on the
host, so the real lengths are read first and the value checks (ids in range, labels -100 or in
range, Hugging Face labels given as Megatron ones, loss weights finite and >= 0) run after packing,
over the packed tokens, with numpy for the small ops. "pack_batch (step path)" is the path the step
takes with a batch on an accelerator (`host_reads=False`): one host read, so the checks are screens
over all B*S slots riding it; timed here on the CPU it shows the cost of those screens, not a GPU's.
"packing core" times this project's packing pieces alone (mask check, plan, indices, slices copied,
positions, padding mask, PackedSeqParams) with no value check and none of `pack_batch`'s key /
media / option handling.

Every packer gets the same batch (Megatron-style: input_ids, labels already aligned, a float
loss_mask, a 0/1 attention_mask, 2D position_ids) and produces the same things: packed ids,
labels, loss mask, positions restarting per sample, and both boundary sets; ours also builds the
padding mask and `PackedSeqParams`, and checks the given position_ids (0..n-1 on every real token)
where Bridge packs them as they are. ("packing core" takes no position_ids: it computes them.)
Real lengths are lognormal (median S/4, sigma 0.8, clipped to [16, S]). Times are this thread's
CPU time (`time.thread_time`): with one thread and no waiting, that is the wall time of an idle
machine, and it stays honest on a shared machine where other processes take the cores. Calls
alternate (Bridge, re-implemented row loop, loader, step path, core, Bridge, ...) so that cache and
frequency effects hit all alike; the table gives the median of each and the median of the
per-round ratios.

What ran just before a call moves its time, and not alike: at 4 x 2048 the loader path took 365 us
after itself and 600 us after a numpy sort of 1.6 MB, Bridge's packer 635 and 814 us (one run, this
project's 2-core machine). In the fixed order the loader always follows the re-implemented row
loop, and Bridge our packing core. `--order shuffled` draws a new order each round, so each call
follows each other one equally often; `--evict` writes 64 MiB before every timed call, so each
starts with cold caches, as a packer in a DataLoader worker does after the dataset's own work.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from timing import grid_table  # benchmarks/timing.py (the script's folder is on sys.path)

IGNORE_INDEX = -100


def make_batch(batch: int, seq: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)  # the lognormal sampler draws from the global generator
    lengths = torch.distributions.LogNormal(torch.log(torch.tensor(seq / 4.0)), 0.8).sample((batch,))
    lengths = lengths.clamp(16, seq).long()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32000, (batch, seq), generator=g)
    keep = torch.arange(seq)[None] < lengths[:, None]
    return {
        "input_ids": torch.where(keep, ids, 0),
        "labels": torch.where(keep, torch.roll(ids, -1, 1), IGNORE_INDEX),
        "loss_mask": keep.float(),
        "attention_mask": keep.long(),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
    }


def _multiple_up(value: int, multiple: int) -> int:
    return value if multiple <= 1 else -(-value // multiple) * multiple


def _row_slice(tensor: torch.Tensor, length: int) -> torch.Tensor:
    if tensor.dim() != 1 or tensor.numel() != length:
        raise ValueError("row tensors must be 1D and as long as their token row")
    return tensor


def bridge_row_loop(batch: dict, *, pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> dict:
    """Megatron-Bridge 0.6.2's collate-time packer, re-implemented (see the module docstring)."""
    tokens, positions = batch["input_ids"], batch["position_ids"]
    active = batch["attention_mask"].to(device=tokens.device, dtype=torch.bool)
    lengths_t = active.sum(dim=1)
    expected = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0) < lengths_t.unsqueeze(1)
    if not torch.equal(active, expected):
        raise ValueError("right-padded rows required")
    lengths = [int(n.item()) for n in lengths_t]
    if any(n == 0 for n in lengths):
        raise ValueError("empty row")
    keys = ("labels", "loss_mask")
    rows = []
    for b, n in enumerate(lengths):
        row = {"input_ids": tokens[b, :n], "position_ids": positions[b, :n]}
        row.update({k: batch[k][b, :n] for k in keys})
        for key in ("position_ids", *keys):
            _row_slice(row[key], n)
        rows.append(row)
    padded = [_multiple_up(n, pad_to_multiple_of) for n in lengths]
    cu, cu_padded = [0], [0]
    for n, p in zip(lengths, padded):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + p)
    total = cu_padded[-1]
    out = {"input_ids": torch.full((1, total), pad_token_id, dtype=tokens.dtype),
           "position_ids": torch.zeros((1, total), dtype=positions.dtype),
           "labels": torch.full((1, total), IGNORE_INDEX, dtype=batch["labels"].dtype),
           "loss_mask": torch.full((1, total), 0, dtype=batch["loss_mask"].dtype)}
    offset = 0
    for row, n, p in zip(rows, lengths, padded):
        for key in ("input_ids", "position_ids", *keys):
            out[key][0, offset:offset + n] = row[key]
        if p > n:
            start = row["position_ids"][-1] + 1
            out["position_ids"][0, offset + n:offset + p] = torch.arange(start, start + p - n, dtype=positions.dtype)
        offset += p
    out["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32)
    if pad_to_multiple_of > 1:
        out["cu_seqlens_q_padded"] = torch.tensor(cu_padded, dtype=torch.int32)
    out["max_seqlen_q"] = torch.tensor(max(padded), dtype=torch.int32)
    return out


def installed_bridge_packer():
    """Megatron-Bridge's own `pack_right_padded_sequence_batch_to_mcore_thd` when megatron-bridge is
    installed (imported without its TE-importing package chain, `bridge.imports`), else None."""
    from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module

    if bridge_unavailable_reason() is not None:
        return None
    module = import_bridge_module("megatron.bridge.data.packing.in_batch")
    packer = module.pack_right_padded_sequence_batch_to_mcore_thd

    def bridge_installed(batch: dict, *, pad_to_multiple_of: int = 1) -> dict:
        out = dict(batch)  # it packs in place, into the dict it is given
        packer(out, pad_to_multiple_of=pad_to_multiple_of)
        return out

    return bridge_installed


def ours(batch: dict, *, cp_size: int = 1, host_reads: bool = True):
    """`pack_batch` as the loader runs it (`host_reads=True`, what `PackingCollator` passes), or as the
    step runs it on an accelerator (`host_reads=False`: the one-read path, timed here on the CPU)."""
    from megatron_vlm_packing import pack_batch

    return pack_batch(batch, cp_size=cp_size, label_style="megatron", host_reads=host_reads)


def packing_core(batch: dict, *, cp_size: int = 1):
    """What any exact packer must do, with this project's pieces and none of `read_rows`' [B, S] value
    checks: real lengths (mask checked), plan, indices, ids / labels / loss weights packed, positions,
    padding mask, PackedSeqParams."""
    from megatron_vlm_packing.packing import (
        PackMultiples, lengths_from_keep_mask, make_pack_plan, make_packed_seq_params, pack_rows, plan_indices,
        segment_positions,
    )

    ids = batch["input_ids"]
    plan = make_pack_plan(lengths_from_keep_mask(batch["attention_mask"]), row_capacity=ids.shape[1],
                          multiples=PackMultiples.for_parallel(cp_size=cp_size))
    indices = plan_indices(plan)
    return (pack_rows(ids, indices), pack_rows(batch["labels"], indices, pad_value=IGNORE_INDEX),
            pack_rows(batch["loss_mask"], indices), segment_positions(indices), ~indices.is_real,
            make_packed_seq_params(plan, indices))


def check_same(batch: dict, cp_size: int, installed=None) -> None:
    """Every packer (the re-implemented row loop, Bridge's own when installed, both paths of ours) agrees
    on every real token and on the boundaries."""
    multiple = 2 * cp_size if cp_size > 1 else 1
    theirs = bridge_row_loop(batch, pad_to_multiple_of=multiple)
    if installed is not None:
        real = installed(batch, pad_to_multiple_of=multiple)
        for key in ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens_q"):
            if not torch.equal(theirs[key], real[key]):
                raise AssertionError(f"{key} differs between Bridge's packer and its re-implementation")
    for host_reads in (True, False):
        mine = ours(batch, cp_size=cp_size, host_reads=host_reads)
        real = ~mine.padding_mask[0]
        for key, value in (("input_ids", mine.input_ids), ("labels", mine.labels), ("position_ids", mine.position_ids)):
            if not torch.equal(theirs[key][0][real], value[0][real]):
                raise AssertionError(f"{key} differs between the packers (host_reads={host_reads})")
        if not torch.equal(theirs["cu_seqlens_q"], mine.packed_seq_params.cu_seqlens_q):
            raise AssertionError(f"cu_seqlens differ between the packers (host_reads={host_reads})")


def side_by_side(calls: list, repeats: int, shuffled: bool = False, evict: bool = False) -> list[list[float]]:
    """Per-call ms of every call in `calls`, alternated (each once per round) after one warm-up of each:
    in the given order every round, or (`shuffled`) in a new random order each round (seeded), so that
    each call follows each other one equally often; with `evict`, every call starts with cold caches
    (`evict_caches` first, untimed)."""
    for call in calls:
        call()
    samples = [[] for _ in calls]
    order, rng = list(range(len(calls))), random.Random(0)
    for _ in range(repeats):
        if shuffled:
            rng.shuffle(order)
        for index in order:
            if evict:
                evict_caches()
            start = time.thread_time()
            calls[index]()
            samples[index].append((time.thread_time() - start) * 1e3)
    return samples


_EVICTION_BUFFER = []


def evict_caches() -> None:
    """Write 64 MiB, more than this machine's caches hold: the next call finds none of its code or data
    cached, like a packer in a DataLoader worker after the dataset's own work."""
    if not _EVICTION_BUFFER:
        import numpy as np

        _EVICTION_BUFFER.append(np.zeros(8 * 2**20, dtype=np.int64))
    _EVICTION_BUFFER[0] += 1


def ratio(baseline: list[float], other: list[float]) -> float:
    """Median of the per-round ratios baseline / other."""
    return statistics.median(b / o for b, o in zip(baseline, other))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--cp", type=int, default=1, help="pack for this CP size (documents padded to 2*cp)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--order", choices=["fixed", "shuffled"], default="fixed",
                        help="call order in each round: fixed (Bridge, its re-implementation, loader, step path, "
                             "core) or shuffled anew each round")
    parser.add_argument("--evict", action="store_true", help="evict the caches before every timed call")
    parser.add_argument("--out", help="append the markdown table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    installed = installed_bridge_packer()
    multiple = 2 * args.cp if args.cp > 1 else 1
    evicted = ", caches evicted before each call" if args.evict else ""
    if installed is None:
        baseline_name = "bridge row loop"
        header = [f"cp={args.cp}, torch {torch.__version__}, 1 thread, {args.order} order{evicted}, megatron-bridge "
                  "not installed: the re-implemented row loop is the baseline",
                  "| B x S | real tokens | bridge row loop ms | pack_batch (loader) ms | pack_batch (step path) ms "
                  "| packing core ms | loader speedup | step path speedup | core speedup |",
                  "|---|---|---|---|---|---|---|---|---|"]
    else:
        from megatron_vlm_packing.bridge.imports import bridge_version

        baseline_name = f"bridge {bridge_version()}"
        header = [f"cp={args.cp}, torch {torch.__version__}, 1 thread, {args.order} order{evicted}, megatron-bridge "
                  f"{bridge_version()} installed: speedups are over its own packer",
                  f"| B x S | real tokens | {baseline_name} ms | bridge row loop (re-implemented) ms | "
                  "pack_batch (loader) ms | pack_batch (step path) ms | packing core ms | loader speedup | "
                  "loader speedup over the re-implementation | step path speedup | core speedup |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    print(f"baseline: {baseline_name}", flush=True)

    def row(b: int, s: int) -> str:
        batch = make_batch(b, s)
        check_same(batch, args.cp, installed)
        calls = [lambda: bridge_row_loop(batch, pad_to_multiple_of=multiple),
                 lambda: ours(batch, cp_size=args.cp), lambda: ours(batch, cp_size=args.cp, host_reads=False),
                 lambda: packing_core(batch, cp_size=args.cp)]
        if installed is not None:
            calls.insert(0, lambda: installed(batch, pad_to_multiple_of=multiple))
        samples = side_by_side(calls, args.repeats, shuffled=args.order == "shuffled", evict=args.evict)
        times = [statistics.median(t) for t in samples]
        loader, step, core = samples[-3:]
        ratios = [ratio(samples[0], loader)]
        if installed is not None:
            ratios.append(ratio(samples[1], loader))
        ratios += [ratio(samples[0], step), ratio(samples[0], core)]
        return (f"| {b} x {s} | {int(batch['attention_mask'].sum())} | "
                + " | ".join(f"{t:.3f}" for t in times) + " | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")

    grid_table(header, args.batches, args.seqs, row, args.out)


if __name__ == "__main__":
    main()
