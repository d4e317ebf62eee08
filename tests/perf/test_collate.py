"""PackingCollator in a real DataLoader worker: the same micro-batch as pack_batch, every CP rank's
index built in the worker, pinning and moving keep shared boundaries shared, layouts checked."""

import dataclasses

import pytest
import torch
from torch.utils.data import DataLoader

from megatron_vlm_packing.data import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import MicroBatch, PackMultiples, pack_batch
from megatron_vlm_packing.packing.arena import all_in_one_storage
from megatron_vlm_packing.packing.collate import (
    LoaderMicroBatch, PackingCollator, check_layout, micro_batch_to, own_storages, tensors_of,
)
from megatron_vlm_packing.parallel.cp import cp_partition_index
from megatron_vlm_packing.rope import MRopeConfig

DATA = SyntheticVLMConfig(max_text=24, max_images=2, grid_choices=(2, 4))
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=DATA.image_token_id, video_token_id=DATA.vocab_size + 1,
                   vision_start_token_id=DATA.vision_start_id, mrope_section=(1, 1, 2))


def test_a_worker_packs_what_pack_batch_packs_with_every_cp_index():
    samples = synthetic_samples(8, seed=2, cfg=DATA)
    collator = PackingCollator(collate=collate, cp_size=2, mrope=ROPE)
    loader = DataLoader(samples, batch_size=4, num_workers=1, collate_fn=collator)
    for i, packed in enumerate(loader):  # built in the worker process, pickled back
        assert isinstance(packed, LoaderMicroBatch) and isinstance(packed, MicroBatch)
        assert all_in_one_storage(tensors_of(packed))  # still one storage after the worker sent it
        expected = pack_batch(collate(samples[4 * i:4 * i + 4]), cp_size=2, label_style="hf", mrope=ROPE)
        for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
            assert torch.equal(getattr(packed, name), getattr(expected, name)), name
        assert torch.equal(packed.vision.pixel_values, expected.vision.pixel_values)
        assert packed.position_ids.shape[0] == 3  # mRoPE positions computed in the worker
        assert packed.mrope_config == ROPE  # the config that made them, pickled back with them
        cu = expected.packed_seq_params.cu_seqlens_q_padded
        cached = packed.indices.__dict__["_cp_indices"]  # built in the worker, not in the step
        for rank in (0, 1):
            assert torch.equal(cached[(2, rank)], cp_partition_index(cu, 2, rank))


def test_the_config_that_made_the_positions_travels_with_the_micro_batch():
    """`mrope_config` (what the step compares with the model's) survives every move and the CP cut; None when
    no MRopeConfig made the positions (1D, or a callable's: it cannot be compared)."""
    from functools import partial

    from megatron_vlm_packing.packing.collate import map_tensors
    from megatron_vlm_packing.packing.localize import LocalizeNeeds, localize
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.rope import get_rope_index

    batch = collate(synthetic_samples(4, seed=8, cfg=DATA))
    packed = PackingCollator(cp_size=2, mrope=ROPE)(batch)
    moved = micro_batch_to(packed, torch.device("cpu"))
    for copy in (moved, map_tensors(packed, lambda t: t.clone()), own_storages(packed),
                 dataclasses.replace(packed, labels=packed.labels.clone())):
        assert copy.mrope_config == ROPE
    for rank, needs in ((0, LocalizeNeeds(full_input_ids=True, full_position_ids=True)), (1, LocalizeNeeds())):
        local = localize(moved, ParallelLayout(cp_size=2, cp_rank=rank), needs)
        assert local.cp_index is not None and local.mrope_config == ROPE
    ids = dict(image_token_id=DATA.image_token_id)
    assert PackingCollator(pack_options=ids)(batch).mrope_config is None
    by_callable = PackingCollator(mrope=partial(get_rope_index, config=ROPE), pack_options=ids)(batch)
    assert by_callable.position_ids.dim() == 3 and by_callable.mrope_config is None


def test_moving_keeps_the_boundaries_shared_and_the_type():
    packed = PackingCollator(cp_size=2, pack_options=dict(image_token_id=DATA.image_token_id))(
        collate(synthetic_samples(3, seed=4, cfg=DATA)))
    moved = micro_batch_to(packed, torch.device("cpu"))
    assert type(moved) is LoaderMicroBatch
    assert moved.packed_seq_params.cu_seqlens_q_padded is moved.indices.cu_seqlens_padded
    assert moved.rope_cu_seqlens is moved.indices.cu_seqlens
    assert torch.equal(moved.indices.cp_index(2, 1), packed.indices.cp_index(2, 1))


