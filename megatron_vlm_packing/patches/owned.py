"""Attributes a patch owns: set with their originals kept, restored only while they are still ours.

A patch replaces attributes of Megatron's modules, classes and objects (`GPTModel.forward`, a function
copied by name into several modules, a function's `__defaults__`). Another plugin may wrap the same
attribute after us, and its wrapper calls ours. Undo is therefore stack-safe (last in, first out): an
attribute is restored only while it still holds our replacement. Where something else holds it now,
undo raises RuntimeError naming the attribute and what holds it, and changes nothing: every attribute
is checked before any is restored, so a patch stays wholly applied or is wholly undone.

A patch applied before ours and undone after it (`unittest.mock.patch.object`, most plugins: they put
back what they saved) removes ours and our recorded original with it: the attribute then holds our original
or what it wraps (`__wrapped__`). That is no conflict, and undo leaves it as it is (putting our original
back would reinstall the earlier patch that was undone). `active()` says whether our replacement still
runs (it, or a wrapper of it, is held): adapters rely on that, not on the records, and apply installs again
where it does not.

    owned = OwnedAttributes("megatron_vlm_packing.patches.thd_rotary")
    owned.set(rope_utils, "_apply_rotary_pos_emb_thd", replacement)
    owned.restore()  # RuntimeError while a later wrapper holds rope_utils._apply_rotary_pos_emb_thd

RuntimeError, not ValueError: no argument is wrong, the process's state (a later patch) forbids it.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Mapping

_ABSENT = object()  # the owner had no attribute of its own: restoring deletes ours
_TORCH_REGISTRIES = ("_modules", "_parameters", "_buffers")  # where nn.Module.__setattr__ puts them


@dataclasses.dataclass(frozen=True, slots=True)
class _Set:
    owner: object
    name: str
    original: object  # the owner's own value before, or _ABSENT
    replacement: object
    before: object  # what looking the name up on the owner gave before (an inherited method included), or _ABSENT


def own_value(owner, name: str):
    """What `owner` itself holds under `name`, or `_ABSENT`.

    A module's, class's or object's own `__dict__` entry (a `torch.nn.Module`'s submodule, parameter or
    buffer counts as its own: `model.rotary_pos_emb`); an attribute a class only inherits (or an
    object only gets from its class) counts as absent, so restoring deletes ours and lookups fall back
    as before. A data descriptor's value (a function's `__defaults__`) is read with getattr.
    """
    own = getattr(owner, "__dict__", None)
    if isinstance(own, Mapping) and name in own:
        return own[name]
    for registry in _TORCH_REGISTRIES:  # a torch.nn.Module keeps submodules, parameters, buffers apart
        held = own.get(registry) if isinstance(own, Mapping) and not isinstance(owner, type) else None
        if isinstance(held, Mapping) and name in held:
            return held[name]
    if isinstance(owner, type) or (own is not None and not _is_data_descriptor(type(owner), name)):
        return _ABSENT
    return getattr(owner, name, _ABSENT)


def _is_data_descriptor(cls: type, name: str) -> bool:
    slot = next((vars(base)[name] for base in cls.__mro__ if name in vars(base)), None)
    return hasattr(type(slot), "__set__")


def patch_target(owner, name: str, patch: str):
    """`owner.name`, the attribute `patch` replaces or reads to detect its defect.

    Raises:
        RuntimeError: the owner has no such attribute (renamed or removed upstream): the patch cannot tell
            whether the defect is there, and setting the name would install a function nobody calls.
    """
    value = getattr(owner, name, _ABSENT)
    if value is _ABSENT:
        raise RuntimeError(f"{describe_attribute(owner, name)} does not exist here: {patch} was written for it; "
                           f"revise the patch for this version (nothing was applied)")
    return value


def signature_naming(function, names: tuple[str, ...], patch: str) -> inspect.Signature:
    """The signature of `function` (through functools.wraps), which a wrapping patch binds each call to.

    Raises:
        RuntimeError: it does not name every one of `names`: an earlier wrapper without functools.wraps
            (`(*args, **kwargs)`) hides them, and the patch would find none in any call and do nothing.
    """
    signature = inspect.signature(function)
    missing = [name for name in names if name not in signature.parameters]
    if missing:
        raise RuntimeError(f"{describe_value(function)} takes no {missing} by name, which {patch} reads from "
                           f"each call: a wrapper installed before ours hides them; give it functools.wraps, "
                           f"or apply ours first (nothing was applied)")
    return signature


def upstream_own(owner, name: str, package: str, patch: str):
    """`owner.name`, checked to be upstream's own function: named `name` and defined in a module of `package`
    ("megatron.core", "megatron.bridge"; a move between its modules is no foreign code), for a patch that
    replaces it: the replacement never calls what it replaces.

    Raises:
        RuntimeError: it holds something else (another plugin's wrapper or replacement, named): replacing it
            would silently drop that plugin's code while ours is applied; nothing is replaced.
    """
    held = patch_target(owner, name, patch)
    defined_in = getattr(held, "__globals__", {}).get("__name__") or ""
    if getattr(getattr(held, "__code__", None), "co_name", None) == name \
            and (defined_in == package or defined_in.startswith(package + ".")):
        return held
    raise RuntimeError(f"{describe_attribute(owner, name)} holds {describe_value(held)}, not {package}'s own {name}: "
                       f"{patch} replaces it (it never calls what it replaces), which would silently drop that "
                       f"code while ours is applied; apply {patch} before the other plugin patches it (their "
                       f"wrapper then wraps ours), or remove theirs (nothing was applied)")


def probe_failure(function, error: Exception, patch: str) -> RuntimeError:
    """The error for a defect probe that failed with `error` on `function` (the upstream one it runs, or
    whose source it reads).

    A failure is neither answer. Read as "fixed upstream" it would skip the patch, and the adapters that ask
    would accept the layout it protects; read as "defect present" it would install a patch over a function
    nobody checked. Raise it `from error`.
    """
    return RuntimeError(f"{patch}'s defect probe got {type(error).__name__}: {error} from "
                        f"{describe_value(function)}: this version behaves in a way the patch does not know, so "
                        f"whether the defect is there cannot be told (a failure is never read as fixed); revise "
                        f"the patch for this version (nothing was applied)")


def describe_attribute(owner, name: str) -> str:
    """`module.Class.name` (or `module.name`, or `a module.Class object's name`) for messages."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    if hasattr(owner, "__qualname__"):  # a class or a function
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"a {type(owner).__module__}.{type(owner).__qualname__} object's {name}"


def describe_value(value) -> str:
    """The qualname of what an attribute holds: where a function was defined (functools.wraps copies
    the wrapped function's names, its code keeps its own), else the module and qualname it reports."""
    if value is _ABSENT:
        return "nothing (the attribute was deleted)"
    func = getattr(value, "__func__", value)  # staticmethod, classmethod, bound method
    code, module = getattr(func, "__code__", None), getattr(func, "__globals__", {}).get("__name__")
    if code is not None and module is not None:
        return f"{module}.{code.co_qualname}"
    if hasattr(func, "__qualname__"):
        return f"{getattr(func, '__module__', None) or '?'}.{func.__qualname__}"
    if "_modules" in getattr(value, "__dict__", {}):  # a torch.nn.Module (a multi-line repr): its class
        return f"a {type(value).__module__}.{type(value).__qualname__}"
    return repr(value)


class OwnedAttributes:
    """The attributes one patch replaced, restored together and only while they are all still ours."""

    def __init__(self, patch: str):
        self.patch = patch  # named in errors, e.g. "megatron_vlm_packing.patches.thd_rotary"
        self._set: list[_Set] = []

    def __bool__(self) -> bool:
        return bool(self._set)

    def set(self, owner, name: str, replacement) -> None:
        """`owner.name = replacement`, keeping the owner's own value (or its absence) for `restore`."""
        self._set.append(_Set(owner, name, own_value(owner, name), replacement, getattr(owner, name, _ABSENT)))
        setattr(owner, name, replacement)

    def original(self, name: str):
        """What `owner.name` gave before this patch first replaced `name` (the callable a patch wraps and
        calls: a method the owner only inherits included), or None while nothing is set under `name` or when
        the owner had no such attribute. Matched by name alone: the first owner set under `name`."""
        before = next((s.before for s in self._set if s.name == name), None)
        return None if before is _ABSENT else before

    def active(self) -> bool:
        """Something is set and every attribute holds our replacement or a wrapper of it (`__wrapped__`):
        False once any holds something that does not run ours (an earlier patch's undo put its original
        back over ours, or a later patch replaced ours)."""
        return bool(self._set) and all(_wraps(own_value(s.owner, s.name), s.replacement) for s in self._set)

    def conflicts(self) -> list[str]:
        """One line per attribute that holds something other than our replacement that an undo would clobber
        (something patched it after us); not one that holds our original or what it wraps (undone under us)."""
        return [f"{describe_attribute(s.owner, s.name)} now holds {describe_value(held)}, not {self.patch}'s "
                f"replacement" for s in self._set
                if (held := own_value(s.owner, s.name)) is not s.replacement and not _undone_under_us(s)]

    def check(self) -> None:
        """RuntimeError when `restore` would clobber a later patch; see `check_restorable`."""
        check_restorable(self)

    def restore(self) -> None:
        """Put every original back (latest first) and forget them. A no-op when nothing is set.

        Raises:
            RuntimeError: an attribute holds something other than our replacement or its original;
                nothing is restored.
        """
        self.check()
        for s in reversed(self._set):
            if _undone_under_us(s):
                continue  # an earlier patch's undo already put back what was there before it
            if s.original is _ABSENT:
                delattr(s.owner, s.name)
            else:
                setattr(s.owner, s.name, s.original)
        self._set.clear()


def _wraps(value, target, *, depth: int = 64) -> bool:
    """`value` is `target` or wraps it: `target` is on its `__wrapped__` chain (functools.wraps)."""
    for _ in range(depth):  # bounded: a chain may loop
        if value is target:
            return True
        value = getattr(value, "__wrapped__", None)
        if value is None:
            return False
    return False


def _undone_under_us(record: _Set) -> bool:
    """The attribute holds what it held before the patch, or what that wrapped (an earlier patch's undo put
    its own original back over ours). An attribute absent before and deleted now stays a conflict."""
    if record.original is _ABSENT or (held := own_value(record.owner, record.name)) is _ABSENT:
        return False
    return held is not record.replacement and _wraps(record.original, held)


def check_restorable(*owned: OwnedAttributes) -> None:
    """RuntimeError, naming each attribute and what holds it, unless every attribute of every `owned`
    still holds its patch's replacement (or, undone under us, its original again). Lets an undo of several
    patches check all before undoing any."""
    lines = [line for attributes in owned for line in attributes.conflicts()]
    if lines:
        patches = ", ".join(dict.fromkeys(a.patch for a in owned if a.conflicts()))
        raise RuntimeError(f"cannot undo {patches}: " + "; ".join(lines) + ". Something patched these after us: "
                           "undo that later patch first (patches are undone in the reverse order of "
                           "application). Nothing was undone.")
