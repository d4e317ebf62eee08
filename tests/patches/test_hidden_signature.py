"""A wrapping patch reads its arguments by name from the signature of what it wraps. An earlier plugin's
wrapper without functools.wraps hides them (`(*args, **kwargs)`): the patch would find no
`packed_seq_params` / `padding_mask` in any call and silently do nothing while reporting itself active
(LLaVA's boundaries never expanded, the adapter's check passing). Apply refuses that, naming them."""

from __future__ import annotations

import pytest

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module
from megatron_vlm_packing.patches import (
    bridge_qwen25_vl_cp, bridge_qwen3_omni_packed, gpt_model_forward, llava_boundaries,
)

_NO_BRIDGE = bridge_unavailable_reason()
needs_bridge = [pytest.mark.bridge, pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")]


def _gpt():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel


def _apply_gpt() -> bool:
    return gpt_model_forward.apply_sp_embedding_scatter() | gpt_model_forward.apply_sp_padding_mask_scatter()


def _undo_gpt() -> None:
    gpt_model_forward.undo_sp_padding_mask_scatter()
    gpt_model_forward.undo_sp_embedding_scatter()


CASES = [
    pytest.param(gpt_model_forward, _gpt, _apply_gpt, _undo_gpt, "padding_mask", id="gpt_model_forward"),
    pytest.param(llava_boundaries, llava_boundaries._llava, llava_boundaries.apply_llava_packed_boundaries,
                 llava_boundaries.undo_llava_packed_boundaries, "packed_seq_params", id="llava_boundaries"),
    pytest.param(bridge_qwen25_vl_cp, lambda: import_bridge_module(bridge_qwen25_vl_cp.QWEN25_VL_MODEL).Qwen25VLModel,
                 bridge_qwen25_vl_cp.apply_bridge_qwen25_vl_cp, bridge_qwen25_vl_cp.undo_bridge_qwen25_vl_cp,
                 "packed_seq_params", id="bridge_qwen25_vl_cp", marks=needs_bridge),
    pytest.param(bridge_qwen3_omni_packed, bridge_qwen3_omni_packed._thinker_class,
                 bridge_qwen3_omni_packed.apply_bridge_qwen3_omni_packed,
                 bridge_qwen3_omni_packed.undo_bridge_qwen3_omni_packed, "packed_seq_params", id="bridge_qwen3_omni",
                 marks=needs_bridge),
]


@pytest.mark.parametrize("patch, owner, apply, undo, hidden", CASES)
def test_apply_refuses_a_wrapper_that_hides_the_arguments_it_reads(patch, owner, apply, undo, hidden):
    cls = owner()
    undo()
    original = vars(cls)["forward"]

    def hiding_wrapper(*args, **kwargs):  # an earlier plugin's, without functools.wraps
        return original(*args, **kwargs)

    cls.forward = hiding_wrapper
    owned = patch._OWNED
    try:
        with pytest.raises(RuntimeError, match=rf"hiding_wrapper takes no .*{hidden}.*functools\.wraps"):
            apply()
        assert vars(cls)["forward"] is hiding_wrapper and not owned
    finally:
        cls.forward = original
        owned._set.clear()  # what a wrongly applied patch recorded over the hiding wrapper
        getattr(patch, "_APPLIED", []).clear()
    assert apply()  # the real signature: applies
    undo()
    assert vars(cls)["forward"] is original


def test_thd_rotary_refuses_a_wrapper_that_hides_the_rope_arguments():
    """The loop-free rope binds each call to the signature of what it replaces: hidden, every call would
    fail with a KeyError inside a layer's forward; apply says so instead."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_vlm_packing.patches import thd_rotary

    thd_rotary.undo_thd_rotary()
    original = rope_utils._apply_rotary_pos_emb_thd

    def hiding_wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    rope_utils._apply_rotary_pos_emb_thd = hiding_wrapper
    try:
        with pytest.raises(RuntimeError, match=r"hiding_wrapper takes no \['t', 'cu_seqlens', 'freqs'\]"):
            thd_rotary.apply_thd_rotary()
        assert rope_utils._apply_rotary_pos_emb_thd is hiding_wrapper and not thd_rotary._OWNED
    finally:
        rope_utils._apply_rotary_pos_emb_thd = original
        thd_rotary._OWNED._set.clear()  # what a wrongly applied patch recorded over the hiding wrapper