@pytest.mark.parametrize("device, message", [
    ("nope", r"device must be a torch.device or a device string such as 'cpu' or 'cuda:0', got 'nope'"),  # torch's
    (None, r"got None"),  # Tensor.to(None) returned each tensor where it was: nothing moved   # RuntimeError
    (2.5, r"got 2\.5"), (True, r"got True"), ("cuda:x", r"got 'cuda:x'"), (-1, r"got -1"),
])
def test_moving_to_what_is_no_device_is_a_value_error(device, message):
    ids = torch.ones(1, 4, dtype=torch.long)
    packed = pack_batch({"input_ids": ids, "labels": ids}, label_style="hf")
    with pytest.raises(ValueError, match=message):
        micro_batch_to(packed, device)
    assert micro_batch_to(packed, "cpu").input_ids.device == torch.device("cpu")


def test_host_arrays_of_the_indices_stay_in_the_worker():
    """numpy caches of `PackIndices` (rebuilt from the plan) are not pickled by value next to the tensors
    that share their memory, nor carried to a device; a copy rebuilds them equal."""
    import pickle

    import numpy as np

    samples = collate(synthetic_samples(4, seed=5, cfg=DATA))
    text_only = {k: samples[k] for k in ("input_ids", "labels", "attention_mask")}
    packed = pack_batch(text_only, label_style="hf", host_reads=True)  # 1D positions: viewed from the host offsets
    assert any(isinstance(v, np.ndarray) for v in packed.indices.__dict__.values())
    state = packed.indices.__getstate__()
    assert not any(isinstance(v, np.ndarray) for v in state.values())
    copy = pickle.loads(pickle.dumps(packed.indices))
    assert np.array_equal(copy.offset_in_segment_host, packed.indices.offset_in_segment_host)
    moved = micro_batch_to(packed, torch.device("cpu"))
    assert not any(isinstance(v, np.ndarray) for v in moved.indices.__dict__.values())


@pytest.mark.parametrize("cp_size", [1, 2])
def test_a_loader_micro_batch_is_one_storage_moved_once(cp_size):
    """A worker sends one storage, not one per tensor (each costs a shared-memory file); pinning and the
    move to the device copy that one buffer once, and every tensor keeps its values."""
    from megatron_vlm_packing.packing.arena import all_in_one_storage
    from megatron_vlm_packing.packing.collate import map_tensors, tensors_of

    batch = collate(synthetic_samples(4, seed=6, cfg=DATA))
    packed = PackingCollator(cp_size=cp_size, mrope=ROPE)(batch)
    expected = pack_batch(batch, cp_size=cp_size, label_style="hf", mrope=ROPE)
    tensors = tensors_of(packed)
    assert len(tensors) > 8 and all_in_one_storage(tensors)
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(packed, name), getattr(expected, name)) and \
            getattr(packed, name).dtype == getattr(expected, name).dtype, name
    assert torch.equal(packed.vision.pixel_values, expected.vision.pixel_values)
    moves = []
    moved = map_tensors(packed, lambda t: moves.append(t) or t.clone())
    assert len(moves) == 1 and moves[0].dtype == torch.uint8  # the buffer, once
    assert all_in_one_storage(tensors_of(moved))
    for name in ("input_ids", "labels", "position_ids", "padding_mask"):
        assert torch.equal(getattr(moved, name), getattr(packed, name)), name
    assert moved.packed_seq_params.cu_seqlens_q is moved.indices.cu_seqlens
    if cp_size > 1:
        assert torch.equal(moved.indices.cp_index(2, 1), expected.indices.cp_index(2, 1))


def test_a_micro_batch_packed_for_another_layout_is_refused():
    packed = PackingCollator(cp_size=2, pack_options=dict(image_token_id=DATA.image_token_id))(
        collate(synthetic_samples(3, seed=4, cfg=DATA)))
    check_layout(packed, PackMultiples.for_parallel(cp_size=2))
    with pytest.raises(ValueError, match="packed for PackMultiples\\(segment=4, total=4\\) but the model's layout "
                                         "needs PackMultiples\\(segment=1, total=2\\)"):
        check_layout(packed, PackMultiples.for_parallel(tp_size=2, sequence_parallel=True))


