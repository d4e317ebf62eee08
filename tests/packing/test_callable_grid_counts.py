"""A position callable's grids-only batch (a text model with mRoPE, no pixels) is counted per row like a batch
with pixels: every row's placeholders must end on a grid boundary. With an `MRopeConfig` the index checks every
block against its grid; a callable (the HF model's own get_rope_index, say) checks nothing, so a grid given in the
wrong order or a block cut by the attention mask reached it and came back as the callable's RuntimeError (shape
mismatch) or as positions of the wrong grids."""

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653
CONFIG = MRopeConfig(family="qwen2_vl")


def index(input_ids, attention_mask=None, image_grid_thw=None, video_grid_thw=None):
    """A position callable that checks its inputs (ours)."""
    return get_rope_index(input_ids, CONFIG, attention_mask=attention_mask, image_grid_thw=image_grid_thw,
                          video_grid_thw=video_grid_thw)


CALLS = []


def trusting(input_ids, attention_mask=None, image_grid_thw=None):
    """A position callable that trusts its grids (the HF model's takes the grid of each block in order, and fails
    with a shape mismatch or gives other positions when they do not fit): here text positions, and a record."""
    CALLS.append(image_grid_thw)
    return (torch.cumsum(attention_mask, dim=1) - 1).expand(3, -1, -1)


def _rows():
    """Row 0: one 1-token image ([1, 2, 2]); row 1: one 4-token image ([1, 4, 4])."""
    ids = torch.tensor([[5, START, IMAGE, END, 6, 0, 0, 0], [5, START] + [IMAGE] * 4 + [END, 6]])
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8])
    return ids, mask


@pytest.mark.parametrize("call", [pack_batch, pad_batch])
def test_grids_in_the_wrong_rows_are_refused_before_the_callable(call):
    CALLS.clear()
    ids, mask = _rows()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask,
             "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 2]])}  # swapped: row 0 would get the 4-token grid
    with pytest.raises(ValueError, match=r"row 0 has 1 image placeholder tokens, but the images of image_grid_thw in "
                                         r"order give it 4"):
        call(batch, mrope=trusting, image_token_id=IMAGE, label_style="hf")
    assert not CALLS


@pytest.mark.parametrize("call", [pack_batch, pad_batch])
def test_a_block_cut_by_the_mask_is_refused_before_the_callable(call):
    CALLS.clear()
    ids, mask = _rows()
    mask[1, 5:] = 0  # row 1 keeps 3 of its 4 image placeholders
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask,
             "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]])}
    with pytest.raises(ValueError, match=r"row 1 has 3 image placeholder tokens, but the images of image_grid_thw in "
                                         r"order give it 4"):
        call(batch, mrope=trusting, image_token_id=IMAGE, label_style="hf")
    assert not CALLS


def test_grids_in_their_rows_pass_and_equal_the_config_index():
    ids, mask = _rows()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask,
             "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]])}
    by_callable = pack_batch(batch, mrope=index, image_token_id=IMAGE, label_style="hf")
    assert torch.equal(by_callable.position_ids, pack_batch(batch, mrope=CONFIG, label_style="hf").position_ids)


def test_grids_without_a_known_placeholder_id_are_left_to_the_callable():
    """No image_token_id: nothing to count the rows with (the callable reads the grids as it will)."""
    ids, mask = _rows()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask,
             "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]])}
    assert pack_batch(batch, mrope=index, label_style="hf").position_ids.shape == (3, 1, 13)


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
def test_bad_seconds_of_a_grids_only_batch_are_refused_before_the_callable(value):
    """Seconds were checked (finite, >= 0) only beside video pixels or by an MRopeConfig's index: a callable's
    grids-only batch handed NaN or negative seconds to it (the HF model turns them into garbage t positions)."""
    ids = torch.tensor([[5, START] + [VIDEO] * 4 + [END, 6]])
    batch = {"input_ids": ids, "labels": ids, "video_grid_thw": torch.tensor([[1, 4, 4]]),
             "second_per_grid_ts": torch.tensor([value])}

    def video_index(input_ids, attention_mask=None, video_grid_thw=None, second_per_grid_ts=None):
        CALLS.append(second_per_grid_ts)
        return (torch.cumsum(attention_mask, dim=1) - 1).expand(3, -1, -1)

    CALLS.clear()
    with pytest.raises(ValueError, match=r"second_per_grid_ts must be finite and >= 0, got \[(-0\.5|nan|inf)\]"):
        pack_batch(batch, mrope=video_index, video_token_id=VIDEO, label_style="hf")
    assert not CALLS


@pytest.mark.parametrize("entries", [0, 2])
def test_seconds_that_do_not_match_the_video_grids_are_refused_without_pixels(entries):
    """One second_per_grid_ts entry per video: counted beside video pixels only, so a callable's grids-only
    batch handed it seconds belonging to no video, or one video without seconds."""
    ids = torch.tensor([[5, START] + [VIDEO] * 4 + [END, 6]])
    batch = {"input_ids": ids, "labels": ids, "video_grid_thw": torch.tensor([[1, 4, 4]]),
             "second_per_grid_ts": torch.full((entries,), 0.5)}

    def video_index(input_ids, attention_mask=None, video_grid_thw=None, second_per_grid_ts=None):
        return (torch.cumsum(attention_mask, dim=1) - 1).expand(3, -1, -1)

    with pytest.raises(ValueError, match=rf"second_per_grid_ts has {entries} entries but video_grid_thw has 1 videos"):
        pack_batch(batch, mrope=video_index, video_token_id=VIDEO, label_style="hf")


def test_a_callable_gets_unsigned_grids_as_int64():
    """uint16 / uint32 grids are read as int64 everywhere else (the index, the typed vision inputs); the callable
    got them as given, and the HF model's index fails on them ('lt_cpu' not implemented for 'UInt32')."""
    seen = {}

    def index(input_ids, attention_mask=None, image_grid_thw=None):
        seen["grid"] = image_grid_thw
        return (torch.cumsum(attention_mask, dim=1) - 1).expand(3, -1, -1)

    ids, mask = _rows()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask,
             "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]], dtype=torch.uint32)}
    pack_batch(batch, mrope=index, image_token_id=IMAGE, label_style="hf")
    assert seen["grid"].dtype == torch.long and seen["grid"].tolist() == [[1, 2, 2], [1, 4, 4]]
