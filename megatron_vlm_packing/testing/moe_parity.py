"""MoE under packing: the router's load-balancing loss must not count pad slots.

`run_moe_aux_loss(rank, world_size)` is a `run_distributed` target. On a tiny MoE GPTModel
(EP = 1) it records the auxiliary loss Megatron-Core attaches in the router for the same real
tokens packed three ways through the shipped step: padded to a fixed length with our padding
mask, padded without the mask, and packed with no padding at all (the truth).
`run_packed_vlm_moe_aux_loss(rank, world_size)` does the same for that MoE model as the language model of a
`PackedVLM` (which embeds and passes `decoder_input` and the mask itself).
`run_standalone_moe_sp(rank, world_size)` does the same at TP=2 + SP for a language model built with
`scatter_embedding_sequence_parallel=False` and called standalone, with only
`patches.apply_sp_embedding_scatter()` applied.
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


def run_packed_vlm_moe_aux_loss(rank: int, world_size: int, seed: int = 5) -> dict:
    """`run_moe_aux_loss` with the MoE model as a `PackedVLM`'s language model (text only): padded with our mask
    and with no padding at all, the router's aux loss for the same real tokens."""
    from megatron_vlm_packing.models.packed_vlm import PackedVLM

    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    model = PackedVLM(build_tiny_gpt(MOE, scatter_embedding_sequence_parallel=False)).train()
    lengths = [7, 3, 12, 5, 9]
    batch = variable_batch(lengths, 12, vocab_size=MOE.vocab_size, seed=seed)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    return dict(pad_slots=PAD_TO - sum(lengths), no_padding=aux_loss(model, batch, pad_to=None),
                padded_with_mask=aux_loss(model, batch, pad_to=PAD_TO))


def run_standalone_moe_sp(rank: int, world_size: int, seed: int = 5) -> dict:
    """The MoE model above built with `scatter_embedding_sequence_parallel=False` (a VLM's language model) and
    called standalone through the shipped step at TP=2 + SP (world size 2), with only
    `patches.apply_sp_embedding_scatter()` applied (what the GPTModel adapter asks for). Its padding mask must be
    scattered with the embeddings, as megatron-core does when it embeds for itself: per pack, the decoder's
    tokens and mask length, the loss sum and the router's aux loss summed over the TP group, with and without
    pad slots (and padded again with `apply_sp_padding_mask_scatter()` on too); and the TP=1 loss sum, the truth."""
    from dataclasses import replace

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.patches import gpt_model_forward as patch
    from megatron_vlm_packing.testing.parity_cases import load_sharded

    lengths = [7, 3, 12, 5, 9]
    batch = variable_batch(lengths, 12, vocab_size=MOE.vocab_size, seed=seed)
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    reference = build_tiny_gpt(MOE, scatter_embedding_sequence_parallel=False).train()
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    output, loss = make_forward_step()(iter([dict(batch)]), reference)
    result = dict(reference_loss=float(loss(output)[0]), pad_slots=PAD_TO - sum(lengths))
    initialize_parallel(tp=2, seed=seed)
    model = build_tiny_gpt(replace(MOE, tensor_parallel=2, sequence_parallel=True),
                           scatter_embedding_sequence_parallel=False).train()
    load_sharded(model, state, ps.get_tensor_model_parallel_rank(), 2)
    seen = {}

    def decoder_inputs(module, args, kwargs):
        mask = kwargs.get("padding_mask")
        seen.update(tokens=kwargs["hidden_states"].shape[0], mask=None if mask is None else mask.shape[-1])

    hook = model.decoder.register_forward_pre_hook(decoder_inputs, with_kwargs=True)
    patch.undo_sp_padding_mask_scatter()
    patch.apply_sp_embedding_scatter()
    try:
        for name, pad_to in (("no_padding", None), ("padded", PAD_TO), ("padded_with_both_patches", PAD_TO)):
            if name == "padded_with_both_patches":  # the mask fix must not scatter the mask a second time
                patch.apply_sp_padding_mask_scatter()
            try:
                with recorded_aux_losses() as values:
                    output, loss = make_forward_step(pad_to=pad_to)(iter([dict(batch)]), model)
                    loss_sum = float(loss(output)[0])
                aux = torch.stack([v.sum() for v in values]).sum().reshape(1)
                dist.all_reduce(aux, group=ps.get_tensor_model_parallel_group())
                result[name] = dict(loss=loss_sum, aux=float(aux), **seen)
            except Exception as err:  # the outcome is the point: the router's shape error before the fix
                result[name] = dict(error=f"{type(err).__name__}: {err}", **seen)
    finally:
        patch.undo_sp_padding_mask_scatter()
        patch.undo_sp_embedding_scatter()
        hook.remove()
    dist.barrier()
    return result