@pytest.mark.parametrize("options, message", [
    (dict(extra_keys=("w",)), r"PackingCollator sets \['extra_keys'\] itself: give extra_keys= to PackingCollator"),
    (dict(cp_size=2, label_style="hf"), r"sets \['cp_size', 'label_style'\] itself"),
    (dict(image_token=5), r"\['image_token'\] are not pack_batch keywords; PackingCollator passes on any of "
                          r"\[.*'image_token_id'"),
    ([("image_token_id", 5)], r"options must be a dict of pack_batch keywords, got list"),
])
def test_collator_options_are_checked_when_it_is_built(options, message):
    """Not as a TypeError in a DataLoader worker at the first batch."""
    with pytest.raises(ValueError, match=message):
        PackingCollator(pack_options=options)


@pytest.mark.parametrize("options, message", [
    (dict(label_style="HF"), r"label_style must be 'megatron' or 'hf', got 'HF'"),
    (dict(pad_to="64"), r"pad_to must be an int \(the packed length T\) or None, got '64'"),
    (dict(pad_token_id=-1), r"pad_token_id must be a non-negative int \(the id written at pad slots\), got -1"),
    (dict(extra_keys=None), r"extra_keys must be a tuple of batch key names"),
    (dict(mrope="qwen2_vl"), r"mrope must be an MRopeConfig, a callable or None, got str"),
])
def test_collator_fields_are_checked_when_it_is_built(options, message):
    """Each was accepted here and refused only in a DataLoader worker, at the first batch."""
    with pytest.raises(ValueError, match=message):
        PackingCollator(**options)


@pytest.mark.parametrize("collate", [3, "my_collate", [len]])
def test_a_collate_that_cannot_be_called_is_refused_when_the_collator_is_built(collate):
    """Was a TypeError ('int' object is not callable) in a DataLoader worker at the first batch."""
    with pytest.raises(ValueError, match=r"PackingCollator.s collate must be a callable \(samples -> batch dict\) or None, got "):
        PackingCollator(collate=collate)


@pytest.mark.parametrize("key", ["input_ids", "labels"])
def test_a_meta_tensor_in_the_collated_batch_is_named(key):
    """Was a NotImplementedError ('Cannot copy out of meta tensor') from the collator's move to the host."""
    batch = collate(synthetic_samples(2, seed=1, cfg=DATA))
    batch[key] = batch[key].to("meta")
    with pytest.raises(ValueError, match=f"{key} is a meta tensor: it holds no values for "
                                         "pack_batch/pad_batch to read"):
        PackingCollator(label_style="megatron", pack_options=dict(image_token_id=DATA.image_token_id))(batch)


@pytest.mark.parametrize("value", [None, {"input_ids": torch.zeros(1, 4)}])
def test_moving_or_saving_something_that_is_not_a_micro_batch_is_named(value):
    """micro_batch_to / map_tensors were AttributeErrors ('indices'); own_storages returned it as it was, so
    torch.save of a dict of a micro-batch's fields still refused its views."""
    from megatron_vlm_packing.packing.collate import map_tensors

    message = rf"takes a MicroBatch \(what the collators return\), got {type(value).__name__}"
    for call in (lambda: micro_batch_to(value, torch.device("cpu")), lambda: map_tensors(value, lambda t: t),
                 lambda: own_storages(value)):
        with pytest.raises(ValueError, match=message):
            call()


def test_the_collator_needs_a_batch_dict():
    with pytest.raises(ValueError, match="give collate="):
        PackingCollator()(synthetic_samples(2, seed=1, cfg=DATA))


def test_an_empty_list_of_samples_is_named():
    """The synthetic data's collate (the demo's, `megatron_vlm_packing.data.collate`) given no samples raised
    "max() iterable argument is empty", naming nothing."""
    with pytest.raises(ValueError, match=r"collate got no samples: a batch needs at least one"):
        PackingCollator(collate=collate, mrope=ROPE)([])


def test_one_storage_keeps_every_dtype_shape_and_value_at_aligned_offsets():
    from megatron_vlm_packing.packing.arena import ALIGN, all_in_one_storage, byte_offset, into_one_storage

    tensors = [torch.tensor([True, False, True]), torch.arange(5, dtype=torch.int64).view(1, 5),
               torch.randn(3, 2, dtype=torch.bfloat16), torch.tensor(7, dtype=torch.int32),
               torch.empty(0, 4), torch.randn(2, 3).t()]  # the last one is not contiguous
    copies = into_one_storage(tensors)
    copied = [copies[id(t)] for t in tensors]
    assert all_in_one_storage(copied)
    for original, copy in zip(tensors, copied):
        assert copy.dtype == original.dtype and copy.shape == original.shape and torch.equal(copy, original)
        assert copy.is_contiguous() and byte_offset(copy) % ALIGN == 0
    tensors[1][0, 0] = 99
    assert copies[id(tensors[1])][0, 0] == 0  # copies, not views of the inputs


