"""LLaVA packs with the language model's vocabulary (`LlavaSpace.vocab_size`, read by `LlavaSpace.of`): a text
id or label outside [0, vocab_size) is a ValueError, in the step and in `LlavaPackingCollator`'s worker; a
micro-batch packed for a space without it is checked by the step in host memory (no sync).

`pack_llava_batch` screened ids and labels from below only, so a label >= the vocabulary reached LLaVAModel's
vocab-parallel cross entropy, which masks it (its loss silently the log-sum-exp of the logits). The image
token is never embedded by LLaVAModel, so it is not screened, whatever its id. Real Megatron-Core LLaVAModel
(tiny, CPU, one process).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_vlm_packing.models.llava import LlavaSpace
from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator, pack_llava_batch
from megatron_vlm_packing.testing.llava_reference import IMG, T, build_tiny_llava, collated
from megatron_vlm_packing.testing.step_models import step_loss

VOCAB = 128  # build_tiny_llava's language_vocab_size
ROWS = ((T, T, T), (IMG, IMG, T, T), (T, IMG, T, T, IMG))


@pytest.fixture(scope="module")
def llava(single_process_megatron):
    from megatron_vlm_packing.patches import apply_llava_packed_boundaries, undo_llava_packed_boundaries

    apply_llava_packed_boundaries()  # packed LLaVA needs its boundaries expanded (the step refuses it unpatched)
    yield build_tiny_llava(0)
    undo_llava_packed_boundaries()


def _batch(field: str | None = None, value: int = 0) -> dict:
    batch = collated(ROWS, label_style="hf", seed=4)
    if field is not None:
        edited = batch[field].clone()
        edited[2, 2] = value  # a text token (row 2 is T, IMG, T, T, IMG)
        batch = {**batch, field: edited}
    return batch


def test_the_space_of_a_model_carries_its_vocabulary(llava):
    space = LlavaSpace.of(llava)
    assert space.vocab_size == VOCAB == llava.language_model.vocab_size
    assert space == replace(space, vocab_size=None)  # it plans nothing: spaces compare without it


@pytest.mark.parametrize("field, message", [("labels", rf"labels row 2 position 2 is {VOCAB}: a label must be -100"),
                                            ("input_ids", rf"input_ids row 2 position 2 is {VOCAB}: token ids")])
@pytest.mark.parametrize("pack", [True, False])
def test_the_step_refuses_text_beyond_the_vocabulary(llava, field, message, pack):
    with pytest.raises(ValueError, match=message):
        step_loss(llava, _batch(field, VOCAB), pack=pack)


def test_the_collator_of_the_models_space_refuses_it_in_the_worker(llava):
    with pytest.raises(ValueError, match=rf"labels row 2 position 2 is {VOCAB}: a label must be -100"):
        LlavaPackingCollator(space=LlavaSpace.of(llava))(_batch("labels", VOCAB))


def test_a_loader_micro_batch_packed_without_the_vocabulary_is_checked_by_the_step(llava):
    spaceless = replace(LlavaSpace.of(llava), vocab_size=None)
    micro_batch = LlavaPackingCollator(space=spaceless)(_batch("labels", VOCAB))
    assert micro_batch.checked_vocab_size is None
    with pytest.raises(ValueError, match=rf"is {VOCAB}: a label must be -100 .*vocab_size={VOCAB}"):
        step_loss(llava, micro_batch)
    good = LlavaPackingCollator(space=spaceless)(_batch())
    assert step_loss(llava, good) == step_loss(llava, _batch())


def test_an_image_token_id_beyond_the_vocabulary_is_not_screened():
    """LLaVAModel replaces its image tokens before the embedding: such an id is never embedded."""
    space = LlavaSpace(img_seq_len=4, image_token_index=VOCAB + 72, vocab_size=VOCAB)
    ids = torch.tensor([[5, VOCAB + 72, 7], [8, 9, 10]])
    packed = pack_llava_batch({"input_ids": ids, "labels": torch.where(ids == VOCAB + 72, -100, ids),
                               "images": torch.zeros(1, 3, 2, 2)}, space, label_style="hf")
    assert packed.checked_vocab_size == VOCAB and packed.stats.real_tokens == 6 + 3
