"""`apply_all()` and `apply_bridge_patches()` are all-or-nothing: where a later patch's probe or replacement raises,
the patches this call applied are undone and the same error is raised. Patches applied before the call stay as
they were. Before, the earlier patches of the failed call stayed applied (half of `apply_all` on: the LLaVA
boundaries and the SP padding-mask scatter installed, the THD rope not) while the caller saw only the error."""

from __future__ import annotations

import pytest

from megatron_vlm_packing import patches
from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module
from megatron_vlm_packing.patches import (
    bridge_deepstack_sp, bridge_qwen25_vl_cp, bridge_thd_cp_index, gpt_model_forward, llava_boundaries, thd_rotary,
)

_NO_BRIDGE = bridge_unavailable_reason()
FAILED_PROBE = r"defect probe got IndexError: .*cu_seqlens of 4 entries.* from .*raising_rope"


def _raising_rope(monkeypatch):
    """Upstream's THD rope made to raise, so `apply_thd_rotary` (last of `apply_all`) fails in its probe."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    def raising_rope(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                     cp_group=None):
        raise IndexError(f"cu_seqlens of {cu_seqlens.numel()} entries")

    for module in (rope_utils, rotary_pos_embedding):
        monkeypatch.setattr(module, "_apply_rotary_pos_emb_thd", raising_rope)


def _core_held() -> dict:
    """What each attribute `apply_all` replaces holds now, and which GPTModel fixes are switched on."""
    gpt, llava = gpt_model_forward._gpt_model(), llava_boundaries._llava()
    return {"GPTModel.forward": vars(gpt)["forward"], "LLaVAModel.forward": vars(llava)["forward"],
            "fixes": list(gpt_model_forward._APPLIED)}


@pytest.fixture
def core_undone():
    patches.undo_all()
    yield
    patches.undo_all()


def test_a_failing_apply_all_leaves_nothing_of_the_call_applied(monkeypatch, core_undone):
    before = _core_held()
    _raising_rope(monkeypatch)
    with pytest.raises(RuntimeError, match=FAILED_PROBE):
        patches.apply_all()
    assert _core_held() == before and before["fixes"] == []
    assert not llava_boundaries._OWNED.active() and not thd_rotary.thd_rotary_applied()
    assert not gpt_model_forward._OWNED.active()


def test_a_failing_apply_all_keeps_the_patches_applied_before_it(monkeypatch, core_undone):
    assert patches.apply_llava_packed_boundaries()
    embedding = patches.apply_sp_embedding_scatter()  # False where megatron-core scatters itself (0.19)
    before = _core_held()
    _raising_rope(monkeypatch)
    with pytest.raises(RuntimeError, match=FAILED_PROBE):
        patches.apply_all()
    after = _core_held()
    assert after == before and after["fixes"] == (["embedding"] if embedding else [])
    assert llava_boundaries._OWNED.active() and gpt_model_forward.embedding_scatter_applied() == embedding
    assert not gpt_model_forward.padding_mask_scatter_applied()  # this call's, undone


def test_apply_all_after_a_failed_call_applies_everything(monkeypatch, core_undone):
    with monkeypatch.context() as broken:
        _raising_rope(broken)
        with pytest.raises(RuntimeError):
            patches.apply_all()
    active = patches.apply_all()
    assert active["sp_padding_mask_scatter"] and active["llava_packed_boundaries"] and active["thd_rotary"]
    assert gpt_model_forward.padding_mask_scatter_applied() and thd_rotary.thd_rotary_applied()


def _bridge_held() -> dict:
    deepstack = import_bridge_module(bridge_deepstack_sp.QWEN3_VL_MODEL)
    utils = import_bridge_module(bridge_thd_cp_index.PACKED_SEQ_UTILS)
    return {"split_deepstack_embs": deepstack.split_deepstack_embs,
            "get_thd_cp_partition_indices": utils.get_thd_cp_partition_indices}


@pytest.fixture
def bridge_undone():
    patches.undo_bridge_patches()
    yield
    patches.undo_bridge_patches()


@pytest.mark.bridge
@pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")
@pytest.mark.parametrize("deepstack_before", [False, True], ids=["nothing-before", "deepstack-before"])
def test_a_failing_apply_bridge_patches_undoes_only_its_own(monkeypatch, bridge_undone, deepstack_before):
    """Qwen2.5-VL's model class gone (third of the four): the deepstack split and the THD CP index, applied
    by the call before it, are undone; a deepstack split applied before the call stays."""
    if deepstack_before:
        assert patches.apply_bridge_deepstack_sp()
    before = _bridge_held()
    monkeypatch.delattr(import_bridge_module(bridge_qwen25_vl_cp.QWEN25_VL_MODEL), "Qwen25VLModel")
    with pytest.raises(RuntimeError, match=r"Qwen25VLModel does not exist here.*revise"):
        patches.apply_bridge_patches()
    assert _bridge_held() == before
    assert bridge_deepstack_sp.is_applied() == deepstack_before and not bridge_thd_cp_index.is_applied()
    assert not bridge_qwen25_vl_cp.is_applied()