def test_one_storage_refuses_autograd_tensors():
    from megatron_vlm_packing.packing.arena import into_one_storage

    with pytest.raises(ValueError, match="requires_grad=True"):
        into_one_storage([torch.zeros(2, requires_grad=True)])


def test_tensors_of_finds_every_tensor_a_move_touches():
    """`tensors_of` walks the micro-batch without rebuilding it; what it finds must be exactly what
    `map_tensors` moves tensor by tensor (media, extras, boundaries and every CP index included), or an
    arena micro-batch would keep a tensor outside its one storage."""
    from megatron_vlm_packing.packing.collate import _map_each, tensors_of

    batch = collate(synthetic_samples(4, seed=3, cfg=DATA))
    batch["token_type"] = torch.ones_like(batch["input_ids"])
    packed = pack_batch(batch, cp_size=2, label_style="hf", mrope=ROPE, extra_keys=("token_type",))
    packed.indices.cp_index(2, 0), packed.indices.cp_index(2, 1)
    packed.indices.is_real  # noqa: B018 (cached)
    moved: dict[int, torch.Tensor] = {}
    _map_each(packed, lambda t: moved.setdefault(id(t), t))
    found = tensors_of(packed)
    assert {id(t) for t in found} == set(moved) and len(found) == len(moved) > 10


def test_large_tensors_keep_their_storage_and_move_on_their_own(monkeypatch):
    """Pixels of a VLM micro-batch (tens of MB) are not copied into the buffer: the worker sends them as
    they are, and a move copies the buffer once plus each large tensor once."""
    from megatron_vlm_packing.packing import arena
    from megatron_vlm_packing.packing.collate import map_tensors, tensors_of

    monkeypatch.setattr(arena, "LARGE_BYTES", 4096)  # the synthetic pixels: 3 images of 16 patches x 48 floats
    monkeypatch.setattr("megatron_vlm_packing.packing.collate.LARGE_BYTES", 4096)
    batch = collate(synthetic_samples(4, seed=6, cfg=DATA))
    packed = PackingCollator(mrope=ROPE)(batch)
    pixels = packed.vision.pixel_values
    assert pixels.numel() * pixels.element_size() >= 4096
    assert pixels.data_ptr() == batch["pixel_values"].data_ptr()  # not copied
    buffer, inside = arena.arena_of(tensors_of(packed))
    assert id(pixels) not in inside and id(packed.input_ids) in inside
    assert not arena.all_in_one_storage(tensors_of(packed))
    moves = []
    moved = map_tensors(packed, lambda t: moves.append(t) or t.clone())
    assert len(moves) == 2 and {m.data_ptr() for m in moves} == {buffer.data_ptr(), pixels.data_ptr()}
    assert torch.equal(moved.vision.pixel_values, pixels) and torch.equal(moved.input_ids, packed.input_ids)
    assert arena.arena_of(tensors_of(moved)) is not None


def test_a_storage_with_bytes_no_view_holds_is_not_taken_for_the_buffer():
    """Two views of one batch tensor share a storage that also holds other bytes: moving it whole would
    move what the micro-batch does not hold, so each view moves on its own."""
    from megatron_vlm_packing.packing.arena import arena_of, into_one_storage

    rows = torch.arange(40).view(4, 10)
    assert arena_of([rows[0], rows[2]]) is None
    copies = into_one_storage([rows[0], rows[2]])
    assert arena_of(list(copies.values())) is not None
    assert arena_of([*copies.values(), torch.zeros(0)]) is not None  # empty tensors take no room


