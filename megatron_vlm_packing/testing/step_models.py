"""A tiny GPTModel and a tiny mRoPE `PackedVLM` with media, their batches, and one step's loss: what the
step's input tests run through the shipped `make_forward_step` (real Megatron-Core modules, CPU, one
process inside `single_process_megatron`)."""

from __future__ import annotations

import torch

GPT_VOCAB = 128


def tiny_step_models() -> dict:
    """{"gpt": a 1D-rotary GPTModel of `GPT_VOCAB` tokens, "vlm": `testing.vlm_parity`'s mRoPE PackedVLM with
    a vision tower (images and videos) and an audio tower}, built from seed 0."""
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.vlm_parity import LM, build_vlm

    torch.manual_seed(0)
    return {"gpt": build_tiny_gpt(TinyGPTConfig(vocab_size=GPT_VOCAB), scatter_embedding_sequence_parallel=False),
            "vlm": build_vlm(LM, 0, media=True, mrope=True)}


def step_batch(model_name: str) -> dict:
    """A collated batch for `tiny_step_models()[model_name]`: 4 right-padded text rows (ids < 120) for "gpt",
    4 synthetic multimodal samples for "vlm"."""
    from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
    from megatron_vlm_packing.testing.parity import variable_batch
    from megatron_vlm_packing.testing.vlm_parity import MEDIA

    if model_name == "gpt":
        return variable_batch([13, 5, 21, 9], 21, vocab_size=120, seed=1)
    return collate(synthetic_samples(4, seed=3, cfg=MEDIA))


def step_loss(model, batch, **options) -> float:
    """The loss `make_forward_step(**options)` gives `model` on one micro-batch `batch`."""
    from megatron_vlm_packing.train.step import make_forward_step

    output, loss_fn = make_forward_step(**options)(iter([batch]), model)
    return float(loss_fn(output)[0])
