"""Input ids no packer checked (a `transform=` or a `replace` gave the micro-batch other ids) are checked by
the GPTModel and PackedVLM adapters: an integer tensor of ids in [0, vocab_size). Before, a negative id or
one >= the vocabulary (e.g. labels handed over as ids, -100 at ignored slots) was an IndexError inside the
embedding, float ids a RuntimeError. Ids the packers made cost no host sync here. Real Megatron-Core
models (tiny, CPU, one process)."""

from dataclasses import replace

import pytest
import torch


@pytest.fixture(scope="module")
def models(single_process_megatron):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.vlm_parity import LM, build_vlm

    torch.manual_seed(0)
    return {"gpt": build_tiny_gpt(TinyGPTConfig(vocab_size=128), scatter_embedding_sequence_parallel=False),
            "vlm": build_vlm(LM, 0, media=True, mrope=True)}


def _batch(name: str) -> dict:
    from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
    from megatron_vlm_packing.testing.parity import variable_batch
    from megatron_vlm_packing.testing.vlm_parity import MEDIA

    if name == "gpt":
        return variable_batch([13, 5, 21, 9], 21, vocab_size=120, seed=1)
    return collate(synthetic_samples(4, seed=3, cfg=MEDIA))


def _loss(model, batch, **options) -> float:
    from megatron_vlm_packing.train.step import make_forward_step

    output, loss_fn = make_forward_step(**options)(iter([batch]), model)
    return float(loss_fn(output)[0])


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("name", ["gpt", "vlm"])
def test_labels_handed_over_as_ids_are_refused(models, name, pack):
    with pytest.raises(ValueError, match=r"input_ids row \d+ position \d+ is -100: token ids must lie in \[0, \d+\)"):
        _loss(models[name], _batch(name), pack=pack, transform=lambda mb: replace(mb, input_ids=mb.labels))


@pytest.mark.parametrize("name", ["gpt", "vlm"])
def test_ids_beyond_the_vocabulary_and_float_ids_are_refused(models, name):
    vocab = 128 if name == "gpt" else models["vlm"].language_model.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids row 0 position 0 is {vocab + 3}: .*\[0, {vocab}\)"):
        _loss(models[name], _batch(name), transform=lambda mb: replace(
            mb, input_ids=torch.where(torch.arange(mb.input_ids.numel()).view_as(mb.input_ids) == 0, vocab + 3,
                                      mb.input_ids)))
    with pytest.raises(ValueError, match=r"input_ids must be an integer tensor of token ids, got torch.float32"):
        _loss(models[name], _batch(name), transform=lambda mb: replace(mb, input_ids=mb.input_ids.float()))


@pytest.mark.parametrize("name", ["gpt", "vlm"])
def test_valid_replaced_ids_are_taken(models, name):
    same = _loss(models[name], _batch(name), transform=lambda mb: replace(mb, input_ids=mb.input_ids.clone()))
    assert same == pytest.approx(_loss(models[name], _batch(name)), rel=1e-6)