def test_every_media_kind_and_a_bfloat16_extra_cross_the_worker_unchanged():
    """Images, a video, audio clips and a bfloat16 per-token extra: what the worker sends (small tensors
    in one buffer) is, field by field, what pack_batch packs in process."""
    import dataclasses

    media = SyntheticVLMConfig(max_text=10, max_images=2, grid_choices=(2, 4), max_videos=1, max_audios=2)
    samples = synthetic_samples(6, seed=5, cfg=media)

    def with_extra(chunk):
        batch = collate(chunk)
        batch["token_weight"] = torch.rand(batch["input_ids"].shape, generator=torch.Generator().manual_seed(1),
                                           dtype=torch.float32).to(torch.bfloat16)
        return batch

    options = dict(image_token_id=media.image_token_id, video_token_id=media.video_token_id,
                   audio_token_id=media.audio_token_id)
    collator = PackingCollator(collate=with_extra, cp_size=2, extra_keys=("token_weight",), pack_options=options)
    loader = DataLoader(samples, batch_size=3, num_workers=1, collate_fn=collator)
    kinds = set()
    for i, packed in enumerate(loader):
        expected = pack_batch(with_extra(samples[3 * i:3 * i + 3]), cp_size=2, label_style="hf",
                              extra_keys=("token_weight",), **options)
        assert all_in_one_storage(tensors_of(packed))
        kinds |= {"video"} if packed.vision.pixel_values_videos is not None else set()
        kinds |= {"audio"} if packed.audio is not None else set()
        for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
            assert torch.equal(getattr(packed, name), getattr(expected, name)), name
        for holder in ("vision", "audio", "packed_seq_params"):
            got, want = getattr(packed, holder), getattr(expected, holder)
            assert (got is None) == (want is None), holder
            for field in dataclasses.fields(want) if want is not None else ():
                value = getattr(want, field.name)
                if isinstance(value, torch.Tensor):
                    assert torch.equal(getattr(got, field.name), value) and \
                        getattr(got, field.name).dtype == value.dtype, (holder, field.name)
                else:
                    assert getattr(got, field.name) == value, (holder, field.name)
        assert packed.extras["token_weight"].dtype == torch.bfloat16
        assert torch.equal(packed.extras["token_weight"], expected.extras["token_weight"])
    assert kinds == {"video", "audio"}


def test_tensors_carrying_autograd_are_not_copied_into_the_buffer():
    """pack_batch packs grad-carrying inputs (a loss mask with autograd packs with torch); the buffer's
    copy would cut the graph, so those tensors stay out of it and the collator returns what pack_batch does."""
    batch = collate(synthetic_samples(4, seed=0, cfg=DATA))
    batch["pixel_values"].requires_grad_(True)
    batch["loss_mask"] = torch.ones(batch["input_ids"].shape, requires_grad=True)
    packed = PackingCollator(pack_options=dict(image_token_id=DATA.image_token_id))(batch)
    expected = pack_batch(batch, label_style="hf", image_token_id=DATA.image_token_id)
    assert packed.vision.pixel_values is batch["pixel_values"] and packed.loss_mask.requires_grad
    assert torch.equal(packed.loss_mask, expected.loss_mask) and torch.equal(packed.input_ids, expected.input_ids)
    packed.loss_mask.sum().backward()  # the graph reaches the batch: 1 per packed target, 0 at pad slots
    grad = batch["loss_mask"].grad
    assert grad.sum() == torch.count_nonzero(packed.loss_mask) > 0 and not grad[batch["attention_mask"] == 0].any()


def test_a_view_of_a_buffer_that_is_itself_a_view_starts_where_that_view_does():
    """`map_tensors` rebuilds views on whatever its move returned; a move may return a view of a larger
    storage (its own offset then counts)."""
    from megatron_vlm_packing.packing.arena import view_at

    whole = torch.arange(32, dtype=torch.int64).view(torch.uint8)  # 256 bytes
    buffer = whole[64:]  # a view starting 8 int64 in
    like = torch.zeros(2, 3, dtype=torch.int64)
    view = view_at(buffer, 8, like)  # one int64 further
    assert view.shape == (2, 3) and view.dtype == torch.int64 and view.tolist() == [[9, 10, 11], [12, 13, 14]]
    assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


@pytest.mark.parametrize("fn, got", [(lambda t: t.float(), r"torch.float32 \(\d+,\)"),
                                     (lambda t: t.to(torch.bfloat16), r"torch.bfloat16 \(\d+,\)"),
                                     (lambda t: t[:64], r"torch.uint8 \(64,\)"),
                                     (lambda t: None, "NoneType")])
def test_a_function_that_is_not_a_move_is_refused_not_applied_to_the_buffer(fn, got):
    """`map_tensors` rebuilds the views by byte offset on what `fn` made of the buffer: a cast would give
    int64 ids the bytes of floats (silently wrong), so it is a ValueError naming what `fn` returned."""
    from megatron_vlm_packing.packing.collate import map_tensors

    packed = PackingCollator(mrope=ROPE)(collate(synthetic_samples(4, seed=6, cfg=DATA)))
    with pytest.raises(ValueError, match=r"fn must keep each tensor's dtype and shape .* it turned the "
                                         r"micro-batch's buffer \(torch.uint8 \(\d+,\)\) into " + got):
        map_tensors(packed, fn)


