"""A `pad_token_id` outside the model's vocabulary is refused where the vocabulary is known.

Every pad slot of a micro-batch is embedded with the rest: Megatron-Core's embedding at TP=1 indexes its table
with the pad id (an IndexError deep inside `F.embedding` on CPU, a device-side assert on a GPU that ends the
process), so a pad id >= vocab_size is refused by the packers given `vocab_size` (`pack_batch`, `pad_batch`, the
plain host path, LLaVA's packers) and by the step for a loader micro-batch packed without it
(`train.loader_vocab.check_loader_vocab`), with a ValueError naming pad_token_id and the vocabulary. Before, the
packers wrote it to every pad slot and the step reached the embedding.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.models.llava import LlavaSpace
from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator, pack_llava_batch, pad_llava_batch
from megatron_vlm_packing.packing.collate import PackingCollator

VOCAB = 10
IMG = 9


def _rows() -> dict:
    ids = torch.tensor([[5, 6, 7, 0], [8, 1, 0, 0]])
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}


PACKERS = {
    "pack_batch": lambda pad, **kw: pack_batch(_rows(), label_style="hf", pad_to=8, pad_token_id=pad, **kw),
    "pack_batch host": lambda pad, **kw: pack_batch(_rows(), label_style="hf", pad_to=8, pad_token_id=pad,
                                                    host_reads=True, **kw),
    "pad_batch": lambda pad, **kw: pad_batch(_rows(), label_style="hf", pad_token_id=pad, **kw),
    "collator": lambda pad, **kw: PackingCollator(label_style="hf", pad_to=8, pad_token_id=pad, pack_options=kw)(
        _rows()),
}


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("pad", [VOCAB, VOCAB + 40])
def test_a_pad_id_outside_the_vocabulary_is_refused(packer, pad):
    with pytest.raises(ValueError, match=rf"pad_token_id={pad} is no token id of the model \(vocab_size={VOCAB}"):
        PACKERS[packer](pad, vocab_size=VOCAB)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_the_largest_id_and_no_vocabulary_still_pack(packer):
    packed = PACKERS[packer](VOCAB - 1, vocab_size=VOCAB)
    assert (packed.input_ids[packed.padding_mask] == VOCAB - 1).all() and packed.padding_mask.any()
    unbound = PACKERS[packer](VOCAB + 40)  # no vocabulary given: nothing to compare with (the step checks)
    assert (unbound.input_ids[unbound.padding_mask] == VOCAB + 40).all()


def test_a_bad_vocab_size_is_named_before_the_pad_id():
    with pytest.raises(ValueError, match="vocab_size must be a positive int or None, got 'ten'"):
        pack_batch(_rows(), label_style="hf", pad_token_id=50, vocab_size="ten")


LLAVA_SPACE = LlavaSpace(img_seq_len=4, image_token_index=IMG, vocab_size=VOCAB)
LLAVA = {
    "pack_llava_batch": lambda pad: pack_llava_batch(_rows(), LLAVA_SPACE, label_style="hf", pad_token_id=pad),
    "pad_llava_batch": lambda pad: pad_llava_batch(_rows(), LLAVA_SPACE, label_style="hf", pad_token_id=pad),
    "collator": lambda pad: LlavaPackingCollator(space=LLAVA_SPACE, label_style="hf", pad_token_id=pad)(_rows()),
}


@pytest.mark.parametrize("packer", sorted(LLAVA))
def test_llava_refuses_a_pad_id_outside_its_vocabulary(packer):
    with pytest.raises(ValueError, match=rf"pad_token_id=12 is no token id of the model \(vocab_size={VOCAB}"):
        LLAVA[packer](12)
    LLAVA[packer](8)  # inside: packs


def test_the_step_refuses_a_loader_pack_whose_pad_slots_hold_an_id_outside_the_vocabulary(single_process_megatron):
    from megatron_vlm_packing.testing.step_models import GPT_VOCAB, step_loss, tiny_step_models

    gpt = tiny_step_models()["gpt"]
    rows = _rows()
    outside = PackingCollator(label_style="hf", pad_to=8, pad_token_id=GPT_VOCAB + 3)(rows)  # no vocabulary
    message = rf"input_ids pad slot \(0, \d+\) holds {GPT_VOCAB + 3} \(the pad_token_id\), no token id of the model"
    with pytest.raises(ValueError, match=rf"{message} \(vocab_size={GPT_VOCAB}"):
        step_loss(gpt, outside)
    inside = PackingCollator(label_style="hf", pad_to=8, pad_token_id=GPT_VOCAB - 1)(rows)
    assert step_loss(gpt, inside) == pytest.approx(step_loss(gpt, PackingCollator(label_style="hf", pad_to=8)(rows)))
