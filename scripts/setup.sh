#!/usr/bin/env bash
# Create a virtual environment and install megatron-vlm-packing (editable) with its test extras.
#
#   bash scripts/setup.sh            # .venv on Python 3.12 -> megatron-core 0.19.x, transformers 5.12.1 (primary target)
#   PY=3.11 VENV=.venv311 bash scripts/setup.sh   # support floor: megatron-core 0.16.1, torch 2.13 CPU, newest transformers
#   NO_BRIDGE=1 bash scripts/setup.sh             # skip megatron-bridge (its tests then skip; the newest transformers)
#   NO_ENERGON=1 bash scripts/setup.sh            # skip megatron-energon (its tests then skip)
#
# On Python >= 3.12 the `bridge` extra (megatron-bridge's Qwen-VL / Omni model modules) is installed
# with --no-deps: its own dependency list would replace torch, megatron-core and transformers.
# That leg models a Bridge user, so it installs the transformers Bridge 0.6.2 declares it runs with
# (`transformers<=5.12.1,>=5.8`): the pin is pyproject.toml's `bridge-transformers` extra, and the set-up fails
# when the installed transformers falls outside the range Bridge's metadata declares. The floor leg (and
# NO_BRIDGE=1) takes the newest transformers, so CI covers both the Bridge user's version and the newest.
# The `energon` extra (megatron-energon, about 40 small pure additions, none of them replacing an installed
# package) is installed there too; the support floor leaves it out, where its tests skip.
#
# Re-running is cheap: it does nothing when the install stamp is newer than pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
py_version=${PY:-3.12}
venv=${VENV:-.venv}
stamp="$venv/.installed-stamp"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi

find_python() {
  # A pyenv shim can sit on PATH for a version that is not selected: only trust one that runs.
  if "python$py_version" -c "import sys" >/dev/null 2>&1; then command -v "python$py_version"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E "^${py_version//./\\.}(\.[0-9]+)?$" | sort -V | tail -n 1)
    if [ -n "$v" ]; then PYENV_VERSION=$v pyenv which python; return; fi
  fi
  return 1
}

python_bin=$(find_python) || {
  echo "setup.sh: no Python $py_version found (looked for python$py_version on PATH and in pyenv)." >&2
  echo "Install Python $py_version (megatron-core >= 0.17 needs >= 3.12) or set PY=3.11 VENV=.venv311." >&2
  exit 1
}
echo "setup.sh: creating $venv with $python_bin ($("$python_bin" --version))"
"$python_bin" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if [ "$py_version" = "3.11" ]; then
  # The support floor: the CPU build of torch 2.13 (small, quick) and megatron-core 0.16.1.
  "$venv/bin/python" -m pip install -q "torch==2.13.0" "megatron-core==0.16.1"
fi
versions() { "$venv/bin/python" -c 'import torch, megatron.core as m, transformers as t; print(torch.__version__, m.__version__, t.__version__)'; }
primary() { "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; }
extras="test,hf"
if [ -z "${NO_BRIDGE:-}" ] && primary; then
  extras="$extras,bridge-transformers"
fi
"$venv/bin/python" -m pip install -q -e ".[$extras]"
if [ -z "${NO_ENERGON:-}" ] && primary; then
  before=$(versions)
  # The pin from pyproject.toml's `energon` extra (installed by name: no second editable install).
  "$venv/bin/python" -m pip install -q $("$venv/bin/python" -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["energon"])')
  after=$(versions)
  if [ "$before" != "$after" ]; then
    echo "setup.sh: installing megatron-energon changed torch / megatron-core / transformers: $before -> $after" >&2
    exit 1
  fi
fi
if [ -z "${NO_BRIDGE:-}" ] && primary; then
  before=$(versions)
  "$venv/bin/python" -m pip install -q --no-deps "megatron-bridge==0.6.2" einops omegaconf "antlr4-python3-runtime>=4.9,<4.10"
  after=$(versions)
  if [ "$before" != "$after" ]; then
    echo "setup.sh: installing megatron-bridge changed torch / megatron-core / transformers: $before -> $after" >&2
    exit 1
  fi
  # --no-deps skips Bridge's own requirement on transformers: check the installed one against it here.
  "$venv/bin/python" - <<'EOF'
import sys
from importlib.metadata import requires, version
from packaging.requirements import Requirement

declared = [r for r in map(Requirement, requires("megatron-bridge")) if r.name == "transformers" and r.marker is None]
installed = version("transformers")
if not all(r.specifier.contains(installed, prereleases=True) for r in declared):
    sys.exit(f"setup.sh: transformers {installed} is outside megatron-bridge {version('megatron-bridge')}'s declared "
             f"range {', '.join(str(r.specifier) for r in declared)}: change the `bridge-transformers` pin in pyproject.toml")
EOF
fi
touch "$stamp"
echo "setup.sh: ready: $("$venv/bin/python" -c 'import torch, megatron.core as m, transformers as t; print("torch", torch.__version__, "megatron-core", m.__version__, "transformers", t.__version__)')"
