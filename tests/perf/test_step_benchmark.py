"""The benchmarks cannot rot unseen between the sessions that run them: benchmarks/step_pack_vs_pad.py and
step_breakdown.py (run on a lent GPU, often sessions apart) run as a user runs them, every mode, on the
seconds-long `smoke` preset; benchmarks/pack_vs_bridge.py's packers all agree on a small batch, Megatron-Bridge's own
packer included when it is installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pack_vs_bridge  # noqa: E402


@pytest.mark.parametrize("rope", ["mrope", "1d"])
def test_step_benchmark_runs_every_mode(rope, tmp_path):
    out = tmp_path / "table.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_pack_vs_pad.py"), "--preset", "smoke", "--rope",
                    rope, "--backends", "reference", "--repeats", "1", "--out", str(out)],
                   check=True, env=env, cwd=tmp_path, capture_output=True, timeout=300)
    rows = [line for line in out.read_text().splitlines() if line.startswith("| reference |")]
    modes = [row.split(" | ")[2] for row in rows]
    assert modes == ["padded to S", "padded to batch max", "packed THD", "packed THD", "packed THD, loader-packed"]
    for row in rows:
        ms, speedup = row.split(" | ")[5:7]
        assert float(ms) > 0 and speedup.endswith("x")


def test_step_breakdown_profiles_both_modes(tmp_path):
    out = tmp_path / "breakdown.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_breakdown.py"), "--preset", "smoke", "--steps", "1",
                    "--top", "5", "--out", str(out)], check=True, env=env, cwd=tmp_path, capture_output=True,
                    timeout=300)
    text = out.read_text()
    assert "| padded to batch max |" in text and "| packed THD, ours |" in text
    op_rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(op_rows) == 5
    for mode in ("padded to batch max", "packed THD, ours"):  # sync events, their sites, top CPU ops: each mode
        rows = [line.split(" | ") for line in text.split("Sync events per step")[1].splitlines()
                if line.startswith(f"| {mode} | ")]
        assert len(rows) >= 3 and all(float(row[-1].rstrip(" |")) >= 0 for row in rows)


@pytest.mark.parametrize("cp", [1, 2])
def test_pack_vs_bridge_packers_agree_and_time(cp):
    batch = pack_vs_bridge.make_batch(4, 256)
    installed = pack_vs_bridge.installed_bridge_packer()
    pack_vs_bridge.check_same(batch, cp, installed)  # raises AssertionError on any difference
    calls = [lambda: pack_vs_bridge.bridge_row_loop(batch), lambda: pack_vs_bridge.ours(batch, cp_size=cp)]
    samples = pack_vs_bridge.side_by_side(calls, repeats=2)
    assert [len(s) for s in samples] == [2, 2]
    assert pack_vs_bridge.ratio(samples[0], samples[1]) > 0


def test_every_benchmark_import_of_this_package_resolves():
    """The GPU-only scripts import inside their functions; a moved name fails only on the lent GPU."""
    import ast
    import importlib
    import importlib.util

    missing = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_vlm_packing")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                    missing.append(f"{script.name}: from {node.module} import {alias.name}")
    assert not missing, missing
