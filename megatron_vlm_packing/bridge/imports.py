"""Import Megatron-Bridge's leaf model modules without running its Transformer-Engine-importing
package chain.

`import megatron.bridge` runs `megatron/bridge/__init__.py`, which imports (through models, peft,
...) `transformer_engine` unconditionally: on a machine without TE it fails before any model module
loads. The model modules themselves (e.g. `megatron.bridge.models.qwen_vl.qwen3_vl_provider`) need
far less. `bridge_modules(...)` imports them with their parent packages registered in `sys.modules`
as bare packages (a module object holding only `__path__`, served by a meta-path finder that is
installed only inside `bare_bridge_packages()`), so no package `__init__` runs, and removes those
bare packages again on exit: after it, the leaf modules stay importable by name and
a later `import megatron.bridge` (where TE is present) runs the real package chain.

Nothing happens at import time of this module; every function below is explicit.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

BRIDGE_PACKAGE = "megatron.bridge"
TESTED_VERSION = "0.6.2"


def bridge_version() -> str | None:
    """The installed megatron-bridge distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-bridge")
    except importlib.metadata.PackageNotFoundError:
        return None


def bridge_unavailable_reason() -> str | None:
    """Why Bridge's model modules cannot be used here (a sentence), or None when they can."""
    if sys.version_info < (3, 12):
        return f"megatron-bridge needs Python >= 3.12 (this is {sys.version_info.major}.{sys.version_info.minor})"
    if bridge_version() is None or _bridge_root() is None:
        return ("megatron-bridge is not installed (scripts/setup.sh installs it: pip install --no-deps "
                f"megatron-bridge=={TESTED_VERSION} einops omegaconf 'antlr4-python3-runtime>=4.9,<4.10')")
    for light in ("einops", "omegaconf"):
        if importlib.util.find_spec(light) is None:
            return f"megatron-bridge's model modules import {light}, which is not installed"
    return None


def _bridge_root() -> Path | None:
    """The directory of the `megatron.bridge` package, found without importing it."""
    import megatron  # a namespace package (megatron-core provides megatron.core)

    for entry in getattr(megatron, "__path__", []):
        candidate = Path(entry) / "bridge"
        if (candidate / "__init__.py").is_file():
            return candidate
    return None


class _BarePackageFinder(importlib.abc.MetaPathFinder):
    """Answers for packages under megatron.bridge (directories with __init__.py) with bare packages.

    Plain modules (.py files) are left to the normal finders, so their code runs as usual.
    """

    def __init__(self, root: Path):
        self.root = root
        self.created: dict[str, types.ModuleType] = {}

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(BRIDGE_PACKAGE + ".") and name != BRIDGE_PACKAGE:
            return None
        directory = self.root.joinpath(*name.split(".")[2:])
        if not (directory / "__init__.py").is_file():
            return None
        spec = importlib.machinery.ModuleSpec(name, _BareLoader(self, directory), is_package=True)
        spec.submodule_search_locations = [str(directory)]
        return spec


class _BareLoader(importlib.abc.Loader):
    def __init__(self, finder: _BarePackageFinder, directory: Path):
        self.finder, self.directory = finder, directory

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):  # a bare package: no __init__ code runs
        module.__path__ = [str(self.directory)]
        self.finder.created[module.__name__] = module


@contextmanager
def bare_bridge_packages() -> Iterator[dict[str, types.ModuleType]]:
    """While open, every megatron.bridge package not yet imported is imported bare (no __init__ runs).

    Yields the packages created so far (name -> module). On exit the finder is removed and exactly
    those bare packages leave `sys.modules` (only while they are still the objects put there) and
    are unbound from their parents; modules imported meanwhile stay importable by name.
    """
    root = _bridge_root()
    if root is None:
        raise ImportError(bridge_unavailable_reason() or "megatron.bridge not found")
    finder = _BarePackageFinder(root)
    sys.meta_path.insert(0, finder)
    try:
        yield finder.created
    finally:
        sys.meta_path.remove(finder)
        for name, module in sorted(finder.created.items(), key=lambda item: -len(item[0])):
            if sys.modules.get(name) is module:
                del sys.modules[name]
            parent, _, child = name.rpartition(".")
            if getattr(sys.modules.get(parent), child, None) is module:
                delattr(sys.modules[parent], child)


def import_bridge_module(module_name: str) -> types.ModuleType:
    """Import one of Bridge's modules (full dotted name) without running its parents' __init__ files.

    Raises:
        ImportError: Bridge is not installed here (the message says how to install it), or the
            module itself imports something missing (e.g. transformer_engine in a TE-only module).
    """
    if not module_name.startswith(BRIDGE_PACKAGE + "."):
        raise ValueError(f"module_name must start with '{BRIDGE_PACKAGE}.', got {module_name!r}")
    if module_name in sys.modules:
        return sys.modules[module_name]
    reason = bridge_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    with bare_bridge_packages():
        return importlib.import_module(module_name)


def import_bridge_modules(*module_names: str) -> list[types.ModuleType]:
    """`import_bridge_module` for several names at once (one bare-package scope)."""
    reason = bridge_unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    with bare_bridge_packages():
        return [importlib.import_module(name) for name in module_names]
