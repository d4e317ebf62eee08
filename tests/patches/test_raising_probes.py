"""A defect probe whose upstream function raises says so: a RuntimeError naming the function and the exception.

Never an answer. Read as "fixed upstream", a raising probe skips the patch and the adapters accept the layout
it protects (TP + SP with rank-partial deepstack gradients, a packed Omni micro-batch); read as "defect
present", it installs a patch over a function nobody has checked. Each probe is given an upstream that
raises, in its forward and (for the deepstack split, whose probe backpropagates) in its backward.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module
from megatron_vlm_packing.patches import bridge_deepstack_sp, bridge_qwen3_omni_packed, thd_rotary

_NO_BRIDGE = bridge_unavailable_reason()
needs_bridge = pytest.mark.skipif(_NO_BRIDGE is not None, reason=_NO_BRIDGE or "")
FAILED = r"defect probe got {kind}: .*{text}.* from .*{name}: .*never read as fixed.*nothing was applied"


class _NoGroupBackward(torch.autograd.Function):
    """Rows through unchanged; backward fails as a gathering split fails without a process group."""

    @staticmethod
    def forward(ctx, rows):
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("Default process group has not been initialized")


def _split_raising_in_forward(visual_pos_masks, deepstack_visual_embeds, **kwargs):
    raise AssertionError("visual_pos_masks.shape[-1] % split_size == 0")


def _split_raising_in_backward(visual_pos_masks, deepstack_visual_embeds, **kwargs):
    return visual_pos_masks, [_NoGroupBackward.apply(embeds) for embeds in deepstack_visual_embeds]


@pytest.mark.bridge
@needs_bridge
@pytest.mark.parametrize("split, kind, text", [
    (_split_raising_in_forward, "AssertionError", r"visual_pos_masks"),
    (_split_raising_in_backward, "ValueError", r"Default process group"),
], ids=["forward", "backward"])
def test_deepstack_probe_of_a_raising_split(monkeypatch, split, kind, text):
    bridge_deepstack_sp.undo_bridge_deepstack_sp()
    holders = [import_bridge_module(name) for name in bridge_deepstack_sp._HOLDERS]
    for module in holders:
        monkeypatch.setattr(module, "split_deepstack_embs", split)
    message = FAILED.format(kind=kind, text=text, name=split.__name__)
    with pytest.raises(RuntimeError, match=message):
        bridge_deepstack_sp.upstream_deepstack_split_is_plain_slice()
    with pytest.raises(RuntimeError, match=message):
        bridge_deepstack_sp.apply_bridge_deepstack_sp()
    assert not bridge_deepstack_sp._OWNED and all(m.split_deepstack_embs is split for m in holders)


def _thinker_refusing_by_signature(self, input_ids, position_ids=None):  # packed_seq_params: TypeError
    raise AssertionError("unreachable: the call binds no packed_seq_params")


def _thinker_refusing_otherwise(self, input_ids, position_ids=None, packed_seq_params=None, **kwargs):
    raise NotImplementedError("Qwen3-Omni inference is not implemented yet")


def _thinker_failing_on_its_input(self, input_ids, position_ids=None, packed_seq_params=None, **kwargs):
    raise ValueError(f"input_ids of {input_ids.shape[1]} tokens need position_ids")


@pytest.mark.bridge
@needs_bridge
@pytest.mark.parametrize("forward, kind, text", [
    (_thinker_refusing_by_signature, "TypeError", r"packed_seq_params"),
    (_thinker_refusing_otherwise, "NotImplementedError", r"inference"),
    (_thinker_failing_on_its_input, "ValueError", r"need position_ids"),
], ids=["signature", "other-not-implemented", "value"])
def test_omni_probe_of_a_raising_thinker(monkeypatch, forward, kind, text):
    """Only Bridge's packed refusal (NotImplementedError naming packing) reads as the defect, and only reaching
    the model's state past the guard (or returning) reads as fixed; any other failure is neither."""
    bridge_qwen3_omni_packed.undo_bridge_qwen3_omni_packed()
    cls = bridge_qwen3_omni_packed._thinker_class()
    monkeypatch.setattr(cls, "forward", forward)
    message = FAILED.format(kind=kind, text=text, name=forward.__name__)
    with pytest.raises(RuntimeError, match=message):
        bridge_qwen3_omni_packed.thinker_refuses_packing()
    with pytest.raises(RuntimeError, match=message):
        bridge_qwen3_omni_packed.apply_bridge_qwen3_omni_packed()
    assert not bridge_qwen3_omni_packed._OWNED and vars(cls)["forward"] is forward


