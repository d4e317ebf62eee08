"""Placeholders of a media kind whose inputs the batch lacks ("orphans") are refused by packing, in
its one read, with the count, the id and the rows; `MicroBatch.placeholders_checked` records which
(kind, id) pairs packing checked, so that `PackedVLM` need not read the ids again (see
tests/perf/test_vlm_sync_budget.py for the syncs, tests/adversarial/step_cases.py for the model
keeping its own check when packing used another id).

Shapes are tiny: B = 2 or 3 rows of at most 8 tokens; ids 9 (image), 10 (video), 11 (audio), 8
(vision start).
"""

import pytest
import torch

from megatron_vlm_packing.packing import pack_batch, pad_batch
from megatron_vlm_packing.packing.media_counts import checked_placeholders
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.rope import MRopeConfig

IDS = dict(image_token_id=9, video_token_id=10, audio_token_id=11)
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=9, video_token_id=10, vision_start_token_id=8,
                   mrope_section=(1, 1, 2))


def text_batch(ids: list[list[int]]) -> dict:
    """Right-padded rows (0 = pad slot), labels = ids at real tokens."""
    lengths = [len(row) for row in ids]
    width = max(lengths)
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": input_ids, "labels": torch.where(mask.bool(), input_ids, -100), "attention_mask": mask}


PACKERS = {
    "pack_batch": lambda batch, **kw: pack_batch(batch, label_style="hf", **kw),
    "pack_batch_host_reads": lambda batch, **kw: pack_batch(batch, label_style="hf", host_reads=True, **kw),
    "pad_batch": lambda batch, **kw: pad_batch(batch, label_style="hf", **kw),
}


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("kind,token_id,field", [("image", 9, "pixel_values"), ("video", 10, "pixel_values_videos"),
                                                 ("audio", 11, "input_features")])
def test_orphan_placeholders_are_a_value_error_naming_count_id_and_rows(packer, kind, token_id, field):
    batch = text_batch([[1, 2, 3], [4, token_id, token_id, 5], [6, token_id, 7]])
    message = rf"input_ids hold 3 {kind} placeholder tokens \(id {token_id}\) in rows \[1, 2\] but the batch has no {field}"
    with pytest.raises(ValueError, match=message):
        PACKERS[packer](batch, **IDS)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_an_empty_image_list_is_no_images(packer):
    batch = text_batch([[1, 9, 9, 9, 9, 2]]) | {"pixel_values": torch.zeros(0, 12),
                                                "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"hold 4 image placeholder tokens \(id 9\) in rows \[0\] .* no pixel_values"):
        PACKERS[packer](batch, **IDS)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_placeholder_ids_in_pad_slots_only_are_not_placeholders(packer):
    batch = text_batch([[1, 2, 3, 4], [5, 6]])
    batch["input_ids"][1, 2:] = torch.tensor([9, 11])  # pad slots (attention_mask 0) holding placeholder ids
    micro_batch = PACKERS[packer](batch, **IDS)
    assert micro_batch.stats.real_tokens == 6
    assert micro_batch.placeholders_checked == (("image", 9), ("video", 10), ("audio", 11))


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_an_unknown_id_is_not_checked_nor_recorded(packer):
    batch = text_batch([[1, 9, 3], [4, 5]])
    assert PACKERS[packer](batch, video_token_id=10).placeholders_checked == (("video", 10),)
    assert PACKERS[packer](batch).placeholders_checked == ()


def _image_batch() -> dict:
    """Row 0: text, a 4-placeholder image block ([1, 4, 4] grid, merge 2), text; row 1: text only."""
    batch = text_batch([[1, 8, 9, 9, 9, 9, 2, 3], [4, 5, 6]])
    return batch | {"pixel_values": torch.randn(16, 12), "image_grid_thw": torch.tensor([[1, 4, 4]])}


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_present_kinds_are_counted_and_absent_ones_checked(packer):
    micro_batch = PACKERS[packer](_image_batch(), **IDS)
    assert micro_batch.vision.images_per_sample == (1, 0)
    assert micro_batch.placeholders_checked == (("image", 9), ("video", 10), ("audio", 11))
    orphan = _image_batch()
    orphan["input_ids"][1, 1] = 11
    with pytest.raises(ValueError, match=r"hold 1 audio placeholder tokens \(id 11\) in rows \[1\] .* no input_features"):
        PACKERS[packer](orphan, **IDS)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_grids_without_pixels_are_mrope_position_inputs(packer):
    """A text model with mRoPE: image grids place the positions of the image block; nothing to embed."""
    batch = {k: v for k, v in _image_batch().items() if k != "pixel_values"}
    micro_batch = PACKERS[packer](batch, mrope=ROPE, audio_token_id=11)
    assert micro_batch.vision is None and micro_batch.position_ids.shape[0] == 3
    assert micro_batch.placeholders_checked == (("video", 10), ("audio", 11))  # the images were not checked
    assert not any(kind == "image" for kind, _ in micro_batch.placeholders_checked)
    with_pixels = PACKERS[packer](_image_batch(), mrope=ROPE, audio_token_id=11)
    assert torch.equal(with_pixels.position_ids, micro_batch.position_ids)


def test_position_only_inputs_leave_their_kind_unchecked():
    tokens = MediaTokens(**IDS)
    grids = {"image_grid_thw": torch.tensor([[1, 2, 2]]), "video_grid_thw": torch.tensor([[2, 2, 2]]),
             "audio_seqlens": torch.tensor([12])}
    assert checked_placeholders(grids, tokens) == ()
    assert checked_placeholders({"audio_seqlens": [12]}, tokens) == (("image", 9), ("video", 10))
    empty = {"image_grid_thw": torch.zeros(0, 3, dtype=torch.long), "audio_seqlens": []}
    assert checked_placeholders(empty, tokens) == (("image", 9), ("video", 10), ("audio", 11))


def test_the_field_survives_the_loader_the_move_and_localize():
    from megatron_vlm_packing.packing.collate import PackingCollator, micro_batch_to
    from megatron_vlm_packing.packing.localize import localize
    from megatron_vlm_packing.parallel.layout import ParallelLayout

    collated = PackingCollator(cp_size=2, label_style="hf", pack_options=IDS)(text_batch([[1, 2, 3], [4, 5]]))
    expected = (("image", 9), ("video", 10), ("audio", 11))
    assert collated.placeholders_checked == expected
    moved = micro_batch_to(collated, torch.device("cpu"))
    assert moved.placeholders_checked == expected
    assert localize(moved, ParallelLayout(cp_size=2, cp_rank=1)).placeholders_checked == expected
