"""Patches that replace an attribute (they never call what they replace) refuse one that is not upstream's own.

`thd_rotary` replaces `rope_utils._apply_rotary_pos_emb_thd` and `bridge_thd_cp_index` replaces Bridge's
`packed_seq_utils.get_thd_cp_partition_indices`. Applied over another plugin's wrapper they would drop it
silently while applied; apply raises RuntimeError naming the attribute and what holds it, nothing applied.
A wrapper installed after apply wraps ours: it keeps running, apply stays idempotent, undo refuses until it
is removed, and undo then restores upstream's own function exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module
from megatron_vlm_packing.patches import bridge_thd_cp_index, thd_rotary

_NO_BRIDGE = bridge_unavailable_reason()
needs_bridge = [pytest.mark.bridge, pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")]


@dataclasses.dataclass(frozen=True)
class Replacing:
    owner: Callable[[], object]
    name: str
    apply: Callable[[], bool]
    undo: Callable[[], None]
    applied: Callable[[], bool]


def _rope_utils():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


CASES = [
    pytest.param(Replacing(_rope_utils, "_apply_rotary_pos_emb_thd", thd_rotary.apply_thd_rotary,
                           thd_rotary.undo_thd_rotary, thd_rotary.thd_rotary_applied), id="thd_rotary"),
    pytest.param(Replacing(lambda: import_bridge_module(bridge_thd_cp_index.PACKED_SEQ_UTILS),
                           "get_thd_cp_partition_indices", bridge_thd_cp_index.apply_bridge_thd_cp_index,
                           bridge_thd_cp_index.undo_bridge_thd_cp_index, bridge_thd_cp_index.is_applied),
                 id="bridge_thd_cp_index", marks=needs_bridge),
]


def other_plugin(wrapped):
    @functools.wraps(wrapped)
    def other_plugins_wrapper(*args, **kwargs):
        return wrapped(*args, **kwargs)

    return other_plugins_wrapper


@pytest.mark.parametrize("case", CASES)
def test_apply_refuses_to_replace_another_plugins_wrapper(case):
    owner = case.owner()
    case.undo()
    upstream = getattr(owner, case.name)
    theirs = other_plugin(upstream)
    setattr(owner, case.name, theirs)
    try:
        with pytest.raises(RuntimeError, match=rf"\.{case.name} holds .*other_plugin\.<locals>\.other_plugins_wrapper"
                                               rf", not .*own {case.name}.*before the other plugin"):
            case.apply()
        assert getattr(owner, case.name) is theirs and not case.applied()
    finally:
        setattr(owner, case.name, upstream)
    assert case.apply() and getattr(owner, case.name) is not upstream  # upstream's own: replaced
    case.undo()
    assert getattr(owner, case.name) is upstream


@pytest.mark.parametrize("case", CASES)
def test_a_wrapper_installed_after_apply_keeps_running_and_undo_waits_for_it(case):
    owner = case.owner()
    case.undo()
    upstream = getattr(owner, case.name)
    assert case.apply()
    ours = getattr(owner, case.name)
    theirs = other_plugin(ours)
    setattr(owner, case.name, theirs)
    try:
        assert case.apply() and case.applied() and getattr(owner, case.name) is theirs
        with pytest.raises(RuntimeError, match=rf"\.{case.name} now holds .*other_plugins_wrapper"):
            case.undo()
        assert getattr(owner, case.name) is theirs
    finally:
        setattr(owner, case.name, ours)  # the other plugin undoes first
    case.undo()
    assert getattr(owner, case.name) is upstream and not case.applied()


def _defined_in(function, module: str):
    """`function`'s code, as if defined in `module` (its globals otherwise the same)."""
    import types

    moved = types.FunctionType(function.__code__, {**function.__globals__, "__name__": module}, function.__name__,
                               function.__defaults__, function.__closure__)
    moved.__kwdefaults__ = function.__kwdefaults__
    return moved


@pytest.mark.parametrize("module, accepted", [
    ("megatron.core.models.common.embeddings.rope_thd", True),  # moved between upstream's modules
    ("megatron.core_plugins.rope", False),  # a name that only starts like upstream's package
    ("other_plugin.rope", False),
])
def test_thd_rotary_takes_upstreams_function_from_any_of_its_modules(module, accepted):
    rope_utils = _rope_utils()
    thd_rotary.undo_thd_rotary()
    upstream = rope_utils._apply_rotary_pos_emb_thd
    rope_utils._apply_rotary_pos_emb_thd = installed = _defined_in(upstream, module)
    try:
        if accepted:
            assert thd_rotary.apply_thd_rotary() and rope_utils._apply_rotary_pos_emb_thd is not installed
            thd_rotary.undo_thd_rotary()
        else:
            with pytest.raises(RuntimeError, match=rf"holds {module}\._apply_rotary_pos_emb_thd, not megatron\.core's"):
                thd_rotary.apply_thd_rotary()
        assert rope_utils._apply_rotary_pos_emb_thd is installed and not thd_rotary.thd_rotary_applied()
    finally:
        thd_rotary.undo_thd_rotary()
        rope_utils._apply_rotary_pos_emb_thd = upstream
