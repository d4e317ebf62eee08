"""The packers' refusal of given [3, B, S] positions flat on all channels beside a multi-token image or video
(`packing.mrope_channels`) never trips on correct positions: those of each family's Hugging Face model
(`get_rope_index`) and of ours, over random rows of text, images and videos (1x1-merged ones included, whose
correct positions are flat), taken by pack_batch and pad_batch."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index, token_types
from tests.rope.conftest import END, IMAGE, START, VIDEO, hf_config, hf_get_rope_index

# One item: (is a video, t, h, w) in patches (merge 2); h and w mostly 2, so many items are 1x1-merged.
SIDES = st.sampled_from([2, 2, 2, 4, 6])
ITEMS = st.tuples(st.booleans(), st.integers(1, 3), SIDES, SIDES)
ROWS = st.lists(st.lists(st.tuples(st.integers(0, 3), ITEMS), max_size=3), min_size=1, max_size=4)


def _media(images, videos, seconds) -> dict:
    media = {}
    if images is not None:
        media |= dict(image_grid_thw=images, pixel_values=torch.zeros(int(images.prod(1).sum()), 4))
    if videos is not None:
        media |= dict(video_grid_thw=videos, pixel_values_videos=torch.zeros(int(videos.prod(1).sum()), 4),
                      second_per_grid_ts=seconds)
    return media


def _rows(family: str, rows: list, seconds_choice: float):
    """(ids, mask, image grids, video grids, seconds) of rows of (text tokens before, item) pairs plus a text tail;
    Qwen3-VL videos one block per frame with a timestamp token before each, as its processor lays them out."""
    tokens_of_rows, images, videos = [], [], []
    for row in rows:
        tokens = [7]
        for text, (is_video, t, h, w) in row:
            tokens += [11 + i for i in range(text)]
            if not is_video:
                images.append([1, h, w])
                tokens += [START] + [IMAGE] * (h * w // 4) + [END]
            else:
                videos.append([t, h, w])
                frames = [(t, [START] + [VIDEO] * (t * h * w // 4) + [END])] if family != "qwen3_vl" \
                    else [(1, [9, START] + [VIDEO] * (h * w // 4) + [END])] * t
                tokens += [tok for _, block in frames for tok in block]
        tokens_of_rows.append(tokens + [8])
    width = max(len(r) for r in tokens_of_rows) + 2
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(tokens_of_rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    grid = lambda x: torch.tensor(x, dtype=torch.long).reshape(-1, 3) if x else None  # noqa: E731
    seconds = torch.full((len(videos),), seconds_choice) if videos else None
    return ids, mask, grid(images), grid(videos), seconds


@settings(max_examples=60, deadline=None)
@given(family=st.sampled_from(["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]), rows=ROWS,
       seconds=st.sampled_from([0.1, 0.25, 0.5, 1.0, 2.0]), use_hf=st.booleans())
def test_correct_positions_are_never_refused(family, rows, seconds, use_hf):
    hf = hf_config(family)
    config = MRopeConfig.from_hf_config(hf)
    ids, mask, images, videos, seconds = _rows(family, rows, seconds)
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = seconds
    if use_hf:
        positions = hf_get_rope_index(family, hf)(ids, mm_token_type_ids=token_types(ids, config), **kwargs)[0]
    else:
        positions = get_rope_index(ids, config, **kwargs).position_ids
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, position_ids=positions,
                 **_media(images, videos, seconds if family == "qwen2_5_vl" else None))
    ids_kw = dict(image_token_id=IMAGE, video_token_id=VIDEO, position_layout="3BS")  # B may be 3
    for packer in (pack_batch, pad_batch):
        out = packer(batch, label_style="hf", **ids_kw)
        assert out.position_ids.dim() == 3
    pack_batch(batch, label_style="hf", host_reads=True, **ids_kw)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 3), use_audio_in_video=st.booleans(), use_hf=st.booleans())
def test_correct_qwen3_omni_positions_are_never_refused(seed, rows, use_audio_in_video, use_hf):
    """Qwen3-Omni: images, videos (their audio interleaved or not) and audio clips, float positions."""
    from tests.rope.test_omni import random_rows, thinker

    hf, reference = thinker()
    config = MRopeConfig.from_hf_config(hf)
    ids, mask, images, videos, seconds, audios = random_rows(hf, rows, seed, use_audio_in_video)
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                  use_audio_in_video=use_audio_in_video, audio_seqlens=audios)
    positions = reference(ids, second_per_grids=seconds, **kwargs)[0] if use_hf \
        else get_rope_index(ids, config, second_per_grid_ts=seconds, **kwargs).position_ids
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, position_ids=positions,
                 use_audio_in_video=use_audio_in_video, **_media(images, videos, seconds))
    if audios is not None:
        batch["audio_seqlens"] = audios
    ids_kw = dict(image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                  audio_token_id=config.audio_token_id, position_layout="3BS")
    for packer in (pack_batch, pad_batch):
        assert packer(batch, label_style="hf", **ids_kw).position_ids.dim() == 3
