"""`pack_batch`'s value checks are one-pass screens read with the lengths: a screen tripped only by pad
slots lets the batch through unchanged; a bad real token raises the exact error (field, row,
position, value); the check of labels given in the other style (Hugging Face labels as Megatron ones) is
exact on small and large batches and rides the same one read."""

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.testing.sync_counter import count_host_syncs

FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")


def batch_of(lengths, seq_len, *, vocab=50, seed=0, style="megatron"):
    """Rows with labels of `style` (Megatron: the next token; "hf": the token itself), a float loss mask, pads:
    id 0, label -100, weight 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq_len + 1), generator=g)
    keep = torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]
    weights = torch.rand(len(lengths), seq_len, generator=g)
    labels = ids[:, 1:] if style == "megatron" else ids[:, :-1]
    return {"input_ids": torch.where(keep, ids[:, :-1], 0), "labels": torch.where(keep, labels, -100),
            "loss_mask": torch.where(keep, weights, 0.0), "attention_mask": keep.long()}


def same(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS) and torch.equal(
        a.packed_seq_params.cu_seqlens_q_padded, b.packed_seq_params.cu_seqlens_q_padded)


def at_pads(batch, key, value):
    out = dict(batch)
    out[key] = torch.where(batch["attention_mask"].bool(), batch[key], torch.tensor(value, dtype=batch[key].dtype))
    return out


@pytest.mark.parametrize("key,value", [("input_ids", -5), ("input_ids", 10_000), ("labels", -1), ("labels", 10_000),
                                       ("loss_mask", float("nan")), ("loss_mask", -2.0), ("loss_mask", 1e39)])
@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_a_screen_tripped_only_by_pad_slots_lets_the_batch_through_unchanged(key, value, style):
    clean = batch_of([5, 3, 7], 8, style=style)
    if key == "loss_mask" and value == 1e39:  # finite in float64, inf as float32
        clean["loss_mask"] = clean["loss_mask"].double()
    expected = pack_batch(clean, label_style=style, vocab_size=50, cp_size=2)
    got = pack_batch(at_pads(clean, key, value), label_style=style, vocab_size=50, cp_size=2)
    assert same(got, expected)


@pytest.mark.parametrize("key,value,message", [
    ("input_ids", -5, r"input_ids row 1 position 2 is -5: token ids must lie in \[0, 50\)"),
    ("input_ids", 50, r"input_ids row 1 position 2 is 50: token ids must lie in \[0, 50\)"),
    ("labels", -1, r"labels row 1 position 2 is -1: a label must be -100 \(ignored\) or a token id in \[0, 50\)"),
    ("labels", -101, r"labels row 1 position 2 is -101"),
    ("labels", 50, r"labels row 1 position 2 is 50"),
    ("loss_mask", float("nan"), r"loss_mask row 1 position 2 is nan: loss weights must be finite and >= 0"),
    ("loss_mask", -0.5, r"loss_mask row 1 position 2 is -0.5"),
])
def test_a_bad_real_token_raises_naming_field_row_position_and_value(key, value, message):
    batch = batch_of([5, 3, 7], 8)
    batch[key] = batch[key].clone()
    batch[key][1, 2] = value
    with pytest.raises(ValueError, match=message):
        pack_batch(batch, vocab_size=50)


def test_loss_weights_finite_in_float64_but_not_in_float32_raise():
    batch = batch_of([5, 3, 7], 8)
    batch["loss_mask"] = batch["loss_mask"].double()
    batch["loss_mask"][2, 6] = 1e39
    with pytest.raises(ValueError, match=r"loss_mask row 2 position 6 is 1e\+39 \(inf as float32\)"):
        pack_batch(batch)


@pytest.mark.parametrize("value", [2, -1, 2 ** 32])
def test_int64_mask_values_other_than_0_1_are_refused(value):
    batch = batch_of([5, 3, 7], 8)
    batch["attention_mask"] = batch["attention_mask"].clone()
    batch["attention_mask"][1, 1] = value
    with pytest.raises(ValueError, match="attention_mask row 1 has values other than 0 and 1"):
        pack_batch(batch)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool])
def test_holes_and_left_padding_are_refused_for_every_mask_dtype(dtype):
    batch = batch_of([5, 3, 7], 8)
    for b, s in ((0, 2), (2, 0)):  # a hole in row 0, left padding in row 2
        mask = batch["attention_mask"].clone()
        mask[b, s] = 0
        with pytest.raises(ValueError, match=rf"right-padded and contiguous .* bad row\(s\) \[{b}\]"):
            pack_batch({**batch, "attention_mask": mask.to(dtype)})


LARGE = 1 << 14  # row length of the large batches: 3 rows of it, 49152 slots


@pytest.mark.parametrize("seq_len", [16, LARGE])
def test_hf_labels_given_as_megatron_labels_are_refused_on_small_and_large_batches(seq_len):
    batch = batch_of([9, 4, 12], seq_len, style="hf")
    with pytest.raises(ValueError, match=r"Hugging Face \(unshifted\) labels but label_style=\"megatron\""):
        pack_batch(batch)


def test_large_batch_whose_last_tokens_are_ignored_or_copies_is_checked_in_the_one_read_and_passes():
    """Row 0's last 100 labels are ignored, 100 of row 1's copy their tokens (Hugging Face's identity): Megatron's
    identity holds at the other pairs, so the labels are no batch of the other style; the check counts every pair
    in the one read (no screen to trip, no second read)."""
    batch = batch_of([300, 200], LARGE)
    labels = batch["labels"].clone()
    labels[0, 200:300] = -100
    labels[1, 100:200] = batch["input_ids"][1, 100:200]
    expected_labels = torch.cat([labels[0, :300], labels[1, :200]])
    with count_host_syncs() as syncs:
        packed = pack_batch({**batch, "labels": labels})
    assert torch.equal(packed.labels[0], expected_labels)
    assert syncs.total == 1, syncs.report()


@pytest.mark.parametrize("seq_len", [16, LARGE])
def test_clean_batches_take_one_host_read(seq_len):
    for style in ("megatron", "hf"):
        batch = batch_of([9, 4, 12], seq_len, style=style)
        with count_host_syncs() as syncs:
            pack_batch(batch, label_style=style, vocab_size=50, cp_size=2)
        assert syncs.total == 1, syncs.report()
