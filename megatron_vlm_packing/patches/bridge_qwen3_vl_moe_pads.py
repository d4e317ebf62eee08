"""Patch of Megatron-Bridge's Qwen3-VL language-model block (`Qwen3VLTransformerBlock.forward`, also the Qwen3-Omni
thinker's): the plan's padding mask reaches the MoE router.

Megatron-Core's `TransformerBlock.forward` takes `padding_mask` ([b, s] bool, True at pad slots) and hands it
to every layer, whose MoE router then leaves pad slots out of its load-balancing loss, its z-loss and its token
counts. Bridge 0.6.2's Qwen3-VL block overrides `forward` without it, so the pad slots of a pack (CP and SP
alignment, `pad_to` for static shapes, dense rows) are routed and counted, silently: on the tiny Qwen3-VL MoE the
router's aux loss for the same 83 real tokens is 258.2 packed without pad slots and 861.8 with 173 pad slots (an
MoE Qwen3-Omni thinker, 44 real tokens: 139.1 and 929.7 with 212; both at the tiny models' 3 language layers).

The wrapper takes `padding_mask` (laid out like the block's tokens on this rank: CP-local, then this TP rank's
SP chunk) and hands it to each of the block's layers for this call only (a forward pre-hook per layer, removed
when the call returns), where Megatron-Core's block would pass it. The adapter reaches it through Bridge's own
plumbing: `Qwen3VLModel.forward(extra_block_kwargs=...)` is spread into the language model's keywords, whose
own `extra_block_kwargs` go to the block (`bridge.adapters.Qwen3VLAdapter.forward`); the Omni thinker hands its
`extra_block_kwargs` to the language model as they are (`bridge.omni_adapter`). A call without the mask
runs Bridge's forward untouched.

Full activation recompute (`recompute_granularity="full"`) runs the layers again during backward, after this
call returned and its hooks are gone, so the recomputed routing would not see the mask: refused (ValueError).

Defect check (`upstream_block_drops_padding_mask`): the block's `forward` names no `padding_mask` (a block that
names it hands it on itself). Wraps, so a wrapper put on before ours keeps running; undo is stack-safe
(`owned.OwnedAttributes`). Delete once Bridge's block takes `padding_mask`.
"""

from __future__ import annotations

import functools
import inspect

from megatron_vlm_packing.bridge.imports import import_bridge_module
from megatron_vlm_packing.patches.owned import OwnedAttributes, patch_target

QWEN3_VL_BLOCK = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_block"
_OWNED = OwnedAttributes(__name__)  # Qwen3VLTransformerBlock.forward while the patch is applied


def _block_class():
    return import_bridge_module(QWEN3_VL_BLOCK).Qwen3VLTransformerBlock


def upstream_block_drops_padding_mask() -> bool:
    """Does Bridge's Qwen3-VL block forward name no `padding_mask` (so it cannot hand one to its layers)?"""
    forward = _OWNED.original("forward") or patch_target(_block_class(), "forward", __name__)
    return "padding_mask" not in inspect.signature(forward).parameters


def is_applied() -> bool:
    return _OWNED.active()


def refuse_full_recompute(config, pad_slots: int | None = None) -> None:
    """Full recompute runs the layers again in backward, where this call's hooks are gone.

    Raises:
        ValueError: `config.recompute_granularity` is "full" (naming it and the pad slots).
    """
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError(f"recompute_granularity='full' re-runs Bridge's Qwen3-VL MoE layers in backward without the "
                         f"padding mask, so the recomputed router would count the micro-batch's "
                         f"{'' if pad_slots is None else f'{pad_slots} '}pad slots; use selective recompute, or "
                         f"packs with no pad slots (pad_to=None, CP = 1, no SP)")


def _hand_to_layer(padding_mask, module, args, kwargs):
    """A layer's forward pre-hook: add this call's `padding_mask` (Bridge's block passes none)."""
    kwargs["padding_mask"] = padding_mask
    return args, kwargs


def _with_padding_mask(forward):
    @functools.wraps(forward)
    def block_forward(self, *args, padding_mask=None, **kwargs):
        if padding_mask is None:
            return forward(self, *args, **kwargs)
        if self.training:
            refuse_full_recompute(self.config)
        handles = [layer.register_forward_pre_hook(functools.partial(_hand_to_layer, padding_mask), with_kwargs=True)
                   for layer in self.layers]
        try:
            return forward(self, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()

    return block_forward


def apply_bridge_qwen3_vl_moe_pads() -> bool:
    """Let Bridge's Qwen3-VL block take `padding_mask` where it does not. Idempotent; returns whether the
    patch is active.

    Raises:
        RuntimeError: the block class or its forward is gone, or a later plugin holds the attribute.
    """
    if _OWNED.active():
        return True
    _OWNED.restore()  # records of a patch an earlier patch's undo removed: install again
    if not upstream_block_drops_padding_mask():
        return False
    cls = _block_class()
    _OWNED.set(cls, "forward", _with_padding_mask(patch_target(cls, "forward", __name__)))
    return True


def undo_bridge_qwen3_vl_moe_pads() -> None:
    """Restore Bridge's block forward. A no-op when not applied.

    Raises:
        RuntimeError: a later patch wraps it; nothing is restored.
    """
    _OWNED.restore()
