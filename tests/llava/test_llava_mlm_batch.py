"""Megatron-LM's examples/multimodal LLaVA batches (TaskEncoder.batch's keys: tokens, labels [N, S + 1], imgs,
num_tiles, cu_lengths, max_lengths) through the step: read by `models.llava_mlm_batch` as its get_batch reads
them (labels shifted once, targets equal to the tokenizer's pad masked), a pack of its own cut back into its
samples at the model's expanded boundaries, every bad field a ValueError. The model-level parity (the same
samples in that format and in the usual one: identical per-token losses and gradients, == batched LLaVA) is in
tests/llava/llava_mlm_workers.py."""

import pytest
import torch

from megatron_vlm_packing.models.adapter import ModelAdapter
from megatron_vlm_packing.models.llava import LLaVAAdapter, LlavaSpace
from megatron_vlm_packing.models.llava_mlm_batch import from_megatron_lm_batch
from megatron_vlm_packing.models.llava_pack import pack_llava_batch
from megatron_vlm_packing.train.build import StepOptions
from tests.llava.exact import assert_equals_batched
from tests.llava.llava_mlm_workers import launch

IMG, PAD, X = 127, 0, -100
SPACE = LlavaSpace(img_seq_len=4, image_token_index=IMG)
DUMMY = torch.tensor([[0]], dtype=torch.int32)


def _read(batch, *, space=SPACE, label_style="megatron", pad_id=PAD):
    return from_megatron_lm_batch(batch, img_seq_len=space.img_seq_len, image_token_index=space.image_token_index,
                                  label_style=label_style, pad_id=pad_id)


def _rows_batch():
    """Three samples, right-padded: labels unshifted ([N, S + 1]), the prompt -100, the padding PAD. Sample 2
    opens with a real token whose id is PAD and has a target equal to PAD (get_batch masks both)."""
    tokens = torch.tensor([[5, IMG, 6, 7], [IMG, 9, PAD, PAD], [PAD, 10, 11, PAD]])
    labels = torch.tensor([[X, X, 6, 7, PAD], [X, 9, PAD, PAD, PAD], [X, PAD, 11, PAD, PAD]])
    return {"__key__": ["a", "b", "c"], "__restore_key__": [(), (), ()], "__subflavor__": None,
            "tokens": tokens, "labels": labels, "imgs": torch.randn(3, 3, 2, 2),
            "num_tiles": torch.tensor([2, 1], dtype=torch.int32), "cu_lengths": DUMMY, "max_lengths": DUMMY}


