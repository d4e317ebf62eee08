"""MoE under packing: the router's load-balancing loss must not count pad slots.

`run_moe_aux_loss(rank, world_size)` is a `run_distributed` target. On a tiny MoE GPTModel
(EP = 1) it records the auxiliary loss Megatron-Core attaches in the router for the same real
tokens packed three ways through the shipped step: padded to a fixed length with our padding
mask, padded without the mask, and packed with no padding at all (the truth).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_vlm_packing.models.gpt_adapter import GPTModelAdapter
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.step import make_forward_step
from megatron_vlm_packing.runtime.launcher import initialize_parallel
from megatron_vlm_packing.testing.parity import variable_batch

MOE = TinyGPTConfig(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1.0, num_layers=2)
PAD_TO = 64  # 36 real tokens: the pack's last document grows by 28 pad slots


@contextlib.contextmanager
def recorded_aux_losses():
    """Observe the aux losses the router attaches (the router module's MoEAuxLossAutoScaler)."""
    from megatron.core.transformer.moe import router

    original = router.MoEAuxLossAutoScaler
    values: list[torch.Tensor] = []

    class Recording(original):
        @classmethod
        def apply(cls, activation, aux_loss):
            values.append(aux_loss.detach().clone())
            return original.apply(activation, aux_loss)

    router.MoEAuxLossAutoScaler = Recording
    try:
        yield values
    finally:
        router.MoEAuxLossAutoScaler = original


class WithoutPaddingMaskAdapter(GPTModelAdapter):
    """The GPTModel adapter as if its forward took no padding mask (and without the refusal that
    brings): the path the mask fixes, measured on purpose."""

    def __init__(self, model):
        super().__init__(model)
        self.takes_padding_mask, self.is_moe = False, False


def aux_loss(model, batch: dict, *, pad_to: int | None, adapter=None) -> float:
    """The router's aux loss for one micro-batch through the shipped step."""
    step = make_forward_step(pad_to=pad_to, adapter=adapter)
    with recorded_aux_losses() as values:
        step(iter([batch]), model)
    if not values:
        raise RuntimeError("the router attached no auxiliary loss: is moe_aux_loss_coeff > 0 and training on?")
    return float(sum(v.sum() for v in values))


def run_moe_aux_loss(rank: int, world_size: int, seed: int = 5) -> dict:
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    model = build_tiny_gpt(MOE).train()
    lengths = [7, 3, 12, 5, 9]
    batch = variable_batch(lengths, 12, vocab_size=MOE.vocab_size, seed=seed)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    return dict(
        pad_slots=PAD_TO - sum(lengths),
        no_padding=aux_loss(model, batch, pad_to=None),  # no pad slots at all
        padded_with_mask=aux_loss(model, batch, pad_to=PAD_TO),
        padded_without_mask=aux_loss(model, batch, pad_to=PAD_TO, adapter=WithoutPaddingMaskAdapter),
    )
