"""Host reads of the mRoPE index: `get_rope_index` reads once (every family, Qwen3-VL's per-frame
videos included), and `pack_batch(mrope=MRopeConfig)` queues the index's reads on its own one read,
with positions identical to the index's given in the batch and the index's errors unchanged.
Counted with `testing.sync_counter` (a count, not a time)."""

import pytest
import torch

from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from tests.rope.conftest import VIDEO, random_rows

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
CONFIGS = {family: MRopeConfig(family=family, tokens_per_second=2.0) for family in FAMILIES}


def _rope_batch(family: str, seed: int) -> tuple[dict, dict]:
    """(a right-padded batch with grids as position inputs, the index's keyword arguments); seed 2 has
    videos of 2 and 3 frames in every family."""
    ids, mask, images, videos, seconds = random_rows(family, 4, seed)
    rope = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    if family == "qwen2_5_vl":
        rope["second_per_grid_ts"] = seconds
    return dict(input_ids=ids, labels=ids.clone(), **{k: v for k, v in rope.items() if v is not None}), rope


@pytest.mark.parametrize("family", FAMILIES)
def test_get_rope_index_reads_once_and_pack_batch_adds_no_read(family):
    cfg = CONFIGS[family]
    batch, rope = _rope_batch(family, 2)
    assert rope["video_grid_thw"] is not None and int(rope["video_grid_thw"][:, 0].max()) > 1
    with count_host_syncs() as alone:
        positions = get_rope_index(batch["input_ids"], cfg, **rope).position_ids
    with count_host_syncs() as packing:
        packed = pack_batch(batch, label_style="hf", mrope=cfg)
    given = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")} | {"position_ids": positions}
    assert alone.total == 1, alone.report()
    assert packing.total == 1 and "checks.py" in packing.events[0].where, packing.report()
    assert torch.equal(packed.position_ids, pack_batch(given, label_style="hf").position_ids)


def test_pack_batch_raises_the_index_errors_after_the_rows_errors():
    """Block count and block size errors are get_rope_index's own; a bad mask (the rows') comes first."""
    cfg = CONFIGS["qwen3_vl"]
    batch, rope = _rope_batch("qwen3_vl", 2)
    fewer = {**batch, "video_grid_thw": batch["video_grid_thw"][:-1]}
    frames = int(batch["video_grid_thw"][:, 0].sum())
    blocks = int(((batch["input_ids"] == VIDEO) & (torch.roll(batch["input_ids"], 1, 1) != VIDEO)).sum())
    message = f"{blocks} video placeholder blocks in input_ids but {frames - int(batch['video_grid_thw'][-1, 0])} rows"
    rope_fewer = {**rope, "video_grid_thw": fewer["video_grid_thw"]}
    for call in (lambda: pack_batch(fewer, label_style="hf", mrope=cfg),
                 lambda: get_rope_index(fewer["input_ids"], cfg, **rope_fewer)):
        with count_host_syncs() as syncs, pytest.raises(ValueError, match=message + r" in video_grid_thw \(blocks at "
                                                                                r"row \d+ position \d+, "):
            call()
        assert syncs.total <= 3, syncs.report()  # the one read, then two to name the blocks (error path only)
    wider = {**batch, "video_grid_thw": batch["video_grid_thw"] * torch.tensor([1, 2, 1])}
    with pytest.raises(ValueError, match=r"the video block at input_ids row \d+ position \d+ has \d+ placeholder "
                                         r"tokens but its grid"):
        pack_batch(wider, label_style="hf", mrope=cfg)
    holes = batch["attention_mask"].clone()
    holes[0, 1] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        pack_batch({**fewer, "attention_mask": holes}, label_style="hf", mrope=cfg)


def test_omni_positions_ride_packings_read_with_audio_lengths_from_either_input():
    """Qwen3-Omni: `audio_seqlens` given, or the clip lengths packing reads from `feature_attention_mask`."""
    from tests.rope.test_omni import random_rows as omni_rows, thinker

    config, _ = thinker()
    cfg = MRopeConfig.from_hf_config(config)
    ids, mask, images, videos, seconds, audios = omni_rows(config, 3, 1, True)
    frames = int(audios.max())
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask, "image_grid_thw": images,
             "video_grid_thw": videos, "second_per_grid_ts": seconds, "use_audio_in_video": True,
             "pixel_values": torch.zeros(int(images.prod(1).sum()), 2),
             "pixel_values_videos": torch.zeros(int(videos.prod(1).sum()), 2)}
    with count_host_syncs() as alone:
        positions = get_rope_index(ids, cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                                   audio_seqlens=audios, second_per_grid_ts=seconds).position_ids
    assert alone.total == 1, alone.report()  # was 39: per row, block and grid entry
    given = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": mask, "position_ids": positions},
                       label_style="hf", position_layout="3BS").position_ids
    features = dict(input_features=torch.zeros(len(audios), 2, frames),
                    feature_attention_mask=(torch.arange(frames)[None] < audios[:, None]).long())
    for audio in (dict(audio_seqlens=audios), features):
        with count_host_syncs() as packing:
            packed = pack_batch(batch | audio, label_style="hf", mrope=cfg)
        assert packing.total == 1 and "checks.py" in packing.events[0].where, packing.report()
        assert torch.equal(packed.position_ids, given)
