"""The step packs with the model's vocabulary size: ids and labels outside [0, vocab_size) are a ValueError
naming the row and position, whatever the model (GPTModel, PackedVLM), packed or dense.

The step gave the packers no vocab_size, so a label >= the vocabulary reached Megatron's vocab-parallel
cross entropy, which masks a target outside the rank's vocabulary range: that token's loss became the
log-sum-exp of its logits, a different loss with no error. An input id >= the vocabulary was an
IndexError in the embedding. Real Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def models(single_process_megatron):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.vlm_parity import LM, build_vlm

    torch.manual_seed(0)
    return {"gpt": build_tiny_gpt(TinyGPTConfig(vocab_size=128), scatter_embedding_sequence_parallel=False),
            "vlm": build_vlm(LM, 0, media=True, mrope=True)}


def _batch(model_name: str) -> dict:
    from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
    from megatron_vlm_packing.testing.parity import variable_batch
    from megatron_vlm_packing.testing.vlm_parity import MEDIA

    if model_name == "gpt":
        return variable_batch([13, 5, 21, 9], 21, vocab_size=120, seed=1)
    return collate(synthetic_samples(4, seed=3, cfg=MEDIA))


def _loss(model, batch: dict, **options) -> float:
    from megatron_vlm_packing.train.step import make_forward_step

    output, loss_fn = make_forward_step(**options)(iter([batch]), model)
    return float(loss_fn(output)[0])


def _vocab(model) -> int:
    return model.vocab_size if hasattr(model, "vocab_size") else model.language_model.vocab_size


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
def test_a_label_outside_the_models_vocabulary_is_refused(models, model_name, pack):
    model, batch = models[model_name], _batch(model_name)
    labels = batch["labels"].clone()
    labels[0, 2] = _vocab(model)  # a real token's target (row 0 is the longest)
    with pytest.raises(ValueError, match=rf"labels row 0 position 2 is {_vocab(model)}.*\[0, {_vocab(model)}\)"):
        _loss(model, {**batch, "labels": labels}, pack=pack)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
def test_an_id_outside_the_models_vocabulary_is_refused(models, model_name, pack):
    model, batch = models[model_name], _batch(model_name)
    ids = batch["input_ids"].clone()
    ids[0, 1] = _vocab(model) + 7
    with pytest.raises(ValueError, match=rf"input_ids row 0 position 1 is {_vocab(model) + 7}"):
        _loss(model, {**batch, "input_ids": ids}, pack=pack)


@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
def test_in_range_batches_still_pack_as_dense(models, model_name):
    model, batch = models[model_name], _batch(model_name)
    assert _loss(model, batch) == pytest.approx(_loss(model, batch, pack=False), rel=1e-5)
