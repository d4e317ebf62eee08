"""The Qwen3-VL adapter refuses a layout whose Bridge defect is present and unpatched when it is built,
and again per micro-batch: the adapter is built once per model, and a patch undone after that (a test, an
evaluation, a plugin) must not leave it accepting TP + SP with rank-partial deepstack gradients (bug class
12), or packed CP without TE's partition kernel."""

from __future__ import annotations

import types

import pytest

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason

_NO_BRIDGE = bridge_unavailable_reason()
pytestmark = [pytest.mark.bridge, pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")]


@pytest.fixture(scope="module")
def qwen3_vl(single_process_megatron):
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, build_tiny_bridge_model

    return build_tiny_bridge_model(TinyBridgeConfig(family="qwen3_vl"), seed=0)


def _adapter_under(model, **layout):
    """The Qwen3-VL adapter of `model` with its language config read under `layout` (restored after)."""
    from megatron_vlm_packing.bridge.adapters import Qwen3VLAdapter

    saved = {name: getattr(model.config, name) for name in layout}
    for name, value in layout.items():
        setattr(model.config, name, value)
    try:
        return Qwen3VLAdapter(model)
    finally:
        for name, value in saved.items():
            setattr(model.config, name, value)


@pytest.mark.parametrize("patch, apply_name, layout", [
    ("bridge_deepstack_sp", "apply_bridge_deepstack_sp", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("bridge_thd_cp_index", "apply_bridge_thd_cp_index", dict(context_parallel_size=2)),
], ids=["deepstack", "thd_cp_index"])
def test_a_patch_undone_after_the_adapter_is_built_is_refused_per_micro_batch(qwen3_vl, patch, apply_name, layout):
    import importlib

    module = importlib.import_module(f"megatron_vlm_packing.patches.{patch}")
    apply, undo = getattr(module, apply_name), getattr(module, f"undo_{patch}")
    micro_batch = types.SimpleNamespace(is_packed=True, vision=None)  # refused before any field is read
    undo()
    with pytest.raises(ValueError, match=rf"{apply_name}\(\)"):
        _adapter_under(qwen3_vl, **layout)
    assert apply()
    try:
        adapter = _adapter_under(qwen3_vl, **layout)
        with pytest.raises(Exception) as err:  # past the refusal: the namespace is no full micro-batch
            adapter.check(micro_batch)
        assert apply_name not in str(err.value)
    finally:
        undo()
    with pytest.raises(ValueError, match=rf"{apply_name}\(\)"):
        adapter.check(micro_batch)
