"""Several patches applied as one: all of them, or none of those the call applied.

`apply_all` and `apply_bridge_patches` apply their patches in order. Where one raises (its target gone, its
defect probe failing on upstream's function, a later plugin holding its attribute), the patches applied before it
in the same call are undone, last first, and the error is raised as it came: half a set left on would run some
fixes and not the ones that go with them, with nothing but the error to say which. A patch that was already on
when the call began is left on: the caller (or an earlier call) applied it, and its undo is theirs to ask for.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence


class Patch(NamedTuple):
    """One patch of a set: `apply()` -> whether it is active; `undo()`; `applied()` -> whether it runs now."""

    name: str
    apply: Callable[[], bool]
    undo: Callable[[], None]
    applied: Callable[[], bool]


def apply_together(patches: Sequence[Patch]) -> dict[str, bool]:
    """Apply `patches` in order; returns {name: active}. All or nothing: see the module docstring.

    Raises:
        whatever a patch's apply raised, after undoing this call's patches (an undo that fails in turn is added
        to that error as a note, and the undoing goes on).
    """
    active, applied_here = {}, []
    for patch in patches:
        was_on = patch.applied()
        try:
            active[patch.name] = patch.apply()
        except BaseException as err:
            if not was_on and patch.applied():  # a patch that raised after installing itself goes too
                applied_here.append(patch)
            _undo_all_of(applied_here, err)
            raise
        if not was_on and patch.applied():
            applied_here.append(patch)
    return active


def _undo_all_of(applied_here: list[Patch], err: BaseException) -> None:
    """Undo `applied_here`, last first; an undo that raises is noted on `err` (the error the caller sees)."""
    for patch in reversed(applied_here):
        try:
            patch.undo()
        except Exception as undo_err:  # a later plugin wrapped it meanwhile: it stays on, and the caller is told
            err.add_note(f"{patch.name}, applied by this call, was not undone: {undo_err}")
