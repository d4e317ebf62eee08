"""A saved pack for a family whose index reads no seconds (Qwen2-VL, Qwen3-VL) that carries
`second_per_grid_ts` (a dumper that saves every key) is compared with the model's index without them, as the
model computes its positions: every document was reported as "the model's index refuses it" (the index now
refuses seconds it would drop), and nothing was checked. Our `MRopeConfig` index and transformers' own."""

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.rope import MRopeConfig
from megatron_vlm_packing.validate import validate_packed_batch


@pytest.mark.parametrize("index", ["ours", "transformers"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_seconds_the_index_never_reads_are_not_given_to_it(family, index):
    pytest.importorskip("transformers")
    from tests.rope.conftest import IMAGE, VIDEO, hf_config, hf_get_rope_index, random_rows

    hf = hf_config(family)
    mrope = MRopeConfig.from_hf_config(hf) if index == "ours" else hf_get_rope_index(family, hf)
    ids, mask, images, videos, _ = random_rows(family, 4, seed=5)
    assert videos is not None
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, image_grid_thw=images, video_grid_thw=videos)
    packed = pack_batch(batch, label_style="hf", mrope=MRopeConfig.from_hf_config(hf))
    fields = dict(input_ids=packed.input_ids, position_ids=packed.position_ids,
                  packed_seq_params=packed.packed_seq_params, image_token_id=IMAGE, video_token_id=VIDEO,
                  image_grid_thw=images, video_grid_thw=videos,
                  second_per_grid_ts=torch.full((len(videos),), 0.5))  # saved, though no model of the family reads it
    report = validate_packed_batch(**fields, mrope=mrope)
    assert report.ok and "mrope_positions" in report.checked, str(report)
    assert not [s for s in report.skipped if s[0] == "mrope_positions"], str(report)
    positions = packed.position_ids.clone()
    slot = int((packed.input_ids[0] == VIDEO).nonzero()[0]) if (packed.input_ids[0] == VIDEO).any() \
        else int((packed.input_ids[0] == IMAGE).nonzero()[0])
    positions[0, 0, slot] += 1
    report = validate_packed_batch(**{**fields, "position_ids": positions}, mrope=mrope)
    assert report.failed_checks == {"mrope_positions"}, str(report)
