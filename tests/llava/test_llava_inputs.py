"""LLaVA inputs refused wherever they enter (pack_llava_batch, pad_llava_batch, LlavaPackingCollator,
the adapter's check on the step's path): integer-typed images, which before reached the vision tower
uncast (or were cast without their normalisation)."""

from dataclasses import replace

import pytest
import torch

from megatron_vlm_packing.models.llava import LLaVAAdapter, LlavaSpace
from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator, pack_llava_batch, pad_llava_batch

IMG = 127
SPACE = LlavaSpace(img_seq_len=4, image_token_index=IMG)


def _batch(images):
    ids = torch.tensor([[5, 6, 7], [IMG, 8, 9]])
    # labels of neither style (custom targets): both the packers' "megatron" and the collators' "hf" take them
    return {"input_ids": ids, "labels": ids + 10, "images": images}


def _adapter(space=SPACE):
    adapter = LLaVAAdapter.__new__(LLaVAAdapter)  # the checks read only the space (no model needed)
    adapter.model_name, adapter.space = "LLaVAModel", space
    return adapter


ENTRIES = {
    "pack_llava_batch": lambda batch: pack_llava_batch(batch, SPACE),
    "pad_llava_batch": lambda batch: pad_llava_batch(batch, SPACE),
    "collator": lambda batch: LlavaPackingCollator(space=SPACE)(batch),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.long, torch.bool])
def test_integer_images_are_refused_where_they_enter(entry, dtype):
    with pytest.raises(ValueError, match=rf"images must hold floating-point pixel values, got dtype {dtype}"):
        ENTRIES[entry](_batch(torch.zeros(1, 3, 2, 2, dtype=dtype)))
    with pytest.raises(ValueError, match=rf"pixel_values must hold floating-point pixel values, got dtype {dtype}"):
        batch = _batch(None)
        ENTRIES[entry]({**batch, "pixel_values": torch.zeros(1, 3, 2, 2, dtype=dtype)})
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert ENTRIES[entry](_batch(torch.zeros(1, 3, 2, 2, dtype=dtype))).vision.pixel_values.dtype == dtype


