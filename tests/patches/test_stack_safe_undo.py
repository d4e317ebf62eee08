"""Every patch's undo is stack-safe (last in, first out), on the real Megatron-Core / Bridge attributes.

For each patch family: apply ours, let a "later plugin" wrap one of its attributes, and check that undo
refuses (RuntimeError naming the attribute and the wrapper) with nothing touched; then undo in LIFO
order (the plugin first, ours second) restores every original exactly. Plus apply/undo round trips.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module
from megatron_vlm_packing.patches import (
    apply_all, apply_bridge_patches, bridge_deepstack_sp, bridge_qwen25_vl_cp, bridge_qwen3_omni_packed,
    bridge_thd_cp_index, gpt_model_forward, llava_boundaries, thd_rotary, undo_all, undo_bridge_patches,
)
from megatron_vlm_packing.runtime import cpu_shims

_NO_BRIDGE = bridge_unavailable_reason()
needs_bridge = [pytest.mark.bridge, pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")]


@dataclasses.dataclass(frozen=True)
class Family:
    """One patch: apply / undo / applied, and the (owner, attribute) pairs it replaces."""

    name: str
    apply: Callable[[], bool]
    undo: Callable[[], None]
    applied: Callable[[], bool]
    targets: Callable[[], list[tuple[object, str]]]
    count: int  # len(targets()), known before importing anything
    marks: tuple = ()
    replaces: bool = False  # never calls what it replaces: refuses to apply over another plugin's wrapper


def _thd_holders():
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    return [(rope_utils, "_apply_rotary_pos_emb_thd"), (rotary_pos_embedding, "_apply_rotary_pos_emb_thd")]


def _gpt_forward():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return [(GPTModel, "forward")]


def _apply_gpt() -> bool:
    gpt_model_forward.apply_sp_embedding_scatter()  # active only where megatron-core lacks the fix
    return gpt_model_forward.apply_sp_padding_mask_scatter()


def _undo_gpt() -> None:
    gpt_model_forward.undo_sp_padding_mask_scatter()
    gpt_model_forward.undo_sp_embedding_scatter()


def _cpu_shim_targets():
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import torch_norm

    return [(torch.cuda, "current_device"), (torch.cuda, "synchronize"), (tp_random.CudaRNGStatesTracker, "add"),
            (torch_norm.WrappedTorchNorm, "__new__")]


def _apply_cpu_shims() -> bool:
    cpu_shims.apply_cpu_shims()
    return True


FAMILIES = [
    Family("thd_rotary", thd_rotary.apply_thd_rotary, thd_rotary.undo_thd_rotary, thd_rotary.thd_rotary_applied,
           _thd_holders, 2, replaces=True),
    Family("gpt_model_forward", _apply_gpt, _undo_gpt,
           lambda: bool(gpt_model_forward._APPLIED) and gpt_model_forward._OWNED.active(), _gpt_forward, 1),
    Family("llava_boundaries", llava_boundaries.apply_llava_packed_boundaries,
           llava_boundaries.undo_llava_packed_boundaries, llava_boundaries.packed_boundaries_expanded,
           lambda: [(llava_boundaries._llava(), "forward")], 1),
    Family("cpu_shims", _apply_cpu_shims, cpu_shims.undo_cpu_shims, cpu_shims.cpu_shims_applied, _cpu_shim_targets, 4),
    Family("bridge_deepstack_sp", bridge_deepstack_sp.apply_bridge_deepstack_sp,
           bridge_deepstack_sp.undo_bridge_deepstack_sp, bridge_deepstack_sp.is_applied,
           lambda: [(import_bridge_module(bridge_deepstack_sp.QWEN3_VL_MODEL), "split_deepstack_embs"),
                    # the Qwen3-Omni thinker imports the same split by name (its dense path under SP)
                    (import_bridge_module(bridge_qwen3_omni_packed.THINKER_MODULE), "split_deepstack_embs")], 2,
           needs_bridge),
    Family("bridge_thd_cp_index", bridge_thd_cp_index.apply_bridge_thd_cp_index,
           bridge_thd_cp_index.undo_bridge_thd_cp_index, bridge_thd_cp_index.is_applied,
           lambda: [(import_bridge_module(bridge_thd_cp_index.PACKED_SEQ_UTILS), "get_thd_cp_partition_indices")], 1,
           needs_bridge, replaces=True),
    Family("bridge_qwen25_vl_cp", bridge_qwen25_vl_cp.apply_bridge_qwen25_vl_cp,
           bridge_qwen25_vl_cp.undo_bridge_qwen25_vl_cp, bridge_qwen25_vl_cp.is_applied,
           lambda: [(import_bridge_module(bridge_qwen25_vl_cp.QWEN25_VL_MODEL).Qwen25VLModel, "forward")], 1,
           needs_bridge),
    Family("bridge_qwen3_omni_packed", bridge_qwen3_omni_packed.apply_bridge_qwen3_omni_packed,
           bridge_qwen3_omni_packed.undo_bridge_qwen3_omni_packed, bridge_qwen3_omni_packed.is_applied,
           lambda: [(bridge_qwen3_omni_packed._thinker_class(), "forward")], 1, needs_bridge),
]


def later_plugin(wrapped):
    """What another plugin does after us: wrap the attribute's current value (ours)."""

    @functools.wraps(wrapped)
    def foreign_wrapper(*args, **kwargs):
        return wrapped(*args, **kwargs)

    return foreign_wrapper


