"""Patch of Megatron-Bridge's `Qwen25VLModel.forward`: context-parallel token selection.

Bridge 0.6.2's Qwen2.5-VL merges vision embeddings into the full packed sequence and hands the
language model that full-length `decoder_input` whatever the CP size: every CP rank would run all
tokens while attention and the loss expect this rank's T/cp. The patch lets Bridge's own forward
do everything it does (embedding, vision merge, its own per-sample mRoPE positions), takes the
language-model call it was about to make, selects this rank's tokens of `decoder_input` with the
one CP index (TE's rule, `parallel.cp.cp_partition_index`), scatters them over TP under SP (the
scatter Bridge would have done on the full sequence, moved after the CP selection, contract item
6), and calls the language model with full [3, 1, T] positions. The language model's rotary must
take full positions under THD + CP: `rope.use_packed_mrope(model.language_model)`, which the
Qwen2.5-VL adapter installs when CP > 1.

Defect check, per call: under packed THD with CP > 1, the `decoder_input` Bridge hands over is
still full length. Where it is already T/cp (an upstream that selects), the call passes through
unchanged; CP = 1 and dense calls go straight to Bridge's forward.
Delete once Bridge selects CP tokens in Qwen25VLModel.forward.
"""

from __future__ import annotations

import functools

from megatron_vlm_packing.bridge.imports import import_bridge_module
from megatron_vlm_packing.patches.owned import OwnedAttributes, patch_target, signature_naming

QWEN25_VL_MODEL = "megatron.bridge.models.qwen_vl.modeling_qwen25_vl"
_OWNED = OwnedAttributes(__name__)  # Bridge's Qwen25VLModel.forward while the patch is applied


class _LanguageModelCall:
    """Stands in for `language_model.forward` during Bridge's forward: records the keywords."""

    def __init__(self):
        self.kwargs = None

    def __call__(self, **kwargs):
        self.kwargs = kwargs
        return self


def _cp_group(model):
    collection = getattr(model.config, "_pg_collection", None)
    if collection is not None:
        return collection.cp
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _bridge_call_without_lm(original, model, args, kwargs) -> dict:
    """Run Bridge's forward up to its language-model call, without its SP scatter; its keywords."""
    recorder, sequence_parallel = _LanguageModelCall(), model.config.sequence_parallel
    # A forward already set on the instance (a user's or a wrapper's) is put back after, not deleted.
    own_forward = vars(model.language_model).get("forward", _LanguageModelCall)
    model.language_model.forward = recorder  # instance attribute: Bridge calls language_model.forward(...)
    model.config.sequence_parallel = False  # keep the merged embeddings full: CP selection comes first
    try:
        returned = original(model, *args, **kwargs)
    finally:
        if own_forward is _LanguageModelCall:
            del model.language_model.forward
        else:
            model.language_model.forward = own_forward
        model.config.sequence_parallel = sequence_parallel
    if returned is not recorder or recorder.kwargs is None:
        raise RuntimeError("Qwen25VLModel.forward no longer ends in language_model.forward(...): "
                           "patches.bridge_qwen25_vl_cp must be revised for this Bridge version")
    return recorder.kwargs


def _select_this_rank(model, lm_kwargs: dict, cp_size: int, cp_rank: int) -> dict:
    """decoder_input [T, B, H] -> this CP rank's [T/cp, B, H] (then the SP scatter); positions stay full."""
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    from megatron_vlm_packing.parallel.cp import cp_partition_index

    embeds, params = lm_kwargs.get("decoder_input"), lm_kwargs["packed_seq_params"]
    if embeds is not None:
        total = int(params.cu_seqlens_q_padded[-1])
        if embeds.shape[0] == total:  # the defect: still full length
            embeds = embeds.index_select(0, cp_partition_index(params.cu_seqlens_q_padded.to(embeds.device),
                                                               cp_size, cp_rank))
        if model.config.sequence_parallel:
            embeds = scatter_to_sequence_parallel_region(embeds, group=model.config._pg_collection.tp)
        lm_kwargs = dict(lm_kwargs, decoder_input=embeds)
    return lm_kwargs


def apply_bridge_qwen25_vl_cp() -> bool:
    """Make Qwen25VLModel.forward select CP tokens. Idempotent; returns whether the patch is active."""
    if _OWNED.active():
        return True
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    cls = patch_target(import_bridge_module(QWEN25_VL_MODEL), "Qwen25VLModel", __name__)
    original = cls.forward
    signature = signature_naming(original, ("packed_seq_params",), __name__)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        params = signature.bind_partial(self, *args, **kwargs).arguments.get("packed_seq_params")
        group = _cp_group(self)
        if params is None or params.qkv_format != "thd" or group.size() == 1:
            return original(self, *args, **kwargs)
        lm_kwargs = _bridge_call_without_lm(original, self, args, kwargs)
        return self.language_model(**_select_this_rank(self, lm_kwargs, group.size(), group.rank()))

    _OWNED.set(cls, "forward", forward)
    return True


def is_applied() -> bool:
    return _OWNED.active()


def undo_bridge_qwen25_vl_cp() -> None:
    """Restore Qwen25VLModel.forward. A no-op when not applied.

    Raises:
        RuntimeError: a later patch wraps Qwen25VLModel.forward; nothing is restored.
    """
    _OWNED.restore()
