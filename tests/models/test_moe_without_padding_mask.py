"""A mixture-of-experts language model whose forward takes no `padding_mask` (a user's GPTModel subclass) is refused
for a micro-batch with pad slots, inside `PackedVLM` as alone.

Only the router reads the padding mask: without it the pad slots count in its load-balancing loss. `PackedVLM`
passed the mask only where its language model's forward names it and dropped it silently otherwise: the router's
aux loss for the same real tokens was 129.7 with 28 pad slots for 73.7 without (the GPT adapter refused it, but the
refusal had no test). Without pad slots, and for a dense model, nothing reads the mask and the model runs. Real
Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.models.gpt import GPTModel


class NoPaddingMaskGPT(GPTModel):
    """A user's subclass whose forward predates megatron-core's `padding_mask` keyword."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                packed_seq_params=None):
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                               packed_seq_params=packed_seq_params)


def _language_model(config) -> GPTModel:
    from megatron_vlm_packing.models.tiny_gpt import build_tiny_gpt

    torch.manual_seed(5)
    model = build_tiny_gpt(config, scatter_embedding_sequence_parallel=False).train()
    model.__class__ = NoPaddingMaskGPT
    return model


@pytest.fixture(scope="module")
def batch(single_process_megatron):
    from megatron_vlm_packing.testing.moe_parity import MOE
    from megatron_vlm_packing.testing.parity import variable_batch

    batch = variable_batch([7, 3, 12, 5, 9], 12, vocab_size=MOE.vocab_size, seed=5)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    return batch


@pytest.mark.parametrize("wrap", ["PackedVLM", "alone"])
def test_an_moe_model_without_padding_mask_refuses_pad_slots(batch, wrap):
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.testing.moe_parity import MOE, PAD_TO, aux_loss

    model = _language_model(MOE)
    model = PackedVLM(model).train() if wrap == "PackedVLM" else model
    with pytest.raises(ValueError, match=r"NoPaddingMaskGPT is a mixture-of-experts model whose forward takes no "
                                         r"padding_mask, so its router would count 28 pad slots in the load-balancing "
                                         r"loss"):
        aux_loss(model, batch, pad_to=PAD_TO)
    assert aux_loss(model, batch, pad_to=None) == pytest.approx(73.658, rel=1e-4)  # no pad slot: runs


def test_a_dense_model_without_padding_mask_runs_with_pad_slots(batch):
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig
    from megatron_vlm_packing.testing.step_models import step_loss

    model = PackedVLM(_language_model(TinyGPTConfig()))
    assert step_loss(model, batch, pad_to=64) == pytest.approx(step_loss(model, batch), rel=1e-6)
