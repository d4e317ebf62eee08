"""Patch of `megatron.core.models.multimodal.llava_model.LLaVAModel.forward`: packed boundaries in
the expanded space.

`LLaVAModel._preprocess_data` expands each image token into `num_tiles * img_seq_len` embeddings
but `forward` passes `packed_seq_params` through unchanged (bug class 2), so attention runs with
collapsed-space boundaries on the expanded sequence and documents bleed into each other. The patch
remaps both boundary sets (`models.llava.remap_packed_seq_params`) before the original forward.
Feature check: upstream would have to hand `packed_seq_params` to `_preprocess_data` to fix it;
the patch applies only while it does not. Delete it once upstream remaps the boundaries itself.
"""

from __future__ import annotations

import functools
import inspect

_ORIGINAL: dict = {}


def _llava():
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    return LLaVAModel


def upstream_remaps_packed_boundaries() -> bool:
    return "packed_seq_params" in inspect.signature(_llava()._preprocess_data).parameters


def _shard_multiples(model) -> tuple[int, int]:
    """(segment, total) multiples LLaVA's own CP/SP sharding imposes on the expanded sequence."""
    cp, tp = model.context_parallel_lm, model.tensor_model_parallel_size_lm
    segment = 2 * cp if cp > 1 else 1
    total = tp * cp * 2 if cp > 1 and model.sequence_parallel_lm else segment if cp > 1 else (
        tp if model.sequence_parallel_lm else 1)
    return segment, total


def apply_llava_packed_boundaries() -> bool:
    """Remap packed boundaries inside LLaVAModel.forward. Idempotent; returns whether it is active."""
    if upstream_remaps_packed_boundaries():
        return False
    if "forward" in _ORIGINAL:
        return True
    from megatron_vlm_packing.models.llava import remap_packed_seq_params

    LLaVAModel = _llava()
    original = LLaVAModel.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        call = bound.arguments
        params = call.get("packed_seq_params")
        if params is not None and params.qkv_format == "thd" and self.pre_process and call.get("num_image_tiles") is not None:
            image_token = call.get("image_token_index") or self.image_token_index
            segment, total = _shard_multiples(self)
            call["packed_seq_params"] = remap_packed_seq_params(
                params, call["input_ids"], call["num_image_tiles"], img_seq_len=self.img_seq_len,
                image_token_index=image_token, segment_multiple=segment, total_multiple=total)
        return original(*bound.args, **bound.kwargs)

    _ORIGINAL["forward"] = original
    LLaVAModel.forward = forward
    return True


def undo_llava_packed_boundaries() -> None:
    if "forward" in _ORIGINAL:
        _llava().forward = _ORIGINAL.pop("forward")
