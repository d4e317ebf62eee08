"""A patch whose target is gone (renamed or removed upstream) says so and applies nothing.

Neither an AttributeError from deep inside, nor a silent answer that the step would rely on: a defect
check reading "fixed" for a function it could not find, or an apply that sets a new attribute nobody
calls and reports itself active (the adapters then stop refusing the defective layout).
"""

from __future__ import annotations

import pytest

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module
from megatron_vlm_packing.patches import (
    bridge_deepstack_sp, bridge_qwen25_vl_cp, bridge_qwen3_omni_packed, bridge_thd_cp_index, llava_boundaries,
    thd_rotary,
)

_NO_BRIDGE = bridge_unavailable_reason()
needs_bridge = [pytest.mark.bridge, pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")]
GONE = r"does not exist here.*revise"


def test_thd_rotary_without_the_thd_rope_function(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    thd_rotary.undo_thd_rotary()
    monkeypatch.delattr(rope_utils, "_apply_rotary_pos_emb_thd")
    with pytest.raises(RuntimeError, match=r"rope_utils\._apply_rotary_pos_emb_thd " + GONE):
        thd_rotary.apply_thd_rotary()
    with pytest.raises(RuntimeError, match=GONE):
        thd_rotary.upstream_thd_rope_syncs()
    assert not thd_rotary._OWNED and not hasattr(rope_utils, "_apply_rotary_pos_emb_thd")


def test_llava_without_preprocess_data(monkeypatch):
    class RenamedLLaVA:
        def forward(self, *args, **kwargs):
            return None

    llava_boundaries.undo_llava_packed_boundaries()
    monkeypatch.setattr(llava_boundaries, "_llava", lambda: RenamedLLaVA)
    for ask in (llava_boundaries.apply_llava_packed_boundaries, llava_boundaries.packed_boundaries_expanded):
        with pytest.raises(RuntimeError, match=r"RenamedLLaVA\._preprocess_data " + GONE):
            ask()
    assert not llava_boundaries._OWNED and "forward" in vars(RenamedLLaVA)


@pytest.mark.parametrize("patch, module_name, name", [
    pytest.param(bridge_deepstack_sp.apply_bridge_deepstack_sp, bridge_deepstack_sp.QWEN3_VL_MODEL,
                 "split_deepstack_embs", id="deepstack", marks=needs_bridge),
    pytest.param(bridge_thd_cp_index.apply_bridge_thd_cp_index, bridge_thd_cp_index.PACKED_SEQ_UTILS,
                 "get_thd_cp_partition_indices", id="thd_cp_index", marks=needs_bridge),
    pytest.param(bridge_qwen25_vl_cp.apply_bridge_qwen25_vl_cp, bridge_qwen25_vl_cp.QWEN25_VL_MODEL,
                 "Qwen25VLModel", id="qwen25_vl_cp", marks=needs_bridge),
    pytest.param(bridge_qwen3_omni_packed.apply_bridge_qwen3_omni_packed, bridge_qwen3_omni_packed.THINKER_MODULE,
                 "Qwen3OmniThinkerModel", id="qwen3_omni", marks=needs_bridge),
])
def test_bridge_patch_without_its_target(monkeypatch, patch, module_name, name):
    import sys

    owned = sys.modules[patch.__module__]._OWNED
    owned.restore()
    module = import_bridge_module(module_name)
    monkeypatch.delattr(module, name)
    with pytest.raises(RuntimeError, match=rf"{module_name}\.{name} " + GONE):
        patch()
    assert not owned and not hasattr(module, name)


@pytest.mark.bridge
@pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")
def test_deepstack_defect_check_does_not_read_a_missing_split_as_fixed(monkeypatch):
    # the Qwen3-VL adapter accepts TP + SP with deepstack when this answers False
    bridge_deepstack_sp.undo_bridge_deepstack_sp()
    monkeypatch.delattr(import_bridge_module(bridge_deepstack_sp.QWEN3_VL_MODEL), "split_deepstack_embs")
    with pytest.raises(RuntimeError, match=GONE):
        bridge_deepstack_sp.upstream_deepstack_split_is_plain_slice()


@pytest.mark.bridge
@pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")
def test_deepstack_patch_covers_qwen3_vl_where_the_omni_thinker_cannot_import(monkeypatch):
    model = import_bridge_module(bridge_deepstack_sp.QWEN3_VL_MODEL)
    thinker = import_bridge_module(bridge_qwen3_omni_packed.THINKER_MODULE)
    bridge_deepstack_sp.undo_bridge_deepstack_sp()
    original = model.split_deepstack_embs

    def importing(name):
        if name == bridge_qwen3_omni_packed.THINKER_MODULE:
            raise ImportError("no Qwen3-Omni here")
        return import_bridge_module(name)

    monkeypatch.setattr(bridge_deepstack_sp, "import_bridge_module", importing)
    try:
        assert bridge_deepstack_sp.apply_bridge_deepstack_sp()
        assert model.split_deepstack_embs is not original and thinker.split_deepstack_embs is original
    finally:
        bridge_deepstack_sp.undo_bridge_deepstack_sp()
    assert model.split_deepstack_embs is original