def test_the_collators_take_any_mapping_pack_batch_takes():
    """A Hugging Face processor's BatchFeature is a UserDict, not a dict: pack_batch and pack_llava_batch
    pack it, so the collators must not refuse it (as "give collate=", when a collate was given)."""
    from collections import UserDict

    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator, pack_llava_batch

    batch = collate(synthetic_samples(3, seed=4, cfg=DATA))
    collator = PackingCollator(collate=lambda chunk: UserDict(collate(chunk)), mrope=ROPE)
    packed = collator(synthetic_samples(3, seed=4, cfg=DATA))
    expected = pack_batch(batch, label_style="hf", mrope=ROPE)
    assert torch.equal(packed.input_ids, expected.input_ids) and torch.equal(packed.position_ids, expected.position_ids)
    ids = torch.tensor([[5, 6, 7], [127, 8, 9]])
    # HF labels, the default style (`ids + 1`, row 0 Megatron-style, is refused as a sample on its own counts)
    labels = torch.where(ids == 127, -100, ids)
    llava = UserDict({"input_ids": ids, "labels": labels, "images": torch.zeros(1, 3, 2, 2)})
    space = LlavaSpace(img_seq_len=4, image_token_index=127)
    packed = LlavaPackingCollator(space=space)(llava)
    assert torch.equal(packed.input_ids, pack_llava_batch(llava, space, label_style="hf").input_ids)


def test_a_worker_refuses_a_micro_batch_carrying_a_graph_instead_of_hanging():
    """A loss mask with autograd packs into a non-leaf tensor; torch's worker queue cannot pickle it, drops
    the micro-batch and the loader waits forever (here: times out). The worker names the field instead."""
    ids = torch.tensor([[5, 6, 7], [1, 8, 0]])

    def with_grad(_):
        return {"input_ids": ids, "labels": ids, "attention_mask": (ids != 0).long(),
                "loss_mask": torch.ones(2, 3, requires_grad=True)}

    loader = DataLoader([0], batch_size=None, num_workers=1, timeout=30,
                        collate_fn=PackingCollator(collate=with_grad))
    with pytest.raises(ValueError, match=r"\['loss_mask'\] carry autograd .* a DataLoader worker cannot send them"):
        next(iter(loader))


def test_a_collated_micro_batch_saves_once_its_tensors_own_their_storage(tmp_path):
    """torch.save refuses views of one storage in different dtypes (the collators' buffer); own_storages
    copies them out, and what is saved loads back equal, field by field, boundaries still shared."""
    packed = PackingCollator(cp_size=2, mrope=ROPE)(collate(synthetic_samples(4, seed=7, cfg=DATA)))
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save(packed, tmp_path / "as_collated.pt")
    saveable = own_storages(packed)
    assert len({t.untyped_storage().data_ptr() for t in tensors_of(saveable)}) == len(tensors_of(saveable))
    torch.save(saveable, tmp_path / "micro_batch.pt")
    torch.save({name: getattr(saveable, name) for name in ("input_ids", "labels", "loss_mask", "position_ids")},
               tmp_path / "fields.pt")  # the dict `megatron-vlm-packing check` reads
    loaded = torch.load(tmp_path / "micro_batch.pt", weights_only=False)
    assert type(loaded) is LoaderMicroBatch
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(loaded, name), getattr(packed, name)), name
    assert torch.equal(loaded.vision.pixel_values, packed.vision.pixel_values)
    assert loaded.packed_seq_params.cu_seqlens_q is loaded.indices.cu_seqlens
    assert own_storages(saveable) is saveable  # no buffer left: nothing to copy


@pytest.fixture(scope="module")
def tiny_llava(single_process_megatron):
    from megatron_vlm_packing.patches import apply_llava_packed_boundaries, undo_llava_packed_boundaries
    from megatron_vlm_packing.testing.llava_reference import build_tiny_llava

    apply_llava_packed_boundaries()  # packed LLaVA needs its boundaries expanded (the step refuses it unpatched)
    yield build_tiny_llava(0)
    undo_llava_packed_boundaries()


