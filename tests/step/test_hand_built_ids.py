"""Input ids no packer checked (a `transform=` or a `replace` gave the micro-batch other ids) are checked by
the GPTModel and PackedVLM adapters: an integer tensor of ids in [0, vocab_size). Before, a negative id or
one >= the vocabulary (e.g. labels handed over as ids, -100 at ignored slots) was an IndexError inside the
embedding, float ids a RuntimeError. Ids the packers made cost no host sync here. Real Megatron-Core
models (tiny, CPU, one process)."""

from dataclasses import replace

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_batch, step_loss, tiny_step_models


@pytest.fixture(scope="module")
def models(single_process_megatron):
    return tiny_step_models()


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("name", ["gpt", "vlm"])
def test_labels_handed_over_as_ids_are_refused(models, name, pack):
    with pytest.raises(ValueError, match=r"input_ids row \d+ position \d+ is -100: token ids must lie in \[0, \d+\)"):
        step_loss(models[name], step_batch(name), pack=pack, transform=lambda mb: replace(mb, input_ids=mb.labels))


@pytest.mark.parametrize("name", ["gpt", "vlm"])
def test_ids_beyond_the_vocabulary_and_float_ids_are_refused(models, name):
    vocab = 128 if name == "gpt" else models["vlm"].language_model.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids row 0 position 0 is {vocab + 3}: .*\[0, {vocab}\)"):
        step_loss(models[name], step_batch(name), transform=lambda mb: replace(
            mb, input_ids=torch.where(torch.arange(mb.input_ids.numel()).view_as(mb.input_ids) == 0, vocab + 3,
                                      mb.input_ids)))
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor of token ids, got torch.float32"):
        step_loss(models[name], step_batch(name), transform=lambda mb: replace(mb, input_ids=mb.input_ids.float()))


@pytest.mark.parametrize("name", ["gpt", "vlm"])
def test_valid_replaced_ids_are_taken(models, name):
    same = step_loss(models[name], step_batch(name), transform=lambda mb: replace(mb, input_ids=mb.input_ids.clone()))
    assert same == pytest.approx(step_loss(models[name], step_batch(name)), rel=1e-6)
