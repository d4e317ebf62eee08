"""Micro-batches packed in the DataLoader without the model's vocabulary are checked against it by the step.

A `PackingCollator` has no model: unless given `pack_options=dict(vocab_size=...)` it checks labels and ids
only from below. The step trusted its labels, so a label >= the model's vocabulary reached Megatron's
vocab-parallel cross entropy, which masks it (the token's loss silently the log-sum-exp of its logits); an id
>= the vocabulary became a zero embedding at TP > 1 (every rank masks it) and an IndexError at TP = 1.
The step now checks such a micro-batch where it arrives, in host memory before the move: no device sync
(the sync counter counts none), and a micro-batch packed with the model's vocabulary is not read again.
Real Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.packing.dense_batch import pad_batch
from megatron_vlm_packing.testing.step_models import GPT_VOCAB, step_batch, step_loss, tiny_step_models
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from megatron_vlm_packing.train.step import make_forward_step


@pytest.fixture(scope="module")
def gpt(single_process_megatron):
    return tiny_step_models()["gpt"]


def _loader(pack: bool, batch: dict):
    """What a DataLoader yields: PackingCollator's pack, or (pack=False) a collate_fn calling pad_batch."""
    return PackingCollator(label_style="hf")(batch) if pack else pad_batch(batch, label_style="hf")


def _batch_with(field: str, row: int, position: int, value: int) -> dict:
    batch = step_batch("gpt")
    edited = batch[field].clone()
    edited[row, position] = value
    return {**batch, field: edited}


@pytest.mark.parametrize("pack", [True, False])
def test_a_loader_label_beyond_the_models_vocabulary_is_refused(gpt, pack):
    micro_batch = _loader(pack, _batch_with("labels", 0, 2, GPT_VOCAB))
    assert micro_batch.checked_vocab_size is None  # the collator knew no vocabulary
    with pytest.raises(ValueError, match=rf"labels row 0 position \d+ is {GPT_VOCAB}: a label must be -100 \(ignored\) "
                                         rf"or a token id in \[0, {GPT_VOCAB}\); 1 such label\(s\).*PackingCollator"):
        step_loss(gpt, micro_batch, pack=pack)


@pytest.mark.parametrize("pack", [True, False])
def test_a_loader_id_beyond_the_models_vocabulary_is_refused(gpt, pack):
    micro_batch = _loader(pack, _batch_with("input_ids", 1, 3, GPT_VOCAB + 5))
    with pytest.raises(ValueError, match=rf"input_ids row \d+ position \d+ is {GPT_VOCAB + 5}: .*\[0, {GPT_VOCAB}\)"
                                         rf".*PackingCollator"):
        step_loss(gpt, micro_batch, pack=pack)


def test_a_micro_batch_checked_against_a_larger_vocabulary_is_checked_again(gpt):
    micro_batch = PackingCollator(label_style="hf", pack_options=dict(vocab_size=GPT_VOCAB + 10))(
        _batch_with("labels", 0, 2, GPT_VOCAB + 1))
    assert micro_batch.checked_vocab_size == GPT_VOCAB + 10
    with pytest.raises(ValueError, match=rf"is {GPT_VOCAB + 1}: a label must be -100"):
        step_loss(gpt, micro_batch)


@pytest.mark.parametrize("vocab_size", [None, GPT_VOCAB, GPT_VOCAB - 8])
def test_valid_loader_micro_batches_cost_no_sync_and_train_as_the_step_packs(gpt, vocab_size):
    """Checked in host memory (no device sync) when the collator had no vocabulary; not read at all when it
    had this one or a smaller one. The loss is the step's own packing's."""
    batch = step_batch("gpt")  # ids < 120
    options = {} if vocab_size is None else dict(vocab_size=vocab_size)
    micro_batch = PackingCollator(label_style="hf", pack_options=options)(batch)
    core = [layer.self_attention.core_attention for layer in gpt.decoder.layers]  # a GPU kernel's stand-in
    with count_host_syncs(exclude=core) as syncs:
        output, loss_fn = make_forward_step(label_style="hf")(iter([micro_batch]), gpt)
        loss = loss_fn(output)[0]
        loss.backward()
    gpt.zero_grad(set_to_none=True)
    assert syncs.total == 0, syncs.report()
    assert float(loss) == step_loss(gpt, batch, label_style="hf")


def test_a_transformed_loader_micro_batch_keeps_the_check(gpt):
    """The step's mark (the model's vocabulary) holds for these labels only: a transform's labels are checked."""
    from dataclasses import replace

    micro_batch = PackingCollator(label_style="hf")(step_batch("gpt"))
    over = lambda mb: replace(mb, labels=torch.full_like(mb.labels, GPT_VOCAB))  # noqa: E731
    with pytest.raises(ValueError, match=rf"is {GPT_VOCAB}: a label must be -100"):
        step_loss(gpt, micro_batch, transform=over)


def test_a_hand_built_padding_mask_of_another_dtype_is_left_to_the_checks_after_the_move():
    """`~` of an integer mask is no inversion (~0 = -1): such a micro-batch is not marked checked here, so the
    labels' check after the move (one sync) still reads it."""
    from dataclasses import replace

    from megatron_vlm_packing.train.loader_vocab import check_loader_vocab
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_labels

    micro_batch = PackingCollator(label_style="hf")(_batch_with("labels", 0, 2, GPT_VOCAB))
    int_mask = replace(micro_batch, padding_mask=micro_batch.padding_mask.long())
    assert check_loader_vocab(int_mask, GPT_VOCAB) is int_mask and int_mask.checked_vocab_size is None
    with pytest.raises(ValueError, match=rf"is {GPT_VOCAB}: a label must be -100"):
        check_unpacked_labels(int_mask, GPT_VOCAB)
