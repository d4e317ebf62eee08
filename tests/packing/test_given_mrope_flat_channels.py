"""Given [3, B, S] mRoPE positions that are 1D positions copied into the three channels (bug class 1): a sample
holding an image or video whose merged grid spans more than one token in h or w has, with correct positions,
a token whose h and w positions differ (its block's second column or second row), so t == h == w on every real
token of it means its media lost their positions. A ValueError naming position_ids, the row (or document) and the
item, on every packing path and in the shipped step; before, the batch trained silently (the tiny PackedVLM's
loss below moved, no error). Checked in the packer's one read (no sync of its own: tests/perf)."""

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

IMAGE, VIDEO, START, END = 253, 252, 254, 255
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                   mrope_section=(1, 1, 2))
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO)
PACKERS = {
    "pack": lambda batch: pack_batch(batch, label_style="hf", **IDS),
    "pack_host": lambda batch: pack_batch(batch, label_style="hf", host_reads=True, **IDS),
    "pad": lambda batch: pad_batch(batch, label_style="hf", **IDS),
    "collator": lambda batch: PackingCollator(label_style="hf", pack_options=IDS)(batch),
}


def _batch(row1_grid: list[int], *, video: bool = False) -> dict:
    """Row 0: text only; row 1: text, one image (or video) of grid `row1_grid` (merge 2), text; right-padded."""
    t, h, w = row1_grid
    block = [START] + [VIDEO if video else IMAGE] * (t * h * w // 4) + [END]
    rows = [[5, 6, 7], [8, 9] + block + [10]]
    width = max(len(r) for r in rows) + 2
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    pixels = torch.randn(t * h * w, 48, generator=torch.Generator().manual_seed(0))
    media = dict(pixel_values_videos=pixels, video_grid_thw=torch.tensor([row1_grid])) if video \
        else dict(pixel_values=pixels, image_grid_thw=torch.tensor([row1_grid]))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask, **media}


def _flat(batch: dict) -> torch.Tensor:
    """1D positions (0..S-1 on every row) copied into three channels: what a 1D collator hands on."""
    batch_size, width = batch["input_ids"].shape
    return torch.arange(width).expand(3, batch_size, width).clone()


def _correct(batch: dict) -> torch.Tensor:
    kwargs = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw") if k in batch}
    return get_rope_index(batch["input_ids"], ROPE, attention_mask=batch["attention_mask"], **kwargs).position_ids


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("grid", [[1, 4, 4], [1, 2, 6], [1, 6, 2]], ids=["2x2", "1x3", "3x1"])
def test_copied_1d_positions_beside_a_multi_token_image_are_refused(packer, grid):
    batch = _batch(grid)
    with pytest.raises(ValueError, match=rf"position_ids of row 1 are equal on their three mRoPE channels \(t, h, w\) "
                                         rf"at every real token, but it holds image 0 of image_grid_thw "
                                         rf"\[{grid[0]}, {grid[1]}, {grid[2]}\].*drop position_ids"):
        PACKERS[packer](dict(batch, position_ids=_flat(batch)))


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_copied_1d_positions_beside_a_multi_token_video_are_refused(packer):
    batch = _batch([2, 4, 4], video=True)
    with pytest.raises(ValueError, match=r"position_ids of row 1 .* holds video 0 of video_grid_thw \[2, 4, 4\]"):
        PACKERS[packer](dict(batch, position_ids=_flat(batch)))


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("grid", [[1, 4, 4], [1, 2, 6], [1, 2, 2]], ids=["2x2", "1x3", "1x1"])
def test_correct_positions_are_taken(packer, grid):
    batch = _batch(grid)
    positions = _correct(batch)
    out = PACKERS[packer](dict(batch, position_ids=positions))
    assert out.position_ids.dim() == 3


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_a_one_token_image_has_flat_correct_positions_and_is_taken(packer):
    """A 1x1-merged image is one token: its correct positions are equal on all three channels, like text."""
    batch = _batch([1, 2, 2])
    positions = _correct(batch)
    assert torch.equal(positions[0], positions[1]) and torch.equal(positions[1], positions[2])
    PACKERS[packer](dict(batch, position_ids=positions))


def test_a_document_of_a_pre_packed_row_is_named():
    """With document_lengths each document is a sample: the one holding the image is named as the document."""
    batch = _batch([1, 4, 4])
    ids = torch.cat([batch["input_ids"][0, :3], batch["input_ids"][1, :9]])[None]
    positions = torch.cat([torch.arange(3), torch.arange(9)]).expand(3, 1, 12).clone()
    packed = dict(input_ids=ids, labels=ids.clone(), position_ids=positions, document_lengths=torch.tensor([[3, 9]]),
                  pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    with pytest.raises(ValueError, match=r"position_ids of row 0 document 1 .* image 0 of image_grid_thw"):
        pack_batch(packed, label_style="hf", **IDS)


def test_unknown_per_row_counts_refuse_only_when_every_row_is_flat():
    """Without a placeholder id (require_media_counts=False) no item is placed in a row: refused only when every
    row is flat (then the row holding the image is too), taken when some row is not."""
    batch = _batch([1, 4, 4])
    loose = dict(label_style="hf", require_media_counts=False)
    with pytest.raises(ValueError, match=r"position_ids of every row are equal on their three mRoPE channels.*"
                                         r"image 0 of image_grid_thw \[1, 4, 4\]"):
        pack_batch(dict(batch, position_ids=_flat(batch)), **loose)
    pack_batch(dict(batch, position_ids=_correct(batch)), **loose)


def test_the_step_refuses_copied_positions_that_trained_silently(single_process_megatron):
    """The shipped step on the tiny mRoPE PackedVLM (images, videos, audio): before, copied 1D positions trained
    with another loss and no error."""
    from megatron_vlm_packing.testing.step_models import step_batch, step_loss, tiny_step_models

    model = tiny_step_models()["vlm"]
    batch = step_batch("vlm")
    assert step_loss(model, batch, label_style="hf") > 0  # positions computed in the step: taken
    with pytest.raises(ValueError,
                       match=r"position_ids of row \d .* holds (image|video) \d+ of (image|video)_grid_thw"):
        step_loss(model, dict(batch, position_ids=_flat(batch)), label_style="hf")