def held(targets) -> list:
    return [vars(owner)[name] for owner, name in targets]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def owner_name(owner) -> str:
    return getattr(owner, "__qualname__", None) or owner.__name__


def _cases():
    for family in FAMILIES:
        for position in range(family.count):
            yield pytest.param(family, position, id=f"{family.name}-{position}", marks=family.marks)


@pytest.mark.parametrize("family, position", list(_cases()))
def test_undo_refuses_under_a_later_wrapper_then_undoes_in_lifo_order(family, position):
    targets = family.targets()
    family.undo()  # whatever an earlier test left on
    originals = held(targets)
    assert family.apply()
    owner, name = targets[position]
    ours = held(targets)
    foreign = later_plugin(ours[position])
    try:
        assert all(p is not o for p, o in zip(ours, originals))
        setattr(owner, name, foreign)
        with pytest.raises(RuntimeError) as err:
            family.undo()
        message = str(err.value)
        assert f"{owner_name(owner)}.{name} now holds" in message
        assert "later_plugin.<locals>.foreign_wrapper" in message and "undo that later patch first" in message
        expected = [foreign if i == position else p for i, p in enumerate(ours)]
        assert same(held(targets), expected) and family.applied()  # nothing touched, ours still on
        assert family.apply() and same(held(targets), expected)  # apply stays idempotent
        setattr(owner, name, ours[position])  # LIFO: the later plugin undoes first ...
        family.undo()  # ... then ours
        assert same(held(targets), originals) and not family.applied()
        family.undo()  # not applied: a no-op
        assert same(held(targets), originals)
    finally:
        if vars(owner)[name] is foreign:
            setattr(owner, name, ours[position])
        family.undo()


@pytest.mark.parametrize("family", [pytest.param(f, id=f.name, marks=f.marks) for f in FAMILIES])
def test_apply_undo_round_trips(family):
    targets = family.targets()
    family.undo()
    originals = held(targets)
    try:
        for _ in range(2):
            assert family.apply() and family.apply()
            assert all(p is not o for p, o in zip(held(targets), originals)) and family.applied()
            family.undo()
            assert same(held(targets), originals) and not family.applied()
    finally:
        family.undo()


def test_cpu_shims_undo_refuses_inside_a_later_torch_function_mode():
    from torch.overrides import TorchFunctionMode

    class LaterMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cpu_shims.undo_cpu_shims()
    original = torch.cuda.current_device
    cpu_shims.apply_cpu_shims()
    try:
        with LaterMode():
            with pytest.raises(RuntimeError, match="innermost TorchFunctionMode is .*LaterMode, not its CudaToCpuMode"):
                cpu_shims.undo_cpu_shims()
            assert cpu_shims.cpu_shims_applied() and torch.zeros(1, device="cuda").device.type == "cpu"
        cpu_shims.undo_cpu_shims()  # the later mode exited first
        assert torch.cuda.current_device is original and not cpu_shims.cpu_shims_applied()
    finally:
        cpu_shims.undo_cpu_shims()


