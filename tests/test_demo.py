"""The main job runs end to end: `megatron-vlm-packing demo` trains and ends with packed == unpacked,
and under torchrun at TP=2 x CP=2 + SP it prints the single process's losses."""

import os
import re
import subprocess
import sys

from megatron_vlm_packing.runtime.launcher import free_port

STEPS = "3"


def run_demo(*flags):
    return subprocess.run([sys.executable, "-m", "megatron_vlm_packing", "demo", "--steps", STEPS, *flags],
                          capture_output=True, text=True, timeout=300)


def run_demo_torchrun(nproc: int, *flags):
    """The demo under torchrun on the CPU (CUDA hidden: the CPU runtime refuses to run beside a GPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "megatron_vlm_packing", "demo", "--device", "cpu", "--steps", STEPS, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})


def printed_losses(out: str) -> tuple[list[float], float, float]:
    """Per-step losses, then the held-out packed and each-sample-alone losses."""
    steps = [float(v) for v in re.findall(r"step +\d+/\d+ +loss ([0-9.]+)", out)]
    held_out = re.search(r"packed loss ([0-9.]+), each sample alone ([0-9.]+)", out)
    return steps, float(held_out.group(1)), float(held_out.group(2))


def test_demo_trains_packed_and_reports_parity():
    proc = run_demo()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("step ") >= 3 and "packing on" in out
    assert re.search(r"efficiency 1\.000 \(padded rows: 0\.\d+\)", out)  # packing wastes nothing here
    diff = float(re.search(r"\|diff\| ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4


def test_demo_without_packing_pads_rows():
    proc = run_demo("--no-pack")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packing off" in proc.stdout
    assert re.search(r"efficiency 0\.\d+", proc.stdout)  # dense rows carry pad tokens


def test_demo_tp2_cp2_sp_prints_the_single_process_losses():
    # Same seed, same batches: the 4 ranks hold shards of the single process's model, so every
    # printed loss (each step's, over all CP ranks' tokens, and the held-out ones) is the single
    # process's to fp32 rounding. Before, rank 0 printed the loss of its own CP half only.
    single = run_demo("--device", "cpu")
    parallel = run_demo_torchrun(4, "--tp", "2", "--cp", "2", "--sp")
    assert single.returncode == 0, single.stderr[-3000:]
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert "tp=2 cp=2 sp=True" in parallel.stdout
    want_steps, want_packed, want_alone = printed_losses(single.stdout)
    got_steps, got_packed, got_alone = printed_losses(parallel.stdout)
    assert len(want_steps) == len(got_steps) == int(STEPS)
    for want, got in zip(want_steps + [want_packed, want_alone], got_steps + [got_packed, got_alone]):
        assert abs(got - want) <= 1e-4 * abs(want), (want_steps, got_steps, want_packed, got_packed)
