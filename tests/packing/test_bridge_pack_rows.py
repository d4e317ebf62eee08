"""A Megatron-Bridge in-batch pack as a user can hand it over (`packing.bridge_batch.rows_of_bridge_pack`), built here
in the layout Bridge's `build_mcore_thd_sequence_batch_from_rows` writes (no Bridge import: both legs run it).

Before: a target (loss_mask 1) in the alignment slots between two documents was dropped without a word (the pack
trained 19 of the 20 targets Bridge's own loss counts); `cu_seqlens_kv_padded` without `cu_seqlens_q_padded` was a
KeyError; a `total_tokens` or `max_seqlen_q` / `_kv` that contradicts the boundaries was ignored; the boundaries
took up to 6 host reads, not the one the docstring said; a batch of the user's own carrying only `total_tokens` was
called "Megatron-Bridge's collate output" and told to switch label_style.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing.bridge_batch import rows_of_bridge_pack
from megatron_vlm_packing.testing.sync_counter import count_host_syncs

LENGTHS, MULTIPLE = (7, 3, 12), 4


def bridge_pack(lengths=LENGTHS, multiple=MULTIPLE, seed=3) -> dict:
    """Right-padded rows' documents packed as Bridge packs them: each document's real tokens at its physical start,
    Megatron labels (-100 at its last token, loss mask 0 there), pad slots 0 / -100 / 0, arange positions going on
    into the pad slots, int32 boundaries (the padded ones only for multiple > 1), int32 0-dim max_seqlen."""
    g = torch.Generator().manual_seed(seed)
    physical = [-(-n // multiple) * multiple for n in lengths]
    total = sum(physical)
    ids, labels = torch.zeros(1, total, dtype=torch.long), torch.full((1, total), -100)
    loss_mask, positions = torch.zeros(1, total), torch.zeros(1, total, dtype=torch.long)
    start = 0
    for n, room in zip(lengths, physical):
        tokens = torch.randint(1, 100, (n,), generator=g)
        ids[0, start:start + n] = tokens
        labels[0, start:start + n - 1] = tokens[1:]
        loss_mask[0, start:start + n - 1] = 1
        positions[0, start:start + room] = torch.arange(room)
        start += room
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = dict(input_ids=ids, position_ids=positions, attention_mask=None, labels=labels, loss_mask=loss_mask,
                 cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=torch.tensor(max(physical), dtype=torch.int32),
                 max_seqlen_kv=torch.tensor(max(physical), dtype=torch.int32), total_tokens=total)
    if multiple > 1:
        padded = torch.tensor([0, *torch.tensor(physical).cumsum(0).tolist()], dtype=torch.int32)
        batch.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    return batch


def test_rows_of_the_pack():
    rows = rows_of_bridge_pack(bridge_pack())
    assert rows["attention_mask"].sum(1).tolist() == list(LENGTHS)
    assert int(rows["loss_mask"].sum()) == sum(LENGTHS) - len(LENGTHS)
    assert not any(key.startswith(("cu_seqlens", "max_seqlen")) or key == "total_tokens" for key in rows)


@pytest.mark.parametrize("host_reads", [False, True])
def test_a_target_between_documents_is_refused(host_reads):
    """Slot 7 is the alignment slot after the first document (7 tokens, 8 physical): a loss there (Bridge's loss
    counts it) was dropped with the slot. Its label alone, with loss_mask 0 there, trains nothing: kept out."""
    batch = bridge_pack()
    batch["labels"][0, 7], batch["loss_mask"][0, 7] = 5, 1.0
    with pytest.raises(ValueError, match=r"1 target .*loss_mask.* between documents .*slot 7,.*cu_seqlens_q_padded"):
        pack_batch(batch, label_style="megatron", host_reads=host_reads)
    batch["loss_mask"][0, 7] = 0.0
    assert int(pack_batch(batch, label_style="megatron").loss_mask.sum()) == sum(LENGTHS) - len(LENGTHS)


def test_a_label_between_documents_without_loss_mask_is_refused():
    batch = bridge_pack()
    del batch["loss_mask"]
    batch["labels"][0, 13] = 5  # the third document's second token (the second: slots 8-10, 11 empty)
    pack_batch(batch, label_style="megatron")
    batch["labels"][0, 11] = 5
    with pytest.raises(ValueError, match=r"1 target \(a label other than -100.* between documents .*slot 11, labels 5"):
        pack_batch(batch, label_style="megatron")


def test_kv_padded_without_q_padded_is_a_value_error():
    batch = bridge_pack()
    del batch["cu_seqlens_q_padded"]
    with pytest.raises(ValueError, match=r"cu_seqlens_kv_padded is given without cu_seqlens_q_padded"):
        rows_of_bridge_pack(batch)


def test_q_padded_without_kv_padded_is_taken():
    batch = bridge_pack()
    del batch["cu_seqlens_kv_padded"]
    assert torch.equal(rows_of_bridge_pack(batch)["input_ids"], rows_of_bridge_pack(bridge_pack())["input_ids"])


@pytest.mark.parametrize("key, value, message", [
    ("total_tokens", 20, r"total_tokens 20 .* 24 slots"),
    ("max_seqlen_q", torch.tensor(8, dtype=torch.int32), r"max_seqlen_q 8 .* longest document, 12 slots"),
    ("max_seqlen_kv", 2, r"max_seqlen_kv 2 .* longest document, 12 slots"),
])
def test_lengths_that_contradict_the_boundaries_are_refused(key, value, message):
    batch = bridge_pack()
    batch[key] = value
    with pytest.raises(ValueError, match=message):
        rows_of_bridge_pack(batch)


def test_a_larger_max_seqlen_is_an_upper_bound():
    batch = bridge_pack()
    batch.update(max_seqlen_q=4096, max_seqlen_kv=torch.tensor(4096))
    assert torch.equal(rows_of_bridge_pack(batch)["input_ids"], rows_of_bridge_pack(bridge_pack())["input_ids"])


@pytest.mark.parametrize("convert", [lambda t: t.long(), lambda t: t.tolist(), lambda t: tuple(t.tolist()),
                                     lambda t: t.numpy(), lambda t: [np.int64(v) for v in t.tolist()]],
                         ids=["int64", "list", "tuple", "numpy", "numpy ints"])
def test_boundaries_of_any_integer_form(convert):
    """Before, a numpy array or a list of numpy ints (a collate of the user's own in numpy) was refused."""
    batch = bridge_pack()
    for key in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        batch[key] = convert(batch[key])
    batch.update(max_seqlen_q=np.int32(12), total_tokens=np.int64(24))
    assert torch.equal(rows_of_bridge_pack(batch)["labels"], rows_of_bridge_pack(bridge_pack())["labels"])


@pytest.mark.parametrize("edit, message", [
    (lambda b: b.update(cu_seqlens_q=b["cu_seqlens_q"].float()), r"cu_seqlens_q must be .*int.* got .*float32"),
    (lambda b: b.update(cu_seqlens_q=b["cu_seqlens_q"][None]), r"cu_seqlens_q must be \[N \+ 1\].* got .*\(1, 4\)"),
    (lambda b: b.update(max_seqlen_q=torch.tensor([12, 12])), r"max_seqlen_q must be an int .* got .*\(2,\)"),
    (lambda b: b.update(cu_seqlens_q=b["cu_seqlens_q"].numpy().astype(np.float64)),
     r"cu_seqlens_q must be .*int.* got .*float64 array of shape \(4,\)"),
    (lambda b: b.update(total_tokens=24.0), r"total_tokens must be an int .* got 24.0"),
    (lambda b: b.update(cu_seqlens_q=[0, 7, True, 22]), r"cu_seqlens_q must be .* got \[0, 7, True, 22\]"),
])
def test_boundaries_of_another_form_are_refused(edit, message):
    batch = bridge_pack()
    edit(batch)
    with pytest.raises(ValueError, match=message):
        rows_of_bridge_pack(batch)


def test_one_host_read():
    """The 4 boundary tensors, both 0-dim max_seqlen and the count of targets between documents: one read."""
    batch = bridge_pack()
    with count_host_syncs() as syncs:
        rows_of_bridge_pack(batch)
    assert syncs.total == 1, syncs.report()


@pytest.mark.parametrize("label_style", ["hf", "megatron"])
@pytest.mark.parametrize("key", ["total_tokens", "max_seqlen_q"])
def test_a_users_own_key_by_a_bridge_name(label_style, key):
    """A batch of the user's own with `total_tokens` (their own count) and no boundaries is no Bridge pack: the
    error says so and to rename it, under either style, instead of calling it Bridge's collate output."""
    batch = dict(input_ids=torch.ones(2, 4, dtype=torch.long), labels=torch.ones(2, 4, dtype=torch.long))
    batch[key] = 8
    with pytest.raises(ValueError, match=rf"carries \['{key}'\], .*without its cu_seqlens_q.*rename"):
        pack_batch(batch, label_style=label_style)


def test_a_pack_of_the_users_own_with_unshifted_labels():
    """A [1, T] pack of the user's own under Bridge's key names with Hugging Face labels (-100 at each document's
    first token, as DataCollatorWithFlattening writes them): "hf" was told to use "megatron", and "megatron" to
    use "hf" (the labels check), a loop. The "hf" error now says what takes it, and that does: the same row with
    `document_lengths`, each document's labels shifted inside it."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (1, 26), generator=g)
    labels = ids.clone()
    labels[0, [0, 9, 15]] = -100
    cu = torch.tensor([0, 9, 15, 26], dtype=torch.int32)
    hint = r"A pack of your own with unshifted labels .* document_lengths \[\[9, 6, 11\]\] .* label_style='hf'"
    with pytest.raises(ValueError, match=hint):
        pack_batch(dict(input_ids=ids, labels=labels, cu_seqlens_q=cu, cu_seqlens_kv=cu), label_style="hf")
    packed = pack_batch(dict(input_ids=ids, labels=labels, document_lengths=[[9, 6, 11]]), label_style="hf")
    assert packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 9, 15, 26]
    assert int((packed.labels != -100).sum()) == 26 - 3  # each document's last token has no target
