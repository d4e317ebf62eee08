"""Count host syncs: every place where Python reads a tensor's values (or a data-dependent shape).

On an accelerator each of these makes the host wait until the device has produced the value, so the
host can no longer run ahead queueing kernels; a step with one per layer is host-bound. On a CPU
nothing waits, but the calls are the same, so counting them on CPU is a faithful, deterministic
proxy: a count, not a time.

What counts (kind: the calls), on a tensor of ANY device (a CPU test stands in for the GPU run):

- "item": `Tensor.item()`.
- "tolist": `Tensor.tolist()`.
- "bool": tensor truthiness (`if t:`, `bool(t)`, `and`/`or`/`not` on a tensor), `torch.is_nonzero`,
  and the functions that return a Python bool of tensor values: `torch.equal`, `torch.allclose`.
- "scalar": `int(t)`, `float(t)`, `complex(t)`, `t.__index__()` (a tensor used as a slice bound,
  `range(t)`, a shape), and formatting a tensor (`f"{t}"`, `str(t)`, `repr(t)`).
- "dynamic_shape": calls whose OUTPUT SHAPE depends on tensor values, so the host must read them
  to allocate: `nonzero`, `argwhere`, one-argument `torch.where`, `masked_select`, indexing with a
  boolean tensor (`x[mask]`, and `x[mask] = v` unless v is one value: torch then runs
  `masked_fill_`, which needs no sync), `unique`, `unique_consecutive`, `bincount`, and
  `repeat_interleave` with tensor repeats and no `output_size`.
- "to_host": `.cpu()`, `.numpy()`, `.to("cpu")` — counted only for a tensor NOT already on the
  CPU. On a CPU run they are identity operations on host data (a DataLoader's collate legitimately
  calls them), so counting them there would count nothing real.

Not counted: collectives (they wait on the network, not the host), `torch.cuda.synchronize()` and
stream/event waits (no tensor goes through them; none of this package's code calls them), and
operations inside a call that is itself counted (the mode is off while a counted call runs, so
`int(t)` is one sync, not two), and anything inside a module passed to `SyncCounter.exclude`
(e.g. a CPU reference attention standing in for a GPU kernel).

Usage:

    with count_host_syncs() as syncs:
        output, loss_fn = forward_step(iter([batch]), model)
        loss_fn(output)[0].backward()
    assert syncs.total <= 1, syncs.report()
"""

from __future__ import annotations

import collections
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_ALWAYS = {
    "item": "item", "tolist": "tolist",
    "__bool__": "bool", "is_nonzero": "bool", "equal": "bool", "allclose": "bool",
    "__int__": "scalar", "__float__": "scalar", "__complex__": "scalar", "__index__": "scalar",
    "__format__": "scalar", "__repr__": "scalar", "__str__": "scalar",
    "nonzero": "dynamic_shape", "argwhere": "dynamic_shape", "masked_select": "dynamic_shape",
    "unique": "dynamic_shape", "unique_consecutive": "dynamic_shape", "bincount": "dynamic_shape",
}
_TO_HOST = frozenset({"cpu", "numpy"})
_THIS_FILE = __file__.replace("\\", "/")
KINDS = ("item", "tolist", "bool", "scalar", "dynamic_shape", "to_host")


@dataclass(frozen=True)
class SyncEvent:
    """One counted call: its kind, the function name, and the caller's `file:line` outside torch."""

    kind: str
    name: str
    where: str


def _has_bool_tensor_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _masked_fill(index, value) -> bool:
    """`x[mask] = v` that torch turns into `masked_fill_` (one bool index, one value): no sync."""
    single = index if not isinstance(index, tuple) else (index[0] if len(index) == 1 else None)
    one_value = not isinstance(value, torch.Tensor) or (value.numel() == 1 and value.device.type == "cpu")
    return isinstance(single, torch.Tensor) and one_value


def _is_off_host(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"


def _to_host_target(args, kwargs) -> bool:
    """Does a `Tensor.to(...)` call target the CPU?"""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cpu"
    return False


def classify(name: str, args: tuple, kwargs: dict) -> str | None:
    """The sync kind of a call `name(*args, **kwargs)`, or None when it does not read values on the host."""
    if name in _ALWAYS:
        return _ALWAYS[name]
    if name == "where" and len(args) + len(kwargs) == 1:
        return "dynamic_shape"
    if name == "__getitem__" and len(args) > 1 and _has_bool_tensor_index(args[1]):
        return "dynamic_shape"
    if name == "__setitem__" and len(args) > 2 and _has_bool_tensor_index(args[1]) \
            and not _masked_fill(args[1], args[2]):
        return "dynamic_shape"
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        if "repeats" in kwargs or len(args) > 1:  # repeat_interleave(input, repeats, ...)
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        else:  # repeat_interleave(repeats): the repeats tensor is the only argument
            repeats = args[0] if args else None
        if isinstance(repeats, torch.Tensor):
            return "dynamic_shape"
    if name in _TO_HOST and args and _is_off_host(args[0]):
        return "to_host"
    if name == "to" and args and _is_off_host(args[0]) and _to_host_target(args, kwargs):
        return "to_host"
    return None


def _caller() -> str:
    """`file:line` of the innermost frame outside torch and this module (where the sync was asked for)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and path != _THIS_FILE:
            return f"{path.rsplit('/site-packages/', 1)[-1]}:{frame.lineno}"
    return "?"


class SyncCounter(TorchFunctionMode):
    """A `TorchFunctionMode` that counts host syncs by kind (see the module docstring for the list).

    Attributes:
        events: every counted call, in order, with where it came from.
    """

    def __init__(self):
        super().__init__()
        self.events: list[SyncEvent] = []
        self._excluded_depth = 0
        self._hooks: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._excluded_depth:
            name = getattr(func, "__name__", "")
            kind = classify(name, args, kwargs)
            if kind is not None:
                self.events.append(SyncEvent(kind, name, _caller()))
        return func(*args, **kwargs)

    def exclude(self, modules) -> "SyncCounter":
        """Count nothing while any of `modules` runs its forward (hooks removed by `remove_exclusions`)."""
        def enter(module, args):
            self._excluded_depth += 1

        def leave(module, args, output):
            self._excluded_depth -= 1

        for module in modules:
            self._hooks += [module.register_forward_pre_hook(enter),
                            module.register_forward_hook(leave, always_call=True)]
        return self

    def remove_exclusions(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def total(self) -> int:
        return len(self.events)

    @property
    def by_kind(self) -> dict[str, int]:
        counts = collections.Counter(event.kind for event in self.events)
        return {kind: counts[kind] for kind in KINDS if counts[kind]}

    def report(self) -> str:
        """One line per call site: `count x kind name at file:line`, most frequent first."""
        sites = collections.Counter((e.kind, e.name, e.where) for e in self.events)
        lines = [f"{n} x {kind} {name} at {where}" for (kind, name, where), n in sites.most_common()]
        return f"{self.total} host syncs" + ("".join(f"\n  {line}" for line in lines))


@contextmanager
def count_host_syncs(*, exclude=()) -> Iterator[SyncCounter]:
    """Count host syncs of everything run inside the block (this thread); see `SyncCounter`.

    Args:
        exclude: modules whose forward is not counted (see `SyncCounter.exclude`).
    """
    counter = SyncCounter().exclude(exclude)
    try:
        with counter:
            yield counter
    finally:
        counter.remove_exclusions()