def test_the_step_refuses_integer_images_in_a_micro_batch_built_by_hand():
    """A MicroBatch built (or transformed) by the user reaches the adapter's check, not the vision tower."""
    adapter = _adapter()
    packed = pack_llava_batch(_batch(torch.zeros(1, 3, 2, 2)), SPACE)
    adapter.check(packed)
    ints = replace(packed, vision=replace(packed.vision, pixel_values=torch.zeros(1, 3, 2, 2, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"images \(vision.pixel_values\) must hold floating-point pixel values, got "
                                         r"dtype torch.uint8"):
        adapter.check(ints)
    with pytest.raises(ValueError, match=r"got dtype torch.uint8"):
        adapter.forward(lambda *a, **k: (torch.zeros(1), None), ints)


def _from_loader(space, collator_pad_to=None, **options):
    """A micro-batch packed by LlavaPackingCollator for `space`, taken by the step made with `options`."""
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.train.build import StepOptions

    packed = LlavaPackingCollator(space=space, pad_to=collator_pad_to)(_batch(torch.zeros(1, 3, 2, 2)))
    return _adapter(space).micro_batch_from_loader(packed, ParallelLayout(), StepOptions(**options),
                                                   torch.device("cpu"))


PIPED = LlavaSpace(img_seq_len=4, image_token_index=IMG, pipeline_length=40, max_length=40)


def test_a_loader_micro_batch_is_checked_against_the_steps_pad_to_and_pp():
    """pack_llava_batch refused pad_to other than the PP length; a micro-batch packed in the loader and
    fed to a step made with that pad_to (or another length, or pack=False) was taken silently."""
    assert sum(_from_loader(PIPED).plan.expanded_physical) == 40
    assert sum(_from_loader(PIPED, pad_to=40).plan.expanded_physical) == 40
    with pytest.raises(ValueError, match="pad_to=32 but under pipeline parallelism LLaVAModel pads every row to "
                                         "language_max_sequence_length=40"):
        _from_loader(PIPED, pad_to=32)
    with pytest.raises(ValueError, match=r"the packed micro-batch from the data iterator expands to 10 tokens but the "
                                         r"step needs 16 \(pad_to=16\): build the LlavaPackingCollator with pad_to=16"):
        _from_loader(SPACE, pad_to=16)
    assert sum(_from_loader(SPACE, collator_pad_to=16, pad_to=16).plan.expanded_physical) == 16
    with pytest.raises(ValueError, match=r"the data iterator yielded a packed micro-batch but the step was made with "
                                         r"pack=False"):
        _from_loader(SPACE, pack=False)


def test_pack_llava_batch_and_the_loader_share_the_pp_check():
    with pytest.raises(ValueError, match="pad_to=32 but under pipeline parallelism"):
        pack_llava_batch(_batch(torch.zeros(1, 3, 2, 2)), PIPED, pad_to=32)
    with pytest.raises(ValueError, match="pad_to=32 but under pipeline parallelism"):
        LlavaPackingCollator(space=PIPED, pad_to=32)(_batch(torch.zeros(1, 3, 2, 2)))


@pytest.mark.parametrize("options, message", [
    (dict(space=SPACE, collate=3), r"LlavaPackingCollator's collate must be a callable \(samples -> batch dict\) or "
                                   r"None, got 3"),
    (dict(space=None), r"LlavaPackingCollator's space must be a LlavaSpace \(LlavaSpace.of\(model\)\), got NoneType"),
    # these were refused only at the first batch, in a worker
    (dict(space=SPACE, fp8="yes"), r"fp8 must be a bool, got 'yes'"),
    (dict(space=SPACE, label_style="x"), r"label_style must be 'megatron' or 'hf', got 'x'"),
    (dict(space=SPACE, pad_to="x"), r"pad_to must be an int \(the packed length T\) or None, got 'x'"),
    (dict(space=SPACE, pad_token_id=-1), r"pad_token_id must be a non-negative int"),
])
def test_the_llava_collator_refuses_a_bad_collate_or_space_when_built(options, message):
    """Were a TypeError (not callable) / AttributeError ('total_multiple') in a worker at the first batch."""
    with pytest.raises(ValueError, match=message):
        LlavaPackingCollator(**options)


# Each kind of tensor without dense values, and the start of the ValueError naming it (`rows.check_dense_tensors`).
UNDENSE = {
    "sparse_coo": (lambda t: t.to_sparse(), r"has layout torch.sparse_coo: pack_llava_batch/pad_llava_batch read dense "
                                            r"\(strided\) tensors; pass {field}.to_dense\(\)"),
    "sparse_csr": (lambda t: t.to_sparse_csr() if t.dim() == 2 else t.to_sparse(), r"has layout torch.sparse_"),
    "nested": (lambda t: torch.nested.nested_tensor(list(t)), r"is a nested tensor \(layout torch.strided\): "
                                                              r"pack_llava_batch/pad_llava_batch read dense"),
    "meta": (lambda t: t.to("meta"), r"is a meta tensor: it holds no values for "
                                      r"pack_llava_batch/pad_llava_batch to read"),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("kind", sorted(UNDENSE))
def test_sparse_nested_and_meta_tensors_are_refused_where_they_enter(entry, kind):
    """Every tensor input of LLaVA's packers: a sparse or meta image was packed unread (and reached the vision
    tower), the others failed deep in torch (NotImplementedError, RuntimeError); now pack_batch's ValueError."""
    ids = torch.tensor([[5, 6, 7], [IMG, 8, 9]])
    batch = {"input_ids": ids, "labels": ids + 10, "loss_mask": torch.ones(2, 3),
             "attention_mask": torch.ones_like(ids),
             "images": torch.zeros(1, 3, 2, 2), "num_image_tiles": torch.tensor([1])}
    make, message = UNDENSE[kind]
    for field in ("input_ids", "labels", "loss_mask", "attention_mask", "images", "num_image_tiles"):
        with pytest.raises(ValueError, match="^" + field + " " + message.replace("{field}", field)):
            ENTRIES[entry]({**batch, field: make(batch[field])})
    pixels = {k: v for k, v in batch.items() if k != "images"}
    with pytest.raises(ValueError, match=r"^pixel_values " + message.replace("{field}", "pixel_values")):
        ENTRIES[entry]({**pixels, "pixel_values": make(batch["images"])})
    with pytest.raises(ValueError, match=r"^seq_lens "):
        ENTRIES[entry]({**pixels, "attention_mask": None, "seq_lens": make(torch.tensor([3, 3])),
                        "pixel_values": batch["images"]})
    assert ENTRIES[entry](batch).vision.pixel_values.layout is torch.strided  # the dense batch packs


@pytest.mark.parametrize("kind", sorted(UNDENSE))
def test_the_step_refuses_undense_images_in_a_micro_batch_built_by_hand(kind):
    adapter = _adapter()
    packed = pack_llava_batch(_batch(torch.zeros(1, 3, 2, 2)), SPACE)
    undense = replace(packed, vision=replace(packed.vision, pixel_values=UNDENSE[kind][0](torch.zeros(1, 3, 2, 2))))
    with pytest.raises(ValueError, match=r"^images \(vision.pixel_values\) (has layout|is a)"):
        adapter.check(undense)


@pytest.mark.parametrize("fields, message", [
    # accepted and packed as if images expanded to 0 / -2 / 1 / 2.5 embeddings: a plan for another sequence
    (dict(img_seq_len=0), r"img_seq_len must be an int >= 1, got 0"),
    (dict(img_seq_len=-2), r"img_seq_len must be an int >= 1, got -2"),
    (dict(img_seq_len=True), r"img_seq_len must be an int >= 1, got True"),
    (dict(img_seq_len=2.5), r"img_seq_len must be an int >= 1, got 2\.5"),
    (dict(image_token_index=True), r"image_token_index must be an int .*, got True"),  # matched token 1
    (dict(image_token_index=9.0), r"image_token_index must be an int .*, got 9\.0"),
    (dict(segment_multiple=0), r"segment_multiple must be an int >= 1, got 0"),  # ZeroDivisionError
    (dict(total_multiple=True), r"total_multiple must be an int >= 1, got True"),
    (dict(pipeline_length=0), r"pipeline_length must be None or an int >= 1, got 0"),
    (dict(max_length=2.5), r"max_length must be None or an int >= 1, got 2\.5"),
])
def test_a_llava_space_of_nonsense_numbers_is_refused_when_built(fields, message):
    with pytest.raises(ValueError, match=message):
        LlavaSpace(**{"img_seq_len": 4, "image_token_index": IMG, **fields})
    assert LlavaSpace(img_seq_len=4, image_token_index=-200).image_token_index == -200  # LLaVA's default id


def test_the_llava_collator_refuses_the_image_token_as_pad_id_when_built():
    """Every pad slot would be expanded into an image: pack_llava_batch / pad_llava_batch refuse it; the
    collator refused it only at the first batch, in a DataLoader worker."""
    with pytest.raises(ValueError, match="pad_token_id=127 is LLaVA's image token: pad slots would become images"):
        LlavaPackingCollator(space=SPACE, pad_token_id=IMG)
    with pytest.raises(ValueError, match="pad_token_id=127 is LLaVA's image token"):
        pad_llava_batch(_batch(torch.zeros(1, 3, 2, 2)), SPACE, pad_token_id=IMG)
    assert LlavaPackingCollator(space=SPACE, pad_token_id=0).pad_token_id == 0


def test_a_patch_grid_beside_llava_images_is_refused():
    """LLaVA's tower takes whole tiles [tiles, C, H, W] and no patch grid: a Qwen-VL style `image_grid_thw` added
    to a hand-built micro-batch was dropped silently (every adapter of LLaVA's call passes images and tiles only)."""
    adapter = _adapter()
    packed = pack_llava_batch(_batch(torch.zeros(1, 3, 2, 2)), SPACE)
    adapter.check(packed)
    with_grid = replace(packed, vision=replace(packed.vision, image_grid_thw=torch.tensor([[1, 2, 2]])))
    with pytest.raises(ValueError, match=r"vision.image_grid_thw describes 1 image\(s\) but LLaVAModel takes whole "
                                         r"tiles and no patch grid"):
        adapter.check(with_grid)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("key, value", [
    ("document_lengths", torch.tensor([[2, 1], [3, 0]])),  # pre-packed rows: trained as one document each
    ("image_grid_thw", torch.tensor([[1, 2, 2]])),
    ("pixel_values_videos", torch.zeros(4, 8)),
    ("imgs", torch.zeros(1, 3, 2, 2)),
])
def test_a_key_the_llava_packers_do_not_read_is_refused(entry, key, value):
    """pack_llava_batch / pad_llava_batch (and the collator) read only their own keys: any other key was dropped
    silently (a row's document_lengths too, so a pre-packed row trained as one causal document)."""
    with pytest.raises(ValueError, match=rf"LLaVA's packers do not read \['{key}'\]"):
        ENTRIES[entry](dict(_batch(torch.zeros(1, 3, 2, 2)), **{key: value}))


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_llava_position_ids_are_checked_not_dropped(entry):
    """[B, S] position_ids are recomputed per sample: taken when they count 0..n-1 on each row's real tokens."""
    batch = dict(_batch(torch.zeros(1, 3, 2, 2)), attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    ENTRIES[entry](dict(batch, position_ids=torch.tensor([[0, 1, 0], [0, 1, 2]])))
    with pytest.raises(ValueError, match=r"position_ids row 1 position 2 is 0, expected 2 \(it restarts"):
        ENTRIES[entry](dict(batch, position_ids=torch.tensor([[0, 1, 0], [0, 1, 0]])))
