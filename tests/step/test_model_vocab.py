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

from megatron_vlm_packing.testing.step_models import step_batch, step_loss, tiny_step_models


@pytest.fixture(scope="module")
def models(single_process_megatron):
    return tiny_step_models()


def _vocab(model) -> int:
    return model.vocab_size if hasattr(model, "vocab_size") else model.language_model.vocab_size


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
def test_a_label_outside_the_models_vocabulary_is_refused(models, model_name, pack):
    model, batch = models[model_name], step_batch(model_name)
    labels = batch["labels"].clone()
    labels[0, 2] = _vocab(model)  # a real token's target (row 0 is the longest)
    with pytest.raises(ValueError, match=rf"labels row 0 position 2 is {_vocab(model)}.*\[0, {_vocab(model)}\)"):
        step_loss(model, {**batch, "labels": labels}, pack=pack)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
def test_an_id_outside_the_models_vocabulary_is_refused(models, model_name, pack):
    model, batch = models[model_name], step_batch(model_name)
    ids = batch["input_ids"].clone()
    ids[0, 1] = _vocab(model) + 7
    with pytest.raises(ValueError, match=rf"input_ids row 0 position 1 is {_vocab(model) + 7}"):
        step_loss(model, {**batch, "input_ids": ids}, pack=pack)


@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
def test_in_range_batches_still_pack_as_dense(models, model_name):
    model, batch = models[model_name], step_batch(model_name)
    assert step_loss(model, batch) == pytest.approx(step_loss(model, batch, pack=False), rel=1e-5)
