"""The Qwen3-Omni packed patch detects the defect, applies once, undoes exactly; the adapter is registered."""

import pytest

pytestmark = pytest.mark.bridge


def test_patch_detects_the_defect_and_is_idempotent_and_reversible():
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    cls = patch._thinker_class()
    original = cls.forward
    assert patch.thinker_refuses_packing()  # Bridge 0.6.2: NotImplementedError for packed_seq_params
    try:
        assert patch.apply_bridge_qwen3_omni_packed()
        patched = cls.forward
        assert patch.apply_bridge_qwen3_omni_packed() and cls.forward is patched  # idempotent
        assert patched is not original
        assert patch.thinker_refuses_packing()  # still judged on the original forward
    finally:
        patch.undo_bridge_qwen3_omni_packed()
        patch.undo_bridge_qwen3_omni_packed()
    assert cls.forward is original and not patch.is_applied()


def test_patch_leaves_a_thinker_that_takes_packing_alone():
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    cls = patch._thinker_class()
    original = cls.forward

    def takes_packing(self, input_ids, packed_seq_params=None, **kwargs):
        return input_ids

    cls.forward = takes_packing
    try:
        assert not patch.thinker_refuses_packing(takes_packing)
        assert not patch.apply_bridge_qwen3_omni_packed() and cls.forward is takes_packing
    finally:
        cls.forward = original


def test_adapter_is_registered_for_model_and_thinker():
    from megatron_vlm_packing.models import adapter

    for name in ("megatron.bridge.models.qwen_omni.modeling_qwen3_omni.model.Qwen3OmniModel",
                 "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model.Qwen3OmniThinkerModel"):
        assert adapter._BUILTIN[name] == "megatron_vlm_packing.bridge.omni_adapter:Qwen3OmniAdapter"
    from megatron_vlm_packing.bridge.omni_adapter import Qwen3OmniAdapter

    assert Qwen3OmniAdapter.consumes == {"images", "videos", "audio"}
    assert Qwen3OmniAdapter.needs.full_input_ids and Qwen3OmniAdapter.needs.full_position_ids