def test_a_llava_image_token_beyond_the_vocabulary_is_not_refused_by_the_loaders_vocabulary_check(tiny_llava):
    """LLaVAModel replaces its image tokens before the embedding, so an image token id >= the vocabulary is
    valid (pack_llava_batch does not screen it). A LlavaPackingCollator whose space carries no vocabulary leaves
    the step to check the loader's ids: it refused every image token as 'token ids must lie in [0, 128)' and told
    the user to give PackingCollator pack_options=dict(vocab_size=...), which LlavaPackingCollator has not."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator
    from megatron_vlm_packing.testing.llava_reference import IMG, T, collated
    from megatron_vlm_packing.testing.step_models import step_loss

    beyond = 200  # the tiny LLaVA's language vocabulary is 128
    saved, tiny_llava.image_token_index = tiny_llava.image_token_index, beyond
    try:
        batch = collated(((T, T, T), (IMG, IMG, T, T), (T, IMG, T, T, IMG)), label_style="hf", seed=4)
        batch["input_ids"] = torch.where(batch["input_ids"] == IMG, beyond, batch["input_ids"])
        spaceless = dataclasses.replace(LlavaSpace.of(tiny_llava), vocab_size=None)
        micro_batch = LlavaPackingCollator(space=spaceless)(batch)
        assert micro_batch.checked_vocab_size is None
        assert step_loss(tiny_llava, micro_batch) == step_loss(tiny_llava, batch)
        text_beyond = {**batch, "input_ids": batch["input_ids"].clone()}
        text_beyond["input_ids"][2, 2] = 128  # a text token: still refused
        with pytest.raises(ValueError, match=r"input_ids row 0 position \d+ is 128: token ids must lie in \[0, 128\)"):
            step_loss(tiny_llava, LlavaPackingCollator(space=spaceless)(text_beyond))
    finally:
        tiny_llava.image_token_index = saved


def test_a_collate_returning_numpy_arrays_is_told_so():
    """A processor called with return_tensors="np" gives numpy arrays: the refusal said 'input_ids must be a
    [B, S] tensor, got (2, 3)', a [B, S] shape, without naming what was wrong (not a torch tensor)."""
    import numpy as np

    ids = np.array([[5, 6, 7], [1, 8, 0]])
    collator = PackingCollator(collate=lambda _: {"input_ids": ids, "labels": ids, "attention_mask": ids != 0})
    with pytest.raises(ValueError, match=r"input_ids must be a \[B, S\] torch.Tensor, got a numpy.ndarray of shape "
                                         r"\(2, 3\): convert it with torch.as_tensor"):
        collator([0])


def test_a_loader_micro_batch_broadcast_from_tp_rank0_is_sent_once_not_once_per_view(monkeypatch):
    """broadcast_from_tp_rank0 pickles the iterator's item (`broadcast_object_list`). Plain pickle writes a tensor's
    whole storage with it, so each of a collated micro-batch's views of its one buffer carried the whole buffer:
    about ten times its bytes went to every TP rank per micro-batch, values intact. What is sent holds each
    tensor's own bytes; TP rank 0 keeps the micro-batch as it came (one storage to move)."""
    import pickle

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.packing.arena import nbytes
    from megatron_vlm_packing.train.step import read_micro_batch

    packed = PackingCollator(cp_size=2, mrope=ROPE)(collate(synthetic_samples(4, seed=7, cfg=DATA)))
    sent = []

    def broadcast_object_list(holder, src, group):
        if holder[0] is not None:  # the reading rank sends
            sent.append(pickle.dumps(holder[0]))
        else:  # a receiving rank: what arrives is what was pickled
            holder[0] = pickle.loads(sent[-1])

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_group", lambda: None)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_src_rank", lambda: 0)
    assert read_micro_batch(iter([packed]), broadcast_from_tp_rank0=True) is packed
    tensor_bytes = sum(nbytes(t) for t in tensors_of(packed))
    assert len(sent[0]) < 2 * tensor_bytes + 16384, (len(sent[0]), tensor_bytes)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)  # a receiving rank
    received = read_micro_batch(iter([packed]), broadcast_from_tp_rank0=True)
    assert type(received) is LoaderMicroBatch and received.mrope_config == ROPE
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(received, name), getattr(packed, name)), name
    assert received.loss_weights_checked and received.labels_checked and received.media_checked_by_packer
    assert received.packed_seq_params.cu_seqlens_q is received.indices.cu_seqlens