@pytest.mark.bridge
@needs_bridge
def test_omni_probe_reads_a_thinker_that_reaches_its_state_past_the_guard_as_fixed(monkeypatch):
    def takes_packing(self, input_ids, position_ids=None, packed_seq_params=None, **kwargs):
        return self.pg_collection.cp.size()  # past any packing guard: the model's own state is read

    bridge_qwen3_omni_packed.undo_bridge_qwen3_omni_packed()
    cls = bridge_qwen3_omni_packed._thinker_class()
    monkeypatch.setattr(cls, "forward", takes_packing)
    assert not bridge_qwen3_omni_packed.thinker_refuses_packing()
    assert not bridge_qwen3_omni_packed.apply_bridge_qwen3_omni_packed() and vars(cls)["forward"] is takes_packing


def test_thd_rotary_probe_of_a_raising_rope(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    def raising_rope(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
                     cp_group=None):
        raise IndexError(f"cu_seqlens of {cu_seqlens.numel()} entries")

    thd_rotary.undo_thd_rotary()
    for module in (rope_utils, rotary_pos_embedding):
        monkeypatch.setattr(module, "_apply_rotary_pos_emb_thd", raising_rope)
    message = FAILED.format(kind="IndexError", text=r"cu_seqlens of 4 entries", name="raising_rope")
    with pytest.raises(RuntimeError, match=message):
        thd_rotary.upstream_thd_rope_syncs()
    with pytest.raises(RuntimeError, match=message):
        thd_rotary.apply_thd_rotary()
    assert not thd_rotary._OWNED and rope_utils._apply_rotary_pos_emb_thd is raising_rope


@pytest.mark.bridge
@needs_bridge
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_deepstack_probe_answers_under_the_callers_grad_mode(grad_mode):
    """An adapter built inside `torch.no_grad()` (an evaluation before training) asks the probe there: its
    backward found no graph, and that failure was read as fixed (TP + SP then accepted with rank-partial
    vision gradients). The probe records its own graph, whatever the caller's mode."""
    bridge_deepstack_sp.undo_bridge_deepstack_sp()
    assert bridge_deepstack_sp.upstream_deepstack_split_is_plain_slice()  # Bridge 0.6.2: the defect
    with grad_mode():
        assert bridge_deepstack_sp.upstream_deepstack_split_is_plain_slice()
        assert not torch.is_grad_enabled()


@pytest.mark.parametrize("read", ["upstream_scatters_standalone_embeddings", "upstream_scatters_mask_with_decoder_input"])
def test_gpt_model_probes_of_a_forward_without_source(monkeypatch, read):
    """The GPTModel checks read upstream's source: where there is none to read (a function built at run time,
    a build shipped without .py files), the check says so, not an OSError from inspect."""
    from megatron_vlm_packing.patches import gpt_model_forward

    namespace = {}
    exec("def forward(self, input_ids, position_ids, decoder_input=None, padding_mask=None):\n    pass", namespace)
    no_source = type("NoSourceGPTModel", (), {"forward": namespace["forward"], "_preprocess": namespace["forward"]})
    monkeypatch.setattr(gpt_model_forward, "_gpt_model", lambda: no_source)
    with pytest.raises(RuntimeError, match=FAILED.format(kind="OSError", text="could not get source code",
                                                         name="forward")):
        getattr(gpt_model_forward, read)()
