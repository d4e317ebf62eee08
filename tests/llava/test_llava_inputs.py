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
    return {"input_ids": ids, "labels": ids + 1, "images": images}


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
