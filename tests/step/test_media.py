"""Per-sample placeholder checks, the tiny audio tower and the synthetic media (pure, single process)."""

import pytest
import torch

from megatron_vlm_packing.data import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.audio import (TinyAudioTower, audio_lengths_from_mask,
                                               audio_tokens_per_clip_from_mask)
from megatron_vlm_packing.models.merge import check_placeholders_per_sample, sample_boundaries

I = 9  # placeholder id


def test_placeholders_must_cover_whole_items_of_their_own_sample():
    ids = torch.tensor([[1, I, I, 2, 0, 0], [I, I, I, 3, 0, 0]])  # dense rows: sample 0 has 2, sample 1 has 3
    bounds = sample_boundaries(ids)
    assert bounds.tolist() == [0, 6, 12]
    check_placeholders_per_sample(ids, bounds, [2, 3], token_id=I, field="image")
    check_placeholders_per_sample(ids, bounds, [2, 3], token_id=I, field="image", items_per_sample=(1, 1))
    moved = ids.clone()
    moved[0, 2], moved[1, 4] = 1, I  # one placeholder moves to the other sample: totals still agree
    with pytest.raises(ValueError, match=r"sample 0 has 1 image placeholder tokens \(id 9\), which do not cover whole images"):
        check_placeholders_per_sample(moved, bounds, [2, 3], token_id=I, field="image")
    with pytest.raises(ValueError, match=r"sample 1 has 3 image placeholder tokens = 1 images, but images_per_sample says 2"):
        check_placeholders_per_sample(ids, bounds, [2, 3], token_id=I, field="image", items_per_sample=(1, 2))
    with pytest.raises(ValueError, match=r"5 video placeholder tokens \(id 9\) in input_ids but the 1 video inputs give 4"):
        check_placeholders_per_sample(ids, bounds, [4], token_id=I, field="video")


def test_audio_lengths_come_from_a_right_padded_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert audio_lengths_from_mask(mask) == [3, 4]
    assert audio_tokens_per_clip_from_mask(torch.ones(2, 40, dtype=torch.long), 50) == [5, 5]  # Qwen3-Omni's encoder arithmetic
    with pytest.raises(ValueError, match=r"feature_attention_mask rows \[1\] are not right-padded"):
        audio_lengths_from_mask(torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]]))


def test_audio_lengths_refuse_a_mask_that_is_not_0_or_1():
    """A value other than 0 and 1 (a mask no packer checked: a micro-batch built or edited by hand) was read as 1
    (`.bool()`), and a float mask as the 0/1 mask it looked like; the packers refuse both in the batch."""
    with pytest.raises(ValueError, match=r"feature_attention_mask rows \[0\] are not right-padded 0/1 masks"):
        audio_lengths_from_mask(torch.tensor([[1, 2, 0, 0], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"feature_attention_mask rows \[1\] are not right-padded 0/1 masks"):
        audio_tokens_per_clip_from_mask(torch.tensor([[1, 1, 0, 0], [1, 1, 1, -1]]), 50)
    with pytest.raises(ValueError, match=r"feature_attention_mask must be a bool or integer tensor of 0/1 values, "
                                         r"got dtype torch.float32"):
        audio_tokens_per_clip_from_mask(torch.ones(2, 40), 50)
    assert audio_lengths_from_mask(torch.tensor([[True, False], [True, True]])) == [1, 2]


def test_audio_tower_encodes_each_clip_alone():
    torch.manual_seed(0)
    tower = TinyAudioTower(mel_bins=4, width=8, out_hidden=6)
    a, b = torch.randn(4, 12), torch.randn(4, 30)
    features = torch.zeros(2, 4, 30)
    features[0, :, :12], features[1] = a, b
    mask = torch.zeros(2, 30, dtype=torch.long)
    mask[0, :12], mask[1] = 1, 1
    both = tower(features, mask)
    ones = lambda frames: torch.ones(1, frames, dtype=torch.long)  # noqa: E731
    alone = torch.cat([tower(a[None], ones(12)), tower(b[None], ones(30))])
    assert both.shape == (sum(audio_tokens_per_clip_from_mask(mask, 50)), 6)
    torch.testing.assert_close(both, alone)


def test_synthetic_media_keep_the_image_only_samples_and_add_videos_and_audio():
    plain = synthetic_samples(3, seed=5)
    assert all(set(s) == {"input_ids", "labels", "image_grid_thw", "pixel_values"} for s in plain)
    cfg = SyntheticVLMConfig(max_text=12, max_images=1, max_videos=1, max_audios=2)
    batch = collate(synthetic_samples(6, seed=5, cfg=cfg))
    ids = batch["input_ids"]
    assert int((ids == cfg.video_token_id).sum()) == int((batch["video_grid_thw"].prod(1) // 4).sum())
    clips = audio_tokens_per_clip_from_mask(batch["feature_attention_mask"], 50)
    assert int((ids == cfg.audio_token_id).sum()) == sum(clips)
    text = batch["labels"][batch["labels"] != -100]
    assert int(text.max()) <= cfg.text_vocab  # no special id is ever a target
