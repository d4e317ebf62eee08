"""Bridge's dense Qwen3-Omni thinker path cuts deepstack features per SP rank with the same plain
`split_deepstack_embs` as Qwen3-VL (bug class 12): under TP + SP its vision gradients are rank-partial.
The Omni adapter refuses dense micro-batches with images or videos there until
`apply_bridge_deepstack_sp()` covers the thinker, as the Qwen3-VL adapter does for Qwen3-VL."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason

_NO_BRIDGE = bridge_unavailable_reason()
pytestmark = [pytest.mark.bridge, pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")]


@pytest.fixture(scope="module")
def omni_model(single_process_megatron):
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, build_tiny_omni

    return build_tiny_omni(TinyOmniConfig(), seed=0)


def _adapter_under(model, *, tp: int, sp: bool):
    """The Omni adapter of `model` with its language config read as TP = `tp`, SP = `sp` (restored after)."""
    from megatron_vlm_packing.bridge.omni_adapter import Qwen3OmniAdapter

    config = model.thinker.config
    saved = config.tensor_model_parallel_size, config.sequence_parallel
    config.tensor_model_parallel_size, config.sequence_parallel = tp, sp
    try:
        return Qwen3OmniAdapter(model)
    finally:
        config.tensor_model_parallel_size, config.sequence_parallel = saved


def test_dense_vision_under_tp_and_sp_is_refused_until_the_thinker_split_is_patched(omni_model):
    from megatron_vlm_packing.packing.micro_batch import VisionInputs
    from megatron_vlm_packing.patches import bridge_deepstack_sp

    bridge_deepstack_sp.undo_bridge_deepstack_sp()
    dense = types.SimpleNamespace(is_packed=False, vision=VisionInputs(pixel_values=torch.zeros(4, 8)))
    adapter = _adapter_under(omni_model, tp=2, sp=True)
    with pytest.raises(ValueError, match=r"deepstack.*TP \+ SP.*apply_bridge_deepstack_sp\(\)"):
        adapter.check(dense)
    assert bridge_deepstack_sp.apply_bridge_deepstack_sp()
    try:
        with pytest.raises(Exception) as err:  # past the refusal: the namespace is no full micro-batch
            adapter.check(dense)
        assert "deepstack" not in str(err.value)
    finally:
        bridge_deepstack_sp.undo_bridge_deepstack_sp()
    for tp, sp in ((1, False), (2, False)):  # no SP cut: nothing to refuse
        with pytest.raises(Exception) as err:
            _adapter_under(omni_model, tp=tp, sp=sp).check(dense)
        assert "deepstack" not in str(err.value)
    with pytest.raises(Exception) as err:  # text only: no deepstack features to cut
        adapter.check(types.SimpleNamespace(is_packed=False, vision=None))
    assert "deepstack" not in str(err.value)


def test_packed_refusal_reads_the_packing_patch_when_asked_not_when_built(omni_model):
    """The adapter is built once per model; `apply_bridge_qwen3_omni_packed()` may come after it (a packed
    micro-batch then refused wrongly) and an undo after it (a packed micro-batch then let through to a thinker
    that refuses it, or to whatever replaced the patch). The check asks whether the patch runs now."""
    from megatron_vlm_packing.bridge.omni_adapter import Qwen3OmniAdapter
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed

    packed = types.SimpleNamespace(is_packed=True, vision=None)
    bridge_qwen3_omni_packed.undo_bridge_qwen3_omni_packed()
    built_before = Qwen3OmniAdapter(omni_model)
    with pytest.raises(ValueError, match=r"refuses packed_seq_params.*apply_bridge_qwen3_omni_packed\(\)"):
        built_before.check(packed)
    assert bridge_qwen3_omni_packed.apply_bridge_qwen3_omni_packed()
    try:
        with pytest.raises(Exception) as err:  # past the refusal: the namespace is no full micro-batch
            built_before.check(packed)
        assert "packed_seq_params" not in str(err.value)
        built_after = Qwen3OmniAdapter(omni_model)
    finally:
        bridge_qwen3_omni_packed.undo_bridge_qwen3_omni_packed()
    for adapter in (built_before, built_after):
        with pytest.raises(ValueError, match=r"refuses packed_seq_params"):
            adapter.check(packed)