def test_a_micro_batch_of_meta_tensors_is_refused_when_moved_to_a_device_with_values():
    """micro_batch_to(..., "meta") gives shapes and dtypes only; moving that to the model's device (the step's
    micro_batch_from_loader) was torch's NotImplementedError ('Cannot copy out of meta tensor'); the collated-dict
    path names it as a ValueError (`row_fields.check_dense_tensors`), so does this one now."""
    from megatron_vlm_packing.packing.collate import micro_batch_from_loader

    packed = PackingCollator(cp_size=2, mrope=ROPE)(collate(synthetic_samples(4, seed=7, cfg=DATA)))
    meta = micro_batch_to(packed, "meta")
    assert all(t.is_meta for t in tensors_of(meta)) and meta.input_ids.shape == packed.input_ids.shape
    assert micro_batch_to(meta, torch.device("meta")).input_ids.is_meta  # meta to meta: shapes only, as asked
    with pytest.raises(ValueError, match=r"the micro-batch holds meta tensors \(no values\): input_ids, labels, "
                                         r"loss_mask, position_ids, padding_mask, packed_seq_params\.cu_seqlens_q and "
                                         r"\d+ more; it cannot move to cpu"):
        micro_batch_from_loader(meta, multiples=PackMultiples.for_parallel(cp_size=2), device=torch.device("cpu"))


def test_a_dense_micro_batch_is_made_ready_for_the_loader_too():
    """The step takes dense micro-batches from the data iterator (`make_forward_step(pack=False)`), but
    for_the_loader, which lays a worker's micro-batch out in one storage, was an AttributeError on pad_batch's
    (no pack indices to prepare)."""
    from megatron_vlm_packing.packing import pad_batch
    from megatron_vlm_packing.packing.collate import for_the_loader

    dense = pad_batch(collate(synthetic_samples(4, seed=3, cfg=DATA)), label_style="hf", mrope=ROPE)
    ready = for_the_loader(dense, 1)
    assert type(ready) is LoaderMicroBatch and ready.indices is None and all_in_one_storage(tensors_of(ready))
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(ready, name), getattr(dense, name)), name
    assert ready.loss_weights_checked and ready.labels_checked and ready.media_checked_by_packer


def test_for_the_loader_names_both_cp_sizes_when_the_pack_was_made_for_another():
    """A micro-batch packed for cp_size=2 made ready for cp_size=4 (or 3) failed deep in the CP index with
    'physical_lengths must be ... multiples of 2*cp_size=8; ... misfit', naming neither the cp it was packed
    for nor that the two differ."""
    from megatron_vlm_packing.packing.collate import for_the_loader

    packed = pack_batch(collate(synthetic_samples(4, seed=3, cfg=DATA)), cp_size=2, label_style="hf", mrope=ROPE)
    for cp in (4, 3):
        with pytest.raises(ValueError, match=rf"for_the_loader: cp_size={cp} but the micro-batch was packed for "
                                             rf"cp_size=2 \(segment multiple 4\): a CP rank's index splits each "
                                             rf"document into 2\*cp_size={2 * cp} chunks, and \(document, length\) \[\("):
            for_the_loader(packed, cp)
    plain = pack_batch(collate(synthetic_samples(4, seed=3, cfg=DATA)), label_style="hf", mrope=ROPE)
    with pytest.raises(ValueError, match=r"cp_size=2 but the micro-batch was packed for cp_size=1 \(segment "
                                         r"multiple 1\)"):
        for_the_loader(plain, 2)
    with pytest.raises(ValueError, match=r"cp_size must be an int >= 1, got 0"):
        for_the_loader(packed, 0)
    for cp in (1, 2):  # 1: a model that selects its CP tokens itself
        assert type(for_the_loader(packed, cp)) is LoaderMicroBatch


@pytest.mark.parametrize("device, reason", [(-1, r"Device index must not be negative"), (True, r"got \(bool\)")])
def test_a_refused_device_says_what_an_int_means_and_why_torch_refused(device, reason):
    """An int is an accelerator index (torch.device(3): 'cuda:3' on an NVIDIA machine), so the message names that
    form too, and torch's own reason: "a device string" alone misled a caller whose index was negative or a bool."""
    ids = torch.ones(1, 4, dtype=torch.long)
    packed = pack_batch({"input_ids": ids, "labels": ids}, label_style="hf")
    with pytest.raises(ValueError, match=rf"got {device!r} \(an int is an accelerator device index >= 0, as "
                                         rf"torch.device\(3\) reads it; a bool is none\): .*{reason}"):
        micro_batch_to(packed, device)
