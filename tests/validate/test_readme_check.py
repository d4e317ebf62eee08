"""The README's "Check any packer's output" example prints what its comment says."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_check_example():
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                 if "validate_packed_batch(" in b)
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s*#\s*(.*)$", block, flags=re.M)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    assert out.getvalue().strip().splitlines() == expected == ["['uniform_boundaries'] [4]"]


def test_readme_check_sample_output_is_what_check_prints(tmp_path, monkeypatch, capsys):
    """The README's `$ megatron-vlm-packing check batch.pt --hf-config ...` sample against the real command on the
    batch it describes: 4 Qwen2.5-VL documents of 30 tokens, the first with a 4-token image whose token 8 has its h
    position one off, saved as the README says (no source rows). The sample left out the 'not checked' line the
    command prints for the source rows."""
    transformers = pytest.importorskip("transformers")
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.cli import main
    from megatron_vlm_packing.rope import MRopeConfig
    from tests.rope.conftest import END, IMAGE, START, hf_config

    block = re.search(r"```\n\$ (megatron-vlm-packing check .*?)\n(.*?)```", README.read_text(), flags=re.S)
    command, sample = block.group(1).split(), block.group(2).rstrip("\n").splitlines()
    monkeypatch.chdir(tmp_path)
    config_path = command[command.index("--hf-config") + 1]
    hf_config("qwen2_5_vl").save_pretrained(Path(config_path).parent)
    config = transformers.AutoConfig.from_pretrained(config_path)
    rows = [[11, 12, 13, 14, START] + [IMAGE] * 4 + [END] + list(range(20, 40))]
    rows += [list(range(100 * r, 100 * r + 30)) for r in (1, 2, 3)]
    ids = torch.tensor(rows)
    grids = torch.tensor([[1, 8, 2]])  # merged 4 x 1: tokens 5..8 at h = 5..8
    packed = pack_batch(dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids),
                             image_grid_thw=grids), label_style="hf", mrope=MRopeConfig.from_hf_config(config))
    positions = packed.position_ids.clone()
    positions[1, 0, 8] += 1
    saved = {k: getattr(packed, k) for k in ("input_ids", "labels", "loss_mask", "padding_mask", "packed_seq_params")}
    torch.save({**saved, "position_ids": positions, "image_grid_thw": grids}, command[2])
    capsys.readouterr()
    status = main(command[1:])
    assert capsys.readouterr().out.rstrip("\n").splitlines() == sample
    assert status == 1
