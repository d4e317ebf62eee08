"""Input ids no packer checked (a `transform=`, a `dataclasses.replace`, a micro-batch built by hand) reaching a
Megatron-Core LLaVAModel through the step are checked as the other adapters check theirs: every slot in
[0, vocab_size), except LLaVA's image token (`LLaVAAdapter.unembedded_token_id`: the model replaces it before its
embedding, and LLaVA's default, -200, is negative). The ids ride the step's one read of what no packer checked.

Before, LLaVA's adapter checked no such ids: at TP=1 an id >= the vocabulary (or a negative one other than the
image token) was an IndexError inside the embedding; at TP > 1 the vocab-parallel embedding masks it on every rank,
so it became a zero embedding and trained silently (tests/llava/llava_workers.py: TP=2 + SP, 2 processes). The
packers' ids (`pack_llava_batch`, `pad_llava_batch`, `LlavaPackingCollator`) cost no read: they were checked
when packed (tests/perf/test_llava_sync_budget.py: 1 host sync in the step, 0 with the collator).

Real Megatron-Core LLaVAModel (tiny, CPU, one process; the TP=2 case from the 2-process launch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.llava_reference import IMG, T, build_tiny_llava, collated
from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs

R = dataclasses.replace
VOCAB = 128  # build_tiny_llava's language_vocab_size
NEGATIVE_IMAGE_TOKEN = -200  # LLaVA's default (DEFAULT_IMAGE_TOKEN_INDEX): outside the vocabulary
ROWS = ((T, T, T), (IMG, IMG, T, T), (T, IMG, T, T, IMG))


@pytest.fixture(scope="module")
def models(single_process_megatron):
    """{image token id: the tiny LLaVA with it}: 127 (inside the vocabulary) and -200 (LLaVA's default)."""
    from megatron_vlm_packing.patches import apply_llava_packed_boundaries, undo_llava_packed_boundaries

    apply_llava_packed_boundaries()  # packed LLaVA needs its boundaries expanded (the step refuses it unpatched)
    negative = build_tiny_llava(0)
    negative.image_token_index = NEGATIVE_IMAGE_TOKEN  # what LLaVAModel's forward reads
    yield {IMG: build_tiny_llava(0), NEGATIVE_IMAGE_TOKEN: negative}
    undo_llava_packed_boundaries()


def _batch(image_token: int) -> dict:
    batch = collated(ROWS, label_style="hf", seed=4)
    return {**batch, "input_ids": torch.where(batch["input_ids"] == IMG, image_token, batch["input_ids"])}


def _own_ids(value: int | None, image_token: int, where: list):
    """A transform giving the micro-batch ids of its own: a copy, with `value` at its first real text slot (its
    (row, position) appended to `where`)."""
    def transform(mb):
        ids = mb.input_ids.clone()
        if value is not None:
            row, position = (int(i) for i in torch.nonzero((ids != image_token) & ~mb.padding_mask)[0])
            ids[row, position] = value
            where.append((row, position))
        return R(mb, input_ids=ids)
    return transform


@pytest.mark.parametrize("image_token", [IMG, NEGATIVE_IMAGE_TOKEN])
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("value", [VOCAB, VOCAB + 1000, -100, -1])
def test_a_text_id_outside_the_vocabulary_is_refused(models, image_token, pack, value):
    where = []
    with pytest.raises(ValueError, match=rf"input_ids row \d+ position \d+ is {value}: token ids must lie in "
                                         rf"\[0, {VOCAB}\)") as error:
        step_loss(models[image_token], _batch(image_token), pack=pack, transform=_own_ids(value, image_token, where))
    row, position = where[0]
    assert f"input_ids row {row} position {position} is {value}" in str(error.value)


@pytest.mark.parametrize("pack", [True, False])
def test_the_image_token_outside_the_vocabulary_is_not_refused(models, pack):
    """-200 is never embedded: ids of its own holding it train as the packer's."""
    model, batch = models[NEGATIVE_IMAGE_TOKEN], _batch(NEGATIVE_IMAGE_TOKEN)
    expected = step_loss(model, batch, pack=pack)
    assert step_loss(model, batch, pack=pack, transform=_own_ids(None, NEGATIVE_IMAGE_TOKEN, [])) == \
        pytest.approx(expected, rel=1e-6)


def _step_syncs(model, batch, **options) -> int:
    with count_host_syncs() as syncs:
        step_loss(model, batch, **options)
    return syncs.total


def _own_fields(mb):
    """Ids, labels, loss weights and positions of its own (equal copies: no fault)."""
    return R(mb, input_ids=mb.input_ids.clone(), labels=mb.labels.clone(), loss_mask=mb.loss_mask.clone(),
             position_ids=mb.position_ids.clone())


@pytest.mark.parametrize("image_token", [IMG, NEGATIVE_IMAGE_TOKEN])
@pytest.mark.parametrize("pack", [True, False])
def test_ids_of_its_own_ride_the_steps_one_read(models, image_token, pack):
    """One read more than the packer's micro-batch for all the fields of its own, the ids among them (the packers'
    ids are marked: none for theirs)."""
    model, batch = models[image_token], _batch(image_token)
    step_syncs = _step_syncs(model, batch, pack=pack)  # the first call builds the adapter: counted after
    packers = _step_syncs(model, batch, pack=pack)
    assert step_syncs == packers
    assert _step_syncs(model, batch, pack=pack, transform=_own_fields) - packers == 1
    assert _step_syncs(model, batch, pack=pack, transform=_own_ids(None, image_token, [])) - packers == 1


def test_a_loader_micro_batch_costs_no_read_for_its_ids(models):
    """`LlavaPackingCollator`'s ids are marked as the step's packer's; a space without the vocabulary has them
    checked in host memory by the step (`check_loader_vocab`), which marks them too."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator

    model = models[NEGATIVE_IMAGE_TOKEN]
    batch = _batch(NEGATIVE_IMAGE_TOKEN)
    space = LlavaSpace.of(model)
    with_vocab = LlavaPackingCollator(space=space)(batch)
    spaceless = LlavaPackingCollator(space=R(space, vocab_size=None))(batch)
    _step_syncs(model, with_vocab)  # the adapter is built on the first call
    assert _step_syncs(model, spaceless) == _step_syncs(model, with_vocab)
    assert step_loss(model, spaceless) == pytest.approx(step_loss(model, with_vocab))


def test_the_packers_ids_mark_follows_its_ids_and_excepts_only_its_image_token(models):
    """Kept through the moves, a pickle (a DataLoader worker's) and `replace` of other fields; ids of their own are
    not vouched for, nor these for a model that embeds every id (no id excepted)."""
    import pickle

    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator, pack_llava_batch
    from megatron_vlm_packing.packing.collate import micro_batch_to, own_storages

    space = LlavaSpace.of(models[NEGATIVE_IMAGE_TOKEN])
    packed = pack_llava_batch(_batch(NEGATIVE_IMAGE_TOKEN), space, label_style="hf")
    loader = LlavaPackingCollator(space=space)(_batch(NEGATIVE_IMAGE_TOKEN))
    kept = (packed, loader, micro_batch_to(loader, "cpu"), own_storages(loader), pickle.loads(pickle.dumps(loader)),
            R(loader, labels=loader.labels.clone()))
    assert all(mb.ids_checked(VOCAB, NEGATIVE_IMAGE_TOKEN) for mb in kept)
    assert not loader.ids_checked(VOCAB)  # -200 is in its ids: a model that embeds it must read them
    assert not loader.ids_checked(VOCAB - 1, NEGATIVE_IMAGE_TOKEN)  # checked below 128, not below 127
    assert not R(loader, input_ids=loader.input_ids.clone()).ids_checked(VOCAB, NEGATIVE_IMAGE_TOKEN)


def test_a_bad_id_is_named_after_the_steps_read_and_the_adapters_other_refusals(models):
    """Labels (the step's read) before ids; an input the adapter does not consume before ids (its check)."""
    model, batch = models[IMG], _batch(IMG)
    bad_ids = _own_ids(VOCAB, IMG, [])

    def bad_labels_too(mb):
        mb = bad_ids(mb)
        labels = mb.labels.clone()
        labels[0, 1] = -7
        return R(mb, labels=labels)

    with pytest.raises(ValueError, match=r"labels .* is -7: a label must be -100"):
        step_loss(model, batch, transform=bad_labels_too)
    extra = lambda mb: R(bad_ids(mb), extras={"token_types": torch.zeros_like(mb.input_ids)})  # noqa: E731
    with pytest.raises(ValueError, match=r"the micro-batch carries \['extra:token_types'\]"):
        step_loss(model, batch, transform=extra)


@pytest.mark.parametrize("value", [VOCAB, VOCAB + 1000, -1])
@pytest.mark.parametrize("pack", [True, False])
def test_under_tp2_a_bad_id_is_refused_not_trained_as_a_zero_embedding(value, pack):
    """TP=2 + SP: Megatron's vocab-parallel embedding masks an id outside every rank's shard (a zero embedding):
    before, the step trained such a micro-batch (a finite loss), silently."""
    from tests.llava.llava_workers import launch

    seen = launch()["TP=2+SP, hand-built ids"][f"{value}, pack={pack}"]
    assert seen.startswith("refused: input_ids row ") and f"is {value}: token ids must lie in [0, {VOCAB})" in seen, \
        seen
    assert launch()["TP=2+SP, hand-built ids"]["clean copy"] == "trained as the packer's"
