"""A transformers 5 model's own `get_rope_index` as `mrope=`: it requires `mm_token_type_ids`, which a batch
from a hand-made collator (or an older processor) does not carry. `pack_batch` / `pad_batch` derive them from
the placeholder ids (as the validator does) when the callable takes them; before, a TypeError from inside
transformers ("missing 1 required positional argument: 'mm_token_type_ids'")."""

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.rope import MRopeConfig, token_types
from tests.rope.conftest import IMAGE, VIDEO, hf_config, hf_get_rope_index, random_rows

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _batch(family: str, seed: int):
    ids, mask, images, videos, seconds = random_rows(family, 4, seed)
    batch = dict(input_ids=ids, labels=ids, attention_mask=mask, image_grid_thw=images, video_grid_thw=videos)
    if family == "qwen2_5_vl":
        batch["second_per_grid_ts"] = seconds
    return {k: v for k, v in batch.items() if v is not None}


def _each_row_alone(family: str, hf, batch) -> list[torch.Tensor]:
    """[3, n] positions of each row alone from the HF model's index, its grids (and seconds) cut per row."""
    cfg = MRopeConfig.from_hf_config(hf)
    images, videos = batch.get("image_grid_thw"), batch.get("video_grid_thw")
    image_at = video_at = 0
    alone = []
    for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        ids = batch["input_ids"][row:row + 1, :n]
        blocks = lambda token: int(((ids == token) & (torch.roll(ids, 1, 1) != token)).sum())  # noqa: E731
        n_images, n_videos = blocks(IMAGE), blocks(VIDEO)
        if family == "qwen3_vl" and n_videos:  # one block per frame: count whole videos by their frames
            n_videos = torch.cumsum(videos[video_at:, 0], 0).tolist().index(n_videos) + 1
        kwargs = dict(image_grid_thw=images[image_at:image_at + n_images] if n_images else None,
                      video_grid_thw=videos[video_at:video_at + n_videos] if n_videos else None)
        if family == "qwen2_5_vl" and n_videos:
            kwargs["second_per_grid_ts"] = batch["second_per_grid_ts"][video_at:video_at + n_videos]
        alone.append(hf_get_rope_index(family, hf)(ids, mm_token_type_ids=token_types(ids, cfg), **kwargs)[0][:, 0])
        image_at, video_at = image_at + n_images, video_at + n_videos
    return alone


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_the_hf_index_without_mm_token_type_ids_packs_each_rows_own_positions(family, seed):
    hf = hf_config(family)
    batch = _batch(family, seed)
    assert "mm_token_type_ids" not in batch
    packed = pack_batch(batch, mrope=hf_get_rope_index(family, hf), image_token_id=IMAGE, video_token_id=VIDEO,
                        label_style="hf")
    starts = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    for row, (expected, start) in enumerate(zip(_each_row_alone(family, hf, batch), starts)):
        got = packed.position_ids[:, 0, start:start + expected.shape[1]]
        assert torch.equal(got, expected), (family, seed, row)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_index_without_mm_token_type_ids_pads_each_rows_own_positions(family):
    hf = hf_config(family)
    batch = _batch(family, 4)
    dense = pad_batch(batch, mrope=hf_get_rope_index(family, hf), image_token_id=IMAGE, video_token_id=VIDEO,
                      label_style="hf")
    for row, expected in enumerate(_each_row_alone(family, hf, batch)):
        assert torch.equal(dense.position_ids[:, row, :expected.shape[1]], expected), (family, row)


def test_given_mm_token_type_ids_are_passed_as_given():
    """Types in the batch win: the placeholder ids are not needed, and not used to rebuild them."""
    hf = hf_config("qwen2_vl")
    batch = _batch("qwen2_vl", 1)
    types = token_types(batch["input_ids"], MRopeConfig.from_hf_config(hf))
    seen = []

    def index(input_ids, mm_token_type_ids, **kwargs):
        seen.append(mm_token_type_ids)
        return hf_get_rope_index("qwen2_vl", hf)(input_ids, mm_token_type_ids, **kwargs)

    pack_batch({**batch, "mm_token_type_ids": types}, mrope=index, label_style="hf")
    assert seen[0] is types


def test_unknown_placeholder_ids_are_a_value_error_naming_both_remedies():
    hf = hf_config("qwen2_vl")
    with pytest.raises(ValueError, match=r"takes mm_token_type_ids.*pass mm_token_type_ids in the "
                                         r"batch, or the placeholder ids \(image_token_id= / video_token_id="):
        pack_batch(_batch("qwen2_vl", 1), mrope=hf_get_rope_index("qwen2_vl", hf), label_style="hf")


def test_a_grid_whose_placeholder_id_is_unknown_is_a_value_error():
    """Only the image id known but the batch has videos: their tokens would be typed as text, and get text
    positions (or the HF index's StopIteration)."""
    hf = hf_config("qwen2_vl")
    batch = _batch("qwen2_vl", 1)
    assert "video_grid_thw" in batch
    with pytest.raises(ValueError, match=r"video_grid_thw.*video_token_id"):
        pack_batch(batch, mrope=hf_get_rope_index("qwen2_vl", hf), image_token_id=IMAGE, label_style="hf")


def test_a_text_only_batch_with_one_known_id_gets_text_positions():
    hf = hf_config("qwen3_vl")
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    packed = pack_batch(dict(input_ids=ids, labels=ids, attention_mask=mask), mrope=hf_get_rope_index("qwen3_vl", hf),
                        image_token_id=IMAGE, label_style="hf")
    assert packed.position_ids[:, 0, :3].tolist() == [[0, 1, 2]] * 3
    assert packed.position_ids[:, 0, 3:7].tolist() == [[0, 1, 2, 3]] * 3
