"""Qwen3-Omni: our positions equal the Hugging Face thinker's own get_rope_index (float positions)."""

import functools
import types

import pytest
import torch

from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.rope.omni import audio_output_length

transformers = pytest.importorskip("transformers")


def thinker():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Reference,
    )

    # n_window stated: transformers 5.12.1 defaults it to 100 but counts audio tokens as for 50 (the rows' window)
    config = Qwen3OmniMoeThinkerConfig(position_id_per_seconds=25, audio_config={"n_window": 50}, text_config={
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True}})
    # The thinker config leaves the block-wrapper ids to the top-level config: give them here.
    config.vision_start_token_id, config.vision_end_token_id, config.audio_end_token_id = 151652, 151653, 151648
    owner = types.SimpleNamespace(config=config, spatial_merge_size=config.vision_config.spatial_merge_size)
    owner.get_llm_pos_ids_for_vision = functools.partial(Reference.get_llm_pos_ids_for_vision, owner)
    return config, functools.partial(Reference.get_rope_index, owner)


def random_rows(config, batch, seed, use_audio_in_video):
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    text = lambda: [rand(1, 1000) for _ in range(rand(0, 3))]  # noqa: E731
    vs, ve = config.vision_start_token_id, config.vision_end_token_id
    as_, ae = config.audio_start_token_id, config.audio_end_token_id
    rows, images, videos, seconds, audios = [], [], [], [], []
    for _ in range(batch):
        tokens = text()
        for _ in range(rand(1, 3)):
            kind = rand(0, 2)
            h, w = 2 * rand(1, 3), 2 * rand(1, 3)
            if kind == 0:
                images.append([1, h, w])
                tokens += [vs] + [config.image_token_id] * (h * w // 4) + [ve]
            elif kind == 1 and not use_audio_in_video:
                t = rand(1, 3)
                videos.append([t, h, w]); seconds.append(rand(1, 6) / 4)
                tokens += [vs] + [config.video_token_id] * (t * h * w // 4) + [ve]
            elif kind == 1:
                t, raw = rand(1, 3), rand(20, 300)
                videos.append([t, h, w]); seconds.append(rand(1, 6) / 4); audios.append(raw)
                n_audio = int(audio_output_length(torch.tensor(raw), 50))
                # the processor interleaves video and audio tokens by time; positions only need the counts
                tokens += [vs, as_] + [config.audio_token_id] * n_audio + [config.video_token_id] * (t * h * w // 4) + [ae, ve]
            else:
                raw = rand(20, 300)
                audios.append(raw)
                tokens += [as_] + [config.audio_token_id] * int(audio_output_length(torch.tensor(raw), 50)) + [ae]
            tokens += text()
        rows.append(tokens)
    width = max(map(len, rows)) + 2
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    grid = lambda x: torch.tensor(x).reshape(-1, 3) if x else None  # noqa: E731
    return ids, mask, grid(images), grid(videos), torch.tensor(seconds) if seconds else None, \
        torch.tensor(audios) if audios else None


@pytest.mark.parametrize("use_audio_in_video", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_identical_to_the_hf_thinker(seed, use_audio_in_video):
    config, reference = thinker()
    ours_cfg = MRopeConfig.from_hf_config(config)
    assert ours_cfg.family == "qwen3_omni" and ours_cfg.position_id_per_seconds == 25
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, seed, use_audio_in_video)
    expected, expected_deltas = reference(ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                                          use_audio_in_video=use_audio_in_video, audio_seqlens=audios,
                                          second_per_grids=seconds)
    ours = get_rope_index(ids, ours_cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                          use_audio_in_video=use_audio_in_video, audio_seqlens=audios, second_per_grid_ts=seconds)
    assert torch.equal(ours.position_ids, expected)
    assert torch.equal(ours.deltas.reshape(-1), expected_deltas.reshape(-1).to(ours.deltas.dtype))


def test_pack_batch_packs_omni_float_positions_per_sample():
    from megatron_vlm_packing import pack_batch

    config, _ = thinker()
    cfg = MRopeConfig.from_hf_config(config)
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, 1, True)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask, "image_grid_thw": images,
             "video_grid_thw": videos, "second_per_grid_ts": seconds, "audio_seqlens": audios,
             "use_audio_in_video": True, "pixel_values": torch.zeros(int(images.prod(1).sum()), 2),
             "pixel_values_videos": torch.zeros(int(videos.prod(1).sum()), 2)}
    packed = pack_batch(batch, mrope=cfg, cp_size=2, label_style="hf")
    assert sum(packed.vision.images_per_sample) == len(images) and sum(packed.vision.videos_per_sample) == len(videos)
    full = get_rope_index(ids, cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                          use_audio_in_video=True, audio_seqlens=audios, second_per_grid_ts=seconds).position_ids
    assert packed.position_ids.dtype == torch.float32
    cu, cu_p = packed.packed_seq_params.cu_seqlens_q.tolist(), packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    for row in range(3):
        n = cu[row + 1] - cu[row]
        assert torch.equal(packed.position_ids[:, 0, cu_p[row]:cu_p[row] + n], full[:, row, :n])
        if cu_p[row + 1] - cu_p[row] > n:  # pad slots continue after the sample, never restart
            assert packed.position_ids[0, 0, cu_p[row] + n] == full[:, row, :n].max() + 1


def test_omni_count_mismatches_raise():
    config, _ = thinker()
    cfg = MRopeConfig.from_hf_config(config)
    ids = torch.tensor([[5, 151652] + [config.image_token_id] * 4 + [151653, 151647, config.audio_token_id, 151648]])
    with pytest.raises(ValueError, match=r"more audio_seqlens blocks than the 0 entries of audio_seqlens: the block "
                                         r"opening at input_ids row 0 position 7 has none"):
        get_rope_index(ids, cfg, image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="1 blocks in input_ids use image_grid_thw, which has 2 entries"):
        get_rope_index(ids, cfg, image_grid_thw=torch.tensor([[1, 4, 4], [1, 2, 2]]), audio_seqlens=torch.tensor([4]))


def test_omni_seconds_no_video_reads_are_refused():
    config, _ = thinker()
    cfg = MRopeConfig.from_hf_config(config)
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, 1, True)
    assert videos is not None and len(seconds) == len(videos)
    extra = torch.cat([seconds, seconds[:1]])  # one more than the video blocks
    with pytest.raises(ValueError, match=rf"{len(videos) + 1} entries in second_per_grid_ts but {len(videos)} video "
                                         r"blocks in input_ids"):
        get_rope_index(ids, cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                       use_audio_in_video=True, audio_seqlens=audios, second_per_grid_ts=extra)


