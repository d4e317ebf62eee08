"""MoE under packing: the router's load-balancing loss must not count pad slots.

`run_moe_aux_loss(rank, world_size)` is a `run_distributed` target. On a tiny MoE GPTModel
(EP = 1) it records the auxiliary loss Megatron-Core attaches in the router for the same real
tokens packed three ways: CP-aligned with pad slots and our padding mask, CP-aligned without the
mask, and packed with no padding at all (the truth).
"""

from __future__ import annotations

import contextlib

import torch

from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.testing.distributed import initialize_parallel
from megatron_vlm_packing.testing.parity import variable_batch

MOE = TinyGPTConfig(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1.0, num_layers=2)


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


def aux_loss(model, packed, *, with_padding_mask: bool) -> float:
    kwargs = {"padding_mask": packed.padding_mask} if with_padding_mask else {}
    with recorded_aux_losses() as values:
        model(packed.input_ids, packed.position_ids, None, labels=packed.labels.clamp_min(0),
              packed_seq_params=packed.packed_seq_params, **kwargs)
    if not values:
        raise RuntimeError("the router attached no auxiliary loss: is moe_aux_loss_coeff > 0 and training on?")
    return float(sum(v.sum() for v in values))


def run_moe_aux_loss(rank: int, world_size: int, seed: int = 5) -> dict:
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    model = build_tiny_gpt(MOE).train()
    batch = variable_batch([7, 3, 12, 5, 9], 12, vocab_size=MOE.vocab_size, seed=seed)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    tight = pack_batch(batch, label_style="hf")  # no pad slots at all
    padded = pack_batch(batch, cp_size=4, label_style="hf")  # documents padded to multiples of 8
    return dict(
        pad_slots=int(padded.padding_mask.sum()),
        no_padding=aux_loss(model, tight, with_padding_mask=True),
        padded_with_mask=aux_loss(model, padded, with_padding_mask=True),
        padded_without_mask=aux_loss(model, padded, with_padding_mask=False),
    )
