"""The main job runs end to end: `megatron-vlm-packing demo` trains and ends with packed == unpacked."""

import re
import subprocess
import sys


def run_demo(*flags):
    return subprocess.run([sys.executable, "-m", "megatron_vlm_packing", "demo", "--steps", "3", *flags],
                          capture_output=True, text=True, timeout=300)


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