@pytest.mark.parametrize("host_reads", [False, True])
def test_a_row_with_no_kept_token_beside_media_rows(host_reads):
    """pack_batch keeps empty rows (e.g. a padded-out sample); the Qwen3-Omni index raised torch.cat's
    "expected a non-empty list of Tensors" on one. The other rows keep the HF thinker's positions."""
    from megatron_vlm_packing import pack_batch

    config, reference = thinker()
    cfg = MRopeConfig.from_hf_config(config)
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, 2, True)
    expected = reference(ids, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                         use_audio_in_video=True, audio_seqlens=audios, second_per_grids=seconds)[0]
    ids, mask = torch.cat([ids[:1], ids]), torch.cat([torch.zeros_like(mask[:1]), mask])  # row 0: no kept token
    ours = get_rope_index(ids, cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                          use_audio_in_video=True, audio_seqlens=audios, second_per_grid_ts=seconds)
    assert torch.equal(ours.position_ids[:, 1:], expected) and not ours.position_ids[:, 0].any()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask, "image_grid_thw": images,
             "video_grid_thw": videos, "second_per_grid_ts": seconds, "audio_seqlens": audios,
             "use_audio_in_video": True}
    if images is not None:
        batch["pixel_values"] = torch.zeros(int(images.prod(1).sum()), 2)
    if videos is not None:
        batch["pixel_values_videos"] = torch.zeros(int(videos.prod(1).sum()), 2)
    packed = pack_batch(batch, label_style="hf", mrope=cfg, host_reads=host_reads)
    cu, cu_p = packed.packed_seq_params.cu_seqlens_q.tolist(), packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    assert packed.plan.segment_rows == (1, 2, 3)  # the empty row gets no segment
    for k in range(3):
        n = cu[k + 1] - cu[k]
        assert torch.equal(packed.position_ids[:, 0, cu_p[k]:cu_p[k] + n], expected[:, k, :n])


