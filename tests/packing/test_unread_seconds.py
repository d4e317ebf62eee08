"""`second_per_grid_ts` given to an mRoPE index that reads none (Qwen2-VL's places video frames by their index,
Qwen3-VL's by the timestamp text between them; neither model takes seconds) is a ValueError naming the field
and the family, on every packing path and in `get_rope_index`. Before, it was taken and dropped: the packers
carried it to a model that never read it. Qwen2.5-VL's and Qwen3-Omni's index read them and still do.
"""

import pytest
import torch

from megatron_vlm_packing import packing
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from tests.adversarial.test_audio_seqlens import _batch

PACKERS = {
    "pack": packing.pack_batch,
    "pack_host": lambda batch, **kw: packing.pack_batch(batch, host_reads=True, **kw),
    "pad": packing.pad_batch,
    "collator": lambda batch, *, label_style, mrope: PackingCollator(label_style=label_style, mrope=mrope)(batch),
}
IDS = dict(image_token_id=9, video_token_id=8, vision_start_token_id=5, mrope_section=(24, 20, 20))
CONFIGS = {"qwen2_vl": MRopeConfig(family="qwen2_vl", **IDS), "qwen3_vl": MRopeConfig(family="qwen3_vl", **IDS),
           "qwen2_5_vl": MRopeConfig(family="qwen2_5_vl", tokens_per_second=2, **IDS),
           "qwen3_omni": MRopeConfig(family="qwen3_omni", audio_token_id=7, audio_start_token_id=6, **IDS)}
# Two rows, each one video of grid [1, 2, 2] (1 placeholder) with its patches, and one second per video.
VIDEOS = dict(pixel_values_videos=torch.ones(8, 6), video_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]),
              second_per_grid_ts=torch.tensor([1.0, 2.0]))


def _videos(**change) -> dict:
    return _batch([[1, 5, 8, 3], [1, 5, 8, 3]], **{**VIDEOS, **change})


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_seconds_for_an_index_that_reads_none_are_refused(packer, family):
    with pytest.raises(ValueError, match=rf"^second_per_grid_ts has 2 entries but the {family} mRoPE index reads "
                                         rf"none"):
        PACKERS[packer](_videos(), label_style="hf", mrope=CONFIGS[family])
    grids_only = _videos(pixel_values_videos=None)  # position inputs only (a text model with mRoPE)
    with pytest.raises(ValueError, match=rf"^second_per_grid_ts has 2 entries but the {family} mRoPE index"):
        PACKERS[packer]({k: v for k, v in grids_only.items() if v is not None}, label_style="hf",
                        mrope=CONFIGS[family])
    without = {k: v for k, v in _videos().items() if k != "second_per_grid_ts"}
    assert PACKERS[packer](without, label_style="hf", mrope=CONFIGS[family]).vision.has_videos


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_omni"])
def test_seconds_for_an_index_that_reads_them_are_packed(packer, family):
    assert PACKERS[packer](_videos(), label_style="hf", mrope=CONFIGS[family]).vision.second_per_grid_ts.tolist() == \
        [1.0, 2.0]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("seconds", [torch.tensor([1.0, 2.0]), [1.0, 2.0]], ids=["tensor", "list"])
def test_get_rope_index_refuses_seconds_its_family_reads_none_of(family, seconds):
    batch = _videos()
    with pytest.raises(ValueError, match=rf"^second_per_grid_ts has 2 entries but the {family} mRoPE index"):
        get_rope_index(batch["input_ids"], CONFIGS[family], video_grid_thw=batch["video_grid_thw"],
                       second_per_grid_ts=seconds)
    empty = get_rope_index(batch["input_ids"], CONFIGS[family], video_grid_thw=batch["video_grid_thw"],
                           second_per_grid_ts=torch.zeros(0))  # no entries: nothing dropped
    assert torch.equal(empty.position_ids, get_rope_index(batch["input_ids"], CONFIGS[family],
                                                          video_grid_thw=batch["video_grid_thw"]).position_ids)
