import pytest
import torch

from megatron_vlm_packing.rope import MRopeConfig, get_rope_index, token_types
from tests.rope.conftest import IMAGE, hf_config, hf_get_rope_index, random_rows

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_config(family):
    cfg = MRopeConfig.from_hf_config(hf_config(family))
    assert cfg.family == family and cfg.spatial_merge_size == 2
    assert cfg.image_token_id == 151655 and cfg.video_token_id == 151656
    assert cfg.mrope_section == (2, 1, 1)
    assert cfg.mrope_interleaved == (family == "qwen3_vl")
    assert cfg.tokens_per_second == (2.0 if family == "qwen2_5_vl" else 1.0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(6))
def test_identical_to_the_hf_model(family, seed):
    hf = hf_config(family)
    cfg = MRopeConfig.from_hf_config(hf)
    ids, mask, images, videos, seconds = random_rows(family, 4, seed)
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = seconds
    ours = get_rope_index(ids, cfg, **kwargs)
    ref_pos, ref_delta = hf_get_rope_index(family, hf)(ids, mm_token_type_ids=token_types(ids, cfg), **kwargs)
    assert torch.equal(ours.position_ids, ref_pos)
    assert torch.equal(ours.deltas, ref_delta.reshape(ours.deltas.shape))


def test_each_row_alone_equals_the_batch():
    cfg = MRopeConfig(family="qwen2_5_vl", tokens_per_second=2.0)
    ids, mask, images, videos, seconds = random_rows("qwen2_5_vl", 5, 11)
    full = get_rope_index(ids, cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                          second_per_grid_ts=seconds).position_ids
    img_i = vid_i = 0
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        row_ids = ids[row:row + 1, :n]
        ni = int(((row_ids == IMAGE) & torch.roll(row_ids != IMAGE, 1, 1)).sum())
        nv = int(((row_ids == 151656) & torch.roll(row_ids != 151656, 1, 1)).sum())
        alone = get_rope_index(row_ids, cfg, image_grid_thw=images[img_i:img_i + ni] if ni else None,
                               video_grid_thw=videos[vid_i:vid_i + nv] if nv else None,
                               second_per_grid_ts=seconds[vid_i:vid_i + nv] if nv else None).position_ids
        assert torch.equal(alone[:, 0], full[:, row, :n])
        img_i, vid_i = img_i + ni, vid_i + nv


def test_max_position_text_offset_differs_only_after_long_videos():
    cfg_new = MRopeConfig(family="qwen2_5_vl", tokens_per_second=4.0)
    cfg_old = MRopeConfig(family="qwen2_5_vl", tokens_per_second=4.0, text_offset="max_position")
    ids = torch.tensor([[5, 151652] + [151656] * 8 + [151653, 7]])  # video t=2, h=w=4 -> 2*2*2 tokens
    video = torch.tensor([[2, 4, 4]])
    new = get_rope_index(ids, cfg_new, video_grid_thw=video, second_per_grid_ts=torch.tensor([1.0])).position_ids
    old = get_rope_index(ids, cfg_old, video_grid_thw=video, second_per_grid_ts=torch.tensor([1.0])).position_ids
    assert new[0, 0, 2:10].tolist() == [2, 2, 2, 2, 6, 6, 6, 6]  # t steps by tokens_per_second * seconds
    assert new[:, 0, 10].tolist() == [4, 4, 4]  # transformers 5: 2 + max(h, w) = 4
    assert old[:, 0, 10].tolist() == [7, 7, 7]  # transformers 4.57: block max (6) + 1


@pytest.mark.parametrize(
    "ids, kwargs, expected",
    [
        ([[1, IMAGE, IMAGE, IMAGE, IMAGE, 2]], dict(), r"1 image placeholder blocks in input_ids but 0 rows in image_grid_thw"),
        ([[1, IMAGE, IMAGE, 2]], dict(image_grid_thw=torch.tensor([[1, 4, 4]])), r"has 2 placeholder tokens but its grid \[1, 4, 4\] with merge 2 needs 4"),
        ([[1, 2]], dict(image_grid_thw=torch.tensor([[1, 4, 4]])), r"0 image placeholder blocks in input_ids but 1 rows"),
    ],
)
def test_count_mismatches_raise_with_both_numbers(ids, kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        get_rope_index(torch.tensor(ids), MRopeConfig(family="qwen2_vl"), **kwargs)
