"""`split_rows`, the parity probe's samples alone: each gets exactly what a collator would give it alone (its
images, videos with their seconds, audio clips with their masks and raw lengths, per-row fields, mRoPE inputs
and declared extras), by the packer's per-sample counts or, without them, by the packers' counting rule; a key
it cannot split is a ValueError naming it. No model: plain tensors."""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.validate.probe_split import SampleMedia, split_rows


def _omni():
    """(cfg, samples, their collated batch): images, videos (each its own seconds per grid) and audio clips."""
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, collate_omni, omni_samples

    cfg = TinyOmniConfig()
    samples = omni_samples(cfg, 5, seed=11)
    for i, sample in enumerate(samples):  # distinct seconds: a video given another's would show
        sample["second_per_grid_ts"] = 0.25 * (i + 1) + torch.arange(len(sample["second_per_grid_ts"])) * 0.125
    return cfg, samples, collate_omni(samples)


def _same_as_alone(one: dict, alone: dict) -> None:
    """`one` (a split sample) holds `alone` (the sample collated alone): equal tensors, audio frames padded to the
    batch's longest clip (zeros) where the sample alone pads to its own."""
    assert set(one) == set(alone), (sorted(one), sorted(alone))
    for key, value in alone.items():
        if key in ("input_features", "feature_attention_mask"):
            frames = value.shape[-1]
            assert torch.equal(one[key][..., :frames], value) and not one[key][..., frames:].any(), key
        else:
            assert torch.equal(one[key], value), key


@pytest.mark.parametrize("counted_by", ["micro_batch", "placeholders"])
def test_each_sample_gets_exactly_its_own_media(counted_by):
    """The split of the batch equals each sample collated alone, key by key: by a MicroBatch's counts, and by
    the packers' rule over each sample's placeholders when no counts are given."""
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.bridge.build_omni import collate_omni
    from megatron_vlm_packing.packing.media import MediaTokens

    cfg, samples, batch = _omni()
    if counted_by == "micro_batch":
        media = SampleMedia.of(pack_batch(batch, label_style="hf", mrope=cfg.mrope_config()))
        assert {kind for kind, _ in media.counts} == {"image", "video", "audio"}
    else:
        media = SampleMedia(MediaTokens.resolve(cfg.mrope_config(), require_counts=False))
    rows = split_rows(batch, media=media)
    assert [row for row, _ in rows] == list(range(len(samples)))
    for (_, one), sample in zip(rows, samples):
        _same_as_alone(one, collate_omni([sample]))


def test_rope_only_inputs_and_per_row_fields_are_split():
    """Grids and raw audio lengths without pixels / features (read by the mRoPE index alone), [B, 3, S] positions,
    mm_token_type_ids, seq_lens, a declared extra and the use_audio_in_video flag: each sample its own."""
    from megatron_vlm_packing.packing.media import MediaTokens

    cfg, samples, batch = _omni()
    lengths = batch["attention_mask"].sum(dim=1)
    b, s = batch["input_ids"].shape
    rope_only = {"input_ids": batch["input_ids"], "labels": batch["labels"], "seq_lens": lengths,
                 "image_grid_thw": batch["image_grid_thw"], "video_grid_thw": batch["video_grid_thw"],
                 "second_per_grid_ts": batch["second_per_grid_ts"], "audio_seqlens": batch["audio_seqlens"].tolist(),
                 "position_ids": torch.arange(b * 3 * s).reshape(b, 3, s), "mm_token_type_ids": batch["input_ids"] % 3,
                 "weights": torch.randn(b, s, 2), "use_audio_in_video": False}
    rows = split_rows(rope_only, media=SampleMedia(MediaTokens.resolve(cfg.mrope_config(), require_counts=False)),
                      extra_keys=("weights",))
    for (row, one), sample in zip(rows, samples):
        n = int(lengths[row])
        assert one["seq_lens"].tolist() == [n] and one["use_audio_in_video"] is False
        assert torch.equal(one["position_ids"], rope_only["position_ids"][row:row + 1, :, :n].transpose(0, 1))
        for key in ("mm_token_type_ids", "weights"):
            assert torch.equal(one[key], rope_only[key][row:row + 1, :n]), key
        for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
            if len(sample[key]):
                assert torch.equal(one[key], sample[key]), key
            else:
                assert key not in one, key
        assert one.get("audio_seqlens", []) == sample["audio_frames"]


def test_pre_packed_rows_give_one_sample_per_document():
    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [4, 3, 2, 0, 0, 0]])
    batch = {"input_ids": ids, "labels": ids, "attention_mask": (ids != 0).long(),
             "document_lengths": torch.tensor([[2, 3], [1, 2]])}
    rows = split_rows(batch)
    assert [row for row, _ in rows] == [0, 0, 1, 1]
    assert [one["input_ids"].tolist() for _, one in rows] == [[[5, 6]], [[7, 8, 9]], [[4]], [[3, 2]]]


def test_a_4d_mask_is_cut_to_each_sample():
    ids = torch.tensor([[5, 6, 7], [4, 3, 0]])
    keep = ids != 0
    masked = ~(torch.tril(torch.ones(3, 3, dtype=torch.bool))[None] & keep[:, None, :] & keep[:, :, None])
    rows = split_rows({"input_ids": ids, "labels": ids, "attention_mask": masked[:, None]})
    assert [tuple(one["attention_mask"].shape) for _, one in rows] == [(1, 1, 3, 3), (1, 1, 2, 2)]


def test_what_the_probe_cannot_split_is_named():
    """Never dropped: an undeclared per-token key, LLaVA's tiles; media without counts or an id to count them."""
    ids = torch.tensor([[5, 9, 9, 0], [9, 7, 0, 0]])
    batch = {"input_ids": ids, "labels": ids, "attention_mask": (ids != 0).long()}
    with pytest.raises(ValueError, match=r"cannot split \['weights'\] per sample"):
        split_rows({**batch, "weights": torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"cannot split \['num_image_tiles'\] per sample"):
        split_rows({**batch, "num_image_tiles": torch.ones(3)})
    videos = {**batch, "pixel_values_videos": torch.zeros(12, 4), "video_grid_thw": torch.tensor([[1, 2, 2]] * 3)}
    with pytest.raises(ValueError, match=r"cannot give video_grid_thw's videos to their samples: no per-sample "
                                         r"counts and no video_token_id"):
        split_rows(videos)
    with pytest.raises(ValueError, match=r"the per-sample video counts \[1, 1\] do not give 2 samples the 3 video"):
        split_rows(videos, media=SampleMedia(counts=(("video", (1, 1)),)))
    with pytest.raises(ValueError, match=r"row 1 has 1 video placeholder tokens, but the videos of "
                                         r"video_grid_thw in order give it 2"):
        from megatron_vlm_packing.packing.media import MediaTokens

        split_rows({**videos, "video_grid_thw": torch.tensor([[1, 4, 2]] * 3)},
                   media=SampleMedia(MediaTokens(video_token_id=9, require_counts=False)))
