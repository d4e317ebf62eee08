"""benchmarks/loader_vs_bridge.py cannot rot: its smallest config runs both arms through a real
DataLoader worker, checks what the worker sent, and counts the storages each arm sends."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import loader_vs_bridge as bench  # noqa: E402

from megatron_vlm_packing.packing.collate import PackingCollator  # noqa: E402


def test_both_arms_run_in_a_worker_and_ours_sends_one_storage():
    batch = bench.make_batch(4, 64)
    collator = PackingCollator(label_style="megatron")
    bench.check_same(batch, collator)
    assert bench.ms_per_micro_batch(collator, batch, 2) > 0
    assert bench.ms_per_micro_batch(bench.bridge_row_loop, batch, 2) > 0
    assert bench.storages(collator(batch)) == 1
    assert bench.storages(bench.bridge_row_loop(batch)) == 6
