"""PEP 562 lazy exports, the one rule for a package whose `__init__` re-exports names of heavy modules.

Importing such a package runs nothing but its `__init__`; each public name is imported from its module on first
use (`from package import name`, `package.name`, `import *`) and kept in the package, so later reads skip the
hook. A submodule is reached as an attribute as when `__init__` imported everything (`package.packing` after
`import package`). The command line leans on it: `megatron-vlm-packing --help` imports neither Megatron-Core nor
transformers (seconds, and their Transformer Engine / Apex warnings).
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping


def lazy_exports(package: str, sources: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list]]:
    """The (`__getattr__`, `__dir__`) of `package`, whose public names live in the modules `sources` names.

    Example: in `megatron_vlm_packing/__init__.py`,
    `__getattr__, __dir__ = lazy_exports(__name__, {"pack_batch": "megatron_vlm_packing.packing", ...})`.

    Raises (from `__getattr__`):
        AttributeError: a name that is neither in `sources` nor a submodule, as a module without the hook says.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        source = sources.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source), name)
        elif not name.startswith("_"):  # dunders and private names are probed by tools: never import for them
            value = _submodule(package, name)
        else:
            value = None
        if source is None and value is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list:
        return sorted(set(namespace) | set(sources))

    return __getattr__, __dir__


def _submodule(package: str, name: str):
    """`package.name` imported, or None when there is no such module (an error inside one is raised as is)."""
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{package}.{name}":
            raise
        return None