@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_pack_batch_with_the_hf_thinkers_own_index_as_mrope(use_audio_in_video):
    """transformers' Qwen3-Omni get_rope_index names the seconds `second_per_grids`: the batch's
    `second_per_grid_ts` is given to it under that name (it was refused as an input the callable never
    reads), and the pack equals the one our MRopeConfig index makes."""
    from megatron_vlm_packing import pack_batch

    config, reference = thinker()
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, 2, use_audio_in_video)
    assert seconds is not None
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask, "image_grid_thw": images,
             "video_grid_thw": videos, "second_per_grid_ts": seconds, "audio_seqlens": audios,
             "use_audio_in_video": use_audio_in_video}
    ours = pack_batch(batch, mrope=MRopeConfig.from_hf_config(config), label_style="hf")
    ids_of = dict(image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                  audio_token_id=config.audio_token_id)  # a callable has no config to find the placeholders in
    theirs = pack_batch(batch, mrope=reference, label_style="hf", **ids_of)
    assert torch.equal(theirs.position_ids, ours.position_ids)
    with pytest.raises(ValueError, match=r"\['second_per_grid_ts'\] but the mrope callable get_rope_index takes none"):
        pack_batch(batch, mrope=_no_seconds(reference), label_style="hf", **ids_of)


def _no_seconds(reference):
    """The thinker's index without a seconds parameter: the batch's seconds would go unread."""
    def get_rope_index(input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None,
                       use_audio_in_video=False, audio_seqlens=None):
        return reference(input_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                         attention_mask=attention_mask, use_audio_in_video=use_audio_in_video,
                         audio_seqlens=audio_seqlens)
    return get_rope_index


def _megatron_labels(ids, mask):
    """Next-token targets on each row's real tokens (-100 at its last one and at padding)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return labels.masked_fill(torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1) == 0, -100)


@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_bridges_omni_key_names_pack_as_ours(use_audio_in_video):
    """Megatron-Bridge's Qwen3-Omni collate keeps the processor's `video_second_per_grid` and adds
    `audio_feature_lengths` (each clip's real mel frames): with label_style="megatron" they are read as
    `second_per_grid_ts` and `audio_seqlens`, the same quantities, and the pack is the one of our names.
    Before, refused as unknown keys."""
    from megatron_vlm_packing import pack_batch

    config, _ = thinker()
    cfg = MRopeConfig.from_hf_config(config)
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, 5, use_audio_in_video)
    assert seconds is not None and audios is not None
    common = {"input_ids": ids, "labels": _megatron_labels(ids, mask), "attention_mask": mask,
              "image_grid_thw": images, "video_grid_thw": videos, "use_audio_in_video": use_audio_in_video}
    ours = pack_batch({**common, "second_per_grid_ts": seconds, "audio_seqlens": audios}, mrope=cfg,
                      label_style="megatron")
    bridge = pack_batch({**common, "video_second_per_grid": seconds, "audio_feature_lengths": audios}, mrope=cfg,
                        label_style="megatron")
    for field in ("input_ids", "labels", "loss_mask", "position_ids"):
        assert torch.equal(getattr(bridge, field), getattr(ours, field)), field
    doubled = pack_batch({**common, "video_second_per_grid": 2 * seconds, "audio_feature_lengths": audios},
                         mrope=cfg, label_style="megatron")
    assert not torch.equal(doubled.position_ids, ours.position_ids)  # the seconds are read, not dropped


@pytest.mark.parametrize("key, message", [
    ("video_second_per_grid", r"batch key 'video_second_per_grid' is the Qwen3-Omni processor's name for "
                              r"second_per_grid_ts.* use label_style='megatron' .* rename it second_per_grid_ts"),
    ("audio_feature_lengths", r"batch key 'audio_feature_lengths' is Megatron-Bridge's qwen3_omni_collate_fn's key "
                              r"\(the processor has none\).* rename it audio_seqlens"),
])
def test_bridges_omni_key_names_with_hf_labels_are_refused(key, message):
    """Under label_style="hf" either key is refused, naming both readings: Megatron-Bridge's batch (labels already
    shifted: label_style='megatron') or an HF-style batch (rename it); accepted, Bridge's would be shifted twice."""
    from megatron_vlm_packing import pack_batch, pad_batch

    ids = torch.tensor([[5, 6, 7, 8]])
    for packer in (pack_batch, pad_batch):
        with pytest.raises(ValueError, match=message):
            packer({"input_ids": ids, "labels": ids, key: torch.tensor([1])}, label_style="hf")


@pytest.mark.parametrize("bridge_key, ours", [("video_second_per_grid", "second_per_grid_ts"),
                                              ("audio_feature_lengths", "audio_seqlens")])
def test_bridges_omni_key_beside_ours_is_refused(bridge_key, ours):
    from megatron_vlm_packing import pack_batch

    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=rf"{bridge_key} \(Megatron-Bridge's name for {ours}\) is given and so is "
                                         rf"the batch key '{ours}': give it once"):
        pack_batch({"input_ids": ids, "labels": ids, bridge_key: torch.tensor([1]), ours: torch.tensor([1])},
                   label_style="megatron")
