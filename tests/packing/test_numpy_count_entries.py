"""Counts given as a list or tuple (`audio_seqlens`, `document_lengths`, `num_image_tiles`) take numpy integers
exactly like Python ints, by the one rule of `bounds.int_entries`: a numpy-based dataset yields np.int64 entries,
which `audio_seqlens` and `document_lengths` refused. A bool (np.bool_ too), a float or a string stays refused,
naming the field and the entry; `num_image_tiles=[True, 2]` was read as 1 tile, silently."""

import re

import numpy as np
import pytest
import torch

from megatron_vlm_packing import packing
from megatron_vlm_packing.packing import bounds
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

OMNI = MRopeConfig(family="qwen3_omni", image_token_id=9, video_token_id=8, vision_start_token_id=5,
                   audio_token_id=7, audio_start_token_id=6, mrope_section=(24, 20, 20), mrope_interleaved=True)
TEN, ONE = 10, 1  # raw lengths of 2 and 1 audio tokens (window 50)
TWO_TOKENS, ONE_TOKEN = (1, 6, 7, 7, 3), (1, 6, 7, 3, 4)
PACKERS = {"pack": packing.pack_batch, "pack_host": lambda b, **kw: packing.pack_batch(b, host_reads=True, **kw),
           "pad": packing.pad_batch}
NUMPY_INTS = [np.int64, np.int32, np.uint16, np.int8]
REFUSED = [True, np.bool_(True), 1.0, np.float64(1.0), "1"]


def _batch(rows, **extra):
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows])
    keep = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep, **extra}


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_int_entries_gives_python_ints_for_numpy_integers(kind):
    out = bounds.int_entries((kind(3), 4, kind(0)), "counts", "counts")
    assert out == [3, 4, 0] and all(type(n) is int for n in out)
    assert bounds.int_entries(range(2), "counts", "counts") == [0, 1]


@pytest.mark.parametrize("bad", REFUSED)
def test_int_entries_refuses_bools_floats_and_strings_naming_the_entry(bad):
    with pytest.raises(ValueError, match=rf"counts entry 1 is {re.escape(repr(bad))}: tile counts must be ints"):
        bounds.int_entries([2, bad], "counts", "tile counts")


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("container", [list, tuple])
@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_audio_seqlens_of_numpy_ints_pack_like_python_ints(kind, container, packer):
    python = PACKERS[packer](_batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=[TEN, ONE]), label_style="hf", mrope=OMNI)
    given = container([kind(TEN), kind(ONE)])
    ours = PACKERS[packer](_batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=given), label_style="hf", mrope=OMNI)
    assert torch.equal(ours.position_ids, python.position_ids)
    assert torch.equal(ours.input_ids, python.input_ids)


def test_get_rope_index_takes_audio_seqlens_of_numpy_ints():
    ids = torch.tensor([TWO_TOKENS, ONE_TOKEN])
    expected = get_rope_index(ids, OMNI, audio_seqlens=[TEN, ONE]).position_ids
    assert torch.equal(get_rope_index(ids, OMNI, audio_seqlens=[np.int64(TEN), np.int32(ONE)]).position_ids, expected)


@pytest.mark.parametrize("packer", sorted(PACKERS) + ["get_rope_index"])
@pytest.mark.parametrize("bad", REFUSED)
def test_audio_seqlens_entries_that_are_no_ints_stay_refused(bad, packer):
    message = rf"audio_seqlens entry 1 is {re.escape(repr(bad))}: raw audio lengths must be ints"
    with pytest.raises(ValueError, match=message):
        if packer == "get_rope_index":
            get_rope_index(torch.tensor([TWO_TOKENS, ONE_TOKEN]), OMNI, audio_seqlens=[TEN, bad])
        else:
            PACKERS[packer](_batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=[TEN, bad]), label_style="hf", mrope=OMNI)


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_document_lengths_of_numpy_ints_pack_like_python_ints(kind):
    batch = _batch([(1, 2, 3), (4, 5)])
    python = packing.pack_batch(dict(batch, document_lengths=[[1, 2], [2]]), label_style="hf")
    ours = packing.pack_batch(dict(batch, document_lengths=[[kind(1), kind(2)], (kind(2),)]), label_style="hf")
    assert ours.plan.real_lengths == python.plan.real_lengths == (1, 2, 2)
    assert torch.equal(ours.packed_seq_params.cu_seqlens_q, python.packed_seq_params.cu_seqlens_q)


@pytest.mark.parametrize("bad", REFUSED)
def test_document_lengths_entries_that_are_no_ints_stay_refused(bad):
    batch = dict(_batch([(1, 2, 3), (4, 5)]), document_lengths=[[1, 2], [bad, 1]])
    message = rf"document_lengths row 1 entry 0 is {re.escape(repr(bad))}: document lengths must be ints"
    with pytest.raises(ValueError, match=message):
        packing.pack_batch(batch, label_style="hf")


def _tiled(tiles):
    """Two rows with one image each (4 embeddings a tile) and the tiles given."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    img = -200
    ids = torch.tensor([[img, 8, 9, 0], [10, img, 0, 0]])
    keep = ids != 0
    space = LlavaSpace(img_seq_len=4, image_token_index=img, segment_multiple=4, total_multiple=4)
    return {"input_ids": ids, "labels": torch.where(keep & (ids >= 0), ids + 1, -100), "attention_mask": keep.long(),
            "images": torch.zeros(3, 3, 2, 2), "num_image_tiles": tiles}, space


@pytest.mark.parametrize("kind", NUMPY_INTS)
def test_num_image_tiles_of_numpy_ints_pack_like_python_ints(kind):
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    python = pack_llava_batch(*_tiled([1, 2]))
    ours = pack_llava_batch(*_tiled([kind(1), kind(2)]))
    assert ours.plan.tiles == python.plan.tiles == (1, 2)
    assert ours.plan.physical_lengths == python.plan.physical_lengths


@pytest.mark.parametrize("bad", [True, np.bool_(True), "1"])
def test_num_image_tiles_entries_that_are_no_ints_are_refused(bad):
    """[True, 2] was an int64 tensor to torch: True read as 1 tile, silently."""
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    message = rf"num_image_tiles entry 0 is {re.escape(repr(bad))}: tile counts must be ints"
    with pytest.raises(ValueError, match=message):
        pack_llava_batch(*_tiled([bad, 2]))


WRAPPED = 2**32 + 2  # 2 as an int32


@pytest.mark.parametrize("tiles", [[1, WRAPPED], [np.int64(1), np.uint64(WRAPPED)], torch.tensor([1, WRAPPED]),
                                   np.array([1, WRAPPED])], ids=["list", "numpy entries", "tensor", "ndarray"])
def test_num_image_tiles_past_int32_are_refused_not_wrapped(tiles):
    """The counts are read as given: before, they were cast to int32 first, so 2**32 + 2 tiles packed as 2 beside
    images of 3 tiles, silently."""
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    with pytest.raises(ValueError, match=rf"num_image_tiles sums to {1 + WRAPPED} tiles but the images hold 3"):
        pack_llava_batch(*_tiled(tiles))


@pytest.mark.parametrize("big", [2**63, np.uint64(2**64 - 1), 2**64 + 2])
def test_num_image_tiles_past_int64_are_named(big):
    """Before, torch's own "Overflow when unpacking long long" named neither the field nor the entry."""
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    with pytest.raises(ValueError, match=rf"num_image_tiles entry 1 is {int(big)}: tile counts must be at most "
                                         r"2\*\*63 - 1"):
        pack_llava_batch(*_tiled([1, big]))
