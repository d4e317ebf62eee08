"""`megatron-vlm-packing --help` and argument errors import no Megatron-Core and no transformers (seconds and the
Transformer Engine / Apex warnings): the package's public names are resolved on first use (PEP 562), and the
command line imports heavy modules only inside the subcommand that runs. Each case runs in a fresh interpreter,
since this test session has imported everything already."""

import json
import subprocess
import sys

import pytest

import megatron_vlm_packing
from megatron_vlm_packing.cli import build_parser

HEAVY = ("megatron.core", "transformers")
SUBCOMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)  # what `--help` lists

# Runs main(argv) as the console script does, then reports how it exited and which heavy modules were imported.
_RUN_CLI = """
import json, sys
from megatron_vlm_packing.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules]}))
"""


def _run_cli(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN_CLI, json.dumps(argv), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_subcommands_are_the_four_the_cli_documents():
    assert SUBCOMMANDS == ["check", "demo", "inspect", "plan"]


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS],
                         ids=lambda argv: " ".join(argv))
def test_help_imports_neither_megatron_core_nor_transformers(argv):
    assert _run_cli(argv) == {"code": 0, "heavy": []}


@pytest.mark.parametrize("argv", [[], ["nosuch"], ["inspect", "5,x"], ["demo", "--steps", "many"],
                                  ["plan", "--no-such-flag"], ["check"]], ids=lambda argv: " ".join(argv) or "none")
def test_argument_errors_import_neither_megatron_core_nor_transformers(argv):
    assert _run_cli(argv) == {"code": 2, "heavy": []}


def test_importing_the_package_imports_no_megatron_core():
    code = f"import sys, megatron_vlm_packing; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]"


_IMPORT_ALL = """
import importlib, json, sys
import megatron_vlm_packing
names = json.loads(sys.argv[1])
found = {}
for name in names:
    namespace = {}
    exec(f"from megatron_vlm_packing import {name}", namespace)
    found[name] = f"{namespace[name].__module__}.{namespace[name].__qualname__}"
star = {}
exec("from megatron_vlm_packing import *", star)
print(json.dumps({"found": found, "star": sorted(k for k in star if not k.startswith("__")),
                  "rope": importlib.import_module("megatron_vlm_packing.rope").MRopeConfig.from_hf_config.__qualname__,
                  "dir": sorted(set(names) - set(dir(megatron_vlm_packing)))}))
"""


def test_every_public_name_imports_as_before_in_a_fresh_interpreter():
    """`from megatron_vlm_packing import X` for every name of `__all__` (DESIGN's public names among them), `import
    *` and `dir()`, as when `__init__` imported them all; and DESIGN's `megatron_vlm_packing.rope.MRopeConfig`."""
    names = list(megatron_vlm_packing.__all__)
    assert {"pack_batch", "cp_partition_index", "make_forward_step", "PackedBatch"} <= set(names)
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, json.dumps(names)], capture_output=True, text=True,
                          timeout=300, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    here = {name: getattr(megatron_vlm_packing, name) for name in names}
    assert got["found"] == {name: f"{value.__module__}.{value.__qualname__}" for name, value in here.items()}
    assert got["star"] == sorted(names) and got["dir"] == []
    assert got["rope"] == "MRopeConfig.from_hf_config"


def test_the_package_names_are_the_defining_modules_objects():
    from megatron_vlm_packing import packing, parallel, planner, step, validate

    for name in megatron_vlm_packing.__all__:
        owner = next(m for m in (packing, parallel, planner, step, validate) if hasattr(m, name))
        assert getattr(megatron_vlm_packing, name) is getattr(owner, name)
    with pytest.raises(AttributeError, match="module 'megatron_vlm_packing' has no attribute 'no_such_name'"):
        megatron_vlm_packing.no_such_name  # noqa: B018
    assert isinstance(megatron_vlm_packing.__version__, str)