def test_rows_are_shifted_once_padding_masked_and_trailing_pads_left_out():
    batch = _rows_batch()
    rows = _read(batch)
    assert rows["input_ids"].tolist() == [[5, IMG, 6, 7], [IMG, 9, PAD, PAD], [PAD, 10, 11, PAD]]
    # get_batch's targets labels[:, 1:S + 1], masked where -100 or PAD: each token's NEXT token, shifted once
    assert rows["labels"].tolist() == [[X, 6, 7, X], [9, X, X, X], [X, 11, X, X]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert rows["images"] is batch["imgs"] and rows["num_image_tiles"].tolist() == [2, 1]
    assert set(rows) == {"input_ids", "labels", "attention_mask", "images", "num_image_tiles"}
    assert batch["labels"].shape == (3, 5)  # the batch given is not changed


def _pack_batch(fp8_pad=0, first_label=X):
    """Samples A = [5, IMG(2 tiles), 6, 7] (4 + 8 - 1 = 11 expanded) and B = [12, IMG(1 tile), 9] (3 + 4 - 1 = 6)
    packed as TaskEncoder.pack_selected_samples packs them, in a row of 9 slots (+ FP8 pads)."""
    tokens = torch.tensor([[5, IMG, 6, 7, 12, IMG, 9, PAD, PAD] + [PAD] * fp8_pad])
    labels = torch.tensor([[X, X, 6, 7, first_label, X, 9, PAD, PAD, PAD] + [X] * fp8_pad])
    return {"tokens": tokens, "labels": labels, "imgs": torch.randn(3, 3, 2, 2),
            "num_tiles": torch.tensor([2, 1], dtype=torch.int32),
            "cu_lengths": torch.tensor([[0, 11, 17 + fp8_pad]], dtype=torch.int32),
            "max_lengths": torch.tensor([max(11, 6 + fp8_pad)], dtype=torch.int32)}


@pytest.mark.parametrize("fp8_pad", [0, 7])
def test_a_pack_is_cut_into_its_samples_at_the_expanded_boundaries(fp8_pad):
    # B's first label is a real target: Megatron-LM's shift across its pack trains A's last token on it
    # (bug class 8); alone, A's last token has no target
    rows = _read(_pack_batch(fp8_pad, first_label=12))
    assert rows["input_ids"].tolist() == [[5, IMG, 6, 7], [12, IMG, 9, PAD]]
    assert rows["labels"].tolist() == [[X, 6, 7, X], [X, 9, X, X]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert rows["num_image_tiles"].tolist() == [2, 1]
    # then packed by the step's packer as any rows, each image with its own tiles
    mb = pack_llava_batch(rows, SPACE, label_style="megatron")
    assert mb.plan.tiles == (2, 1) and mb.plan.images_per_document == (1, 1)
    assert mb.labels[0, mb.loss_mask[0] > 0].tolist() == [6, 7, 9]


def test_pack_boundaries_of_another_expansion_or_beside_targets_are_refused():
    with pytest.raises(ValueError, match=r"cu_lengths\[0\]\[1\] = 11 falls inside collapsed slot 1 .*img_seq_len=6"):
        _read(_pack_batch(), space=LlavaSpace(img_seq_len=6, image_token_index=IMG))
    with pytest.raises(ValueError, match=r"max_lengths\[0\] is 9 but the longest sample .* has 11 tokens"):
        _read(dict(_pack_batch(), max_lengths=torch.tensor([9], dtype=torch.int32)))
    late = _pack_batch()
    late["labels"] = late["labels"].clone()
    late["labels"][0, 8] = 33  # a target after the pack's last sample
    with pytest.raises(ValueError, match="the slots after its last sample .* hold 0 image tokens and 1 targets"):
        _read(late)
    with pytest.raises(ValueError, match=r"cu_lengths\[0\] \[0, 11, 40\] must rise from 0 to at most the pack's 19"):
        _read(dict(_pack_batch(), cu_lengths=torch.tensor([[0, 11, 40]], dtype=torch.int32)))


def test_text_only_dummies_and_refusals():
    batch = _rows_batch()
    text = dict(batch, tokens=torch.where(batch["tokens"] == IMG, 3, batch["tokens"]), imgs=torch.tensor([[0.0]]),
                num_tiles=DUMMY)
    assert "images" not in _read(text) and "num_image_tiles" not in _read(text)
    with pytest.raises(ValueError, match="label_style='hf' would shift them again: use make_forward_step"):
        _read(batch, label_style="hf")
    with pytest.raises(ValueError, match=r"pass make_forward_step\(megatron_lm_pad_id=get_tokenizer\(\).pad\)"):
        _read(batch, pad_id=None)
    with pytest.raises(ValueError, match=r"labels must be \[N, S \+ 1\] = \[3, 5\] .* got \[3, 4\]"):
        _read(dict(batch, labels=batch["labels"][:, :4]))
    with pytest.raises(ValueError, match=r"unknown \['attention_mask'\], missing \[\]"):
        _read(dict(batch, attention_mask=torch.ones(3, 4)))
    with pytest.raises(ValueError, match="tokens hold 2 image tokens .* but num_tiles lists 1 images"):
        _read(dict(batch, num_tiles=torch.tensor([3], dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"num_tiles \[2, 2\] \(each >= 1\) must sum to the 3 tiles of imgs"):
        _read(dict(batch, num_tiles=torch.tensor([2, 2], dtype=torch.int32)))
    usual = {"input_ids": batch["tokens"], "labels": batch["labels"][:, :4]}
    assert _read(usual, pad_id=None, label_style="hf") is usual  # any other batch as it is


def test_the_pad_id_option_is_refused_where_no_adapter_reads_it():
    adapter = ModelAdapter.__new__(ModelAdapter)
    adapter.model_name = "GPTModel"
    with pytest.raises(ValueError, match="megatron_lm_pad_id=0 reads Megatron-LM examples/multimodal LLaVA batches"):
        adapter.collated_batch({}, StepOptions(label_style="megatron", megatron_lm_pad_id=0))
    with pytest.raises(ValueError, match="megatron_lm_pad_id must be the Megatron-LM tokenizer's pad id"):
        StepOptions(megatron_lm_pad_id="0")
    llava = LLaVAAdapter.__new__(LLaVAAdapter)
    llava.space = SPACE
    rows = llava.collated_batch(_rows_batch(), StepOptions(label_style="megatron", megatron_lm_pad_id=PAD))
    assert rows["labels"].tolist() == [[X, 6, 7, X], [9, X, X, X], [X, 11, X, X]]


FORMS = ["rows", "rows, dataloader_seq_length", "pack", "pack, fp8 pads", "rows, pack=False", "pack, pack=False",
         "TP=2+SP, pack, broadcast from TP rank 0", "CP=2, pack"]


@pytest.mark.parametrize("form", FORMS)
def test_megatron_lm_batches_equal_the_usual_batches_and_batched_llava(form):
    result = launch()
    run = result[form]
    assert_equals_batched(run, result["params"])
    if form in ("rows", "rows, dataloader_seq_length", "pack", "pack, fp8 pads"):  # the step's pack of the same samples, bit for bit
        assert run["identical_to_usual"], run
    assert run["tokens_compared"] == result["usual"]["tokens_compared"]


def test_control_labels_shifted_twice_are_refused():
    """get_batch's targets (labels[:, 1:S + 1]) renamed by hand and read as Hugging Face labels would be shifted a
    second time: the packers' label-style check refuses them."""
    assert launch()["control: shifted twice"].startswith("labels look already shifted (Megatron style) but "
                                                         "label_style=\"hf\" shifts them again")