def test_undo_all_checks_every_patch_before_undoing_any():
    from megatron.core.models.common.embeddings import rope_utils

    targets = [*_gpt_forward(), (llava_boundaries._llava(), "forward"), *_thd_holders()]
    undo_all()
    originals = held(targets)
    active = apply_all()
    GPTModel = targets[0][0]
    ours = GPTModel.forward
    try:
        assert active["sp_padding_mask_scatter"] and active["llava_packed_boundaries"] and active["thd_rotary"]
        GPTModel.forward = foreign = later_plugin(ours)  # GPTModel.forward is undone last by undo_all
        with pytest.raises(RuntimeError, match="GPTModel.forward now holds"):
            undo_all()
        assert GPTModel.forward is foreign and thd_rotary.thd_rotary_applied()  # undone first: still on
        assert rope_utils._apply_rotary_pos_emb_thd is not originals[2] and llava_boundaries._OWNED
        GPTModel.forward = ours
        undo_all()
        assert same(held(targets), originals)
    finally:
        if GPTModel.forward is not ours and GPTModel.forward is not originals[0]:
            GPTModel.forward = ours
        undo_all()


@pytest.mark.bridge
@pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")
def test_undo_bridge_patches_checks_every_patch_before_undoing_any():
    module = import_bridge_module(bridge_deepstack_sp.QWEN3_VL_MODEL)
    targets = [(module, "split_deepstack_embs"),
               (import_bridge_module(bridge_thd_cp_index.PACKED_SEQ_UTILS), "get_thd_cp_partition_indices"),
               (import_bridge_module(bridge_qwen25_vl_cp.QWEN25_VL_MODEL).Qwen25VLModel, "forward")]
    undo_bridge_patches()
    originals = held(targets)
    assert all(apply_bridge_patches().values())
    ours = module.split_deepstack_embs
    try:
        module.split_deepstack_embs = foreign = later_plugin(ours)  # undone last by undo_bridge_patches
        with pytest.raises(RuntimeError, match=r"modelling_qwen3_vl\.model\.split_deepstack_embs now holds"):
            undo_bridge_patches()
        assert module.split_deepstack_embs is foreign and bridge_qwen25_vl_cp.is_applied()  # undone first: still on
        module.split_deepstack_embs = ours
        undo_bridge_patches()
        assert same(held(targets), originals)
    finally:
        if module.split_deepstack_embs is not originals[0]:
            module.split_deepstack_embs = ours
        undo_bridge_patches()


@pytest.mark.parametrize("family", [pytest.param(f, id=f.name, marks=f.marks) for f in FAMILIES
                                    if f.name != "cpu_shims"])  # runtime/, not a patches/ family
def test_an_earlier_patch_undone_after_ours_leaves_ours_off_and_apply_reinstalls(family):
    """`mock.patch.object` entered before ours and exited after puts the original back over ours: the patch
    must then read as off (an adapter relies on it), undo must not refuse the original, and apply must
    install again rather than answer True from its records. A replacing patch refuses to apply over another
    plugin's wrapper (tests/patches/test_replacing_patches.py): its earlier patch sets upstream's own function."""
    from unittest import mock

    targets = family.targets()
    family.undo()
    originals = held(targets)
    earlier = originals[0] if family.replaces else later_plugin(originals[0])
    try:
        with mock.patch.object(*targets[0], earlier):
            assert family.apply()
        assert same(held(targets)[:1], originals[:1]) and not family.applied()
        assert family.apply() and family.applied()
        assert all(p is not o for p, o in zip(held(targets), originals))  # installed again, every holder
        family.undo()
        assert same(held(targets), originals) and not family.applied()
    finally:
        family.undo()


@pytest.mark.parametrize("family", [pytest.param(f, id=f.name, marks=f.marks) for f in FAMILIES
                                    if f.name != "cpu_shims"])
def test_a_later_patch_that_replaces_ours_without_calling_it_leaves_ours_off(family):
    """Adapters (and the packed rotary, which hands CP-local tables only to our THD rope) ask whether the
    patch runs: a later replacement that does not wrap ours (no `__wrapped__` reaching it) means it does not."""
    targets = family.targets()
    family.undo()
    assert family.apply()
    owner, name = targets[0]
    ours = vars(owner)[name]
    try:
        setattr(owner, name, lambda *args, **kwargs: None)
        assert not family.applied()
        with pytest.raises(RuntimeError, match="undo that later patch first"):
            family.undo()
    finally:
        setattr(owner, name, ours)
        family.undo()
