"""The README's runnable example must stay true: run it and compare each print with its comment."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_pack_batch_example_prints_what_its_comments_say():
    block = next(b for b in python_blocks() if "pack_batch(" in b and "megatron.training" not in b)
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s*#\s*(\[.*?\])(?:\s{2,}.*)?$", block, flags=re.M)]
    assert len(expected) >= 4, "the README example should document its outputs in comments"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    assert out.getvalue().strip().splitlines() == expected
