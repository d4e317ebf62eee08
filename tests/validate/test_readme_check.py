"""The README's "Check any packer's output" example prints what its comment says."""

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_check_example():
    block = next(b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                 if "validate_packed_batch(" in b)
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s*#\s*(.*)$", block, flags=re.M)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    assert out.getvalue().strip().splitlines() == expected == ["['uniform_boundaries'] [4]"]
