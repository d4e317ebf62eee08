"""`TokenCounter.for_family` / `TokenCounter.from_hf_config`: the counter of a model family's processor, so that a
Qwen3-VL user need not know how many tokens its per-step timestamps take (the default counter, left as it was,
counts none: a 4-step 16x16 video planned at 258 tokens took 290, and bins overflowed the capacity).

Qwen3-VL's counts are checked against `pack_batch`'s real tokens of rows expanded as its processor expands them,
for videos of several lengths and frame rates: frames sampled by `Qwen3VLVideoProcessor.sample_frames`' rule, step
times from transformers' own `Qwen3VLProcessor._calculate_timestamps`."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.planner import SampleMetadata, SampleTable, TokenCounter
from megatron_vlm_packing.rope import MRopeConfig
from megatron_vlm_packing.rope.omni import audio_tokens_per_clip

SAMPLE_FPS, TEMPORAL_PATCH, MIN_FRAMES, MAX_FRAMES = 2, 2, 4, 768  # Qwen3VLVideoProcessor's defaults
VOCAB = {"<|vision_start|>": 5, "<|vision_end|>": 6, "<|video_pad|>": 8, "<|image_pad|>": 9}
QWEN3_VL = MRopeConfig(family="qwen3_vl", image_token_id=9, video_token_id=8, vision_start_token_id=5,
                       mrope_section=(24, 20, 20))


def _sampled_frames(total_frames: int, video_fps: float) -> np.ndarray:
    """`Qwen3VLVideoProcessor.sample_frames` at its defaults: `fps` frames a second, within [min, max] frames."""
    count = int(total_frames / video_fps * SAMPLE_FPS)
    count = min(max(count, MIN_FRAMES), MAX_FRAMES, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int)


def _video_tokens(total_frames: int, video_fps: float, h: int, w: int) -> tuple[tuple[int, int, int], list[str]]:
    """(grid, tokens) of a video as Qwen3-VL's processor expands it and Qwen's tokenizer splits the timestamps:
    '<', one token per digit, '.', ' seconds', '>'."""
    processing = pytest.importorskip("transformers.models.qwen3_vl.processing_qwen3_vl")
    frames = _sampled_frames(total_frames, video_fps)
    seconds = processing.Qwen3VLProcessor._calculate_timestamps(None, frames, video_fps, TEMPORAL_PATCH)
    t = math.ceil(len(frames) / TEMPORAL_PATCH)  # the processor pads the frames to whole temporal patches
    assert len(seconds) == t
    tokens = ["<|vision_start|>"]
    for step in range(t):
        whole, tenth = f"{seconds[step]:.1f}".split(".")
        tokens += ["<", *whole, ".", tenth, " seconds", ">", "<|vision_start|>"] + ["<|video_pad|>"] * (h * w // 4)
        tokens += ["<|vision_end|>"]
    return (t, h, w), tokens + ["<|vision_end|>"]


def _ids(tokens: list[str]) -> list[int]:
    return [VOCAB.get(token, 100 + sum(map(ord, token))) for token in tokens]


# (total frames, the video's fps) of each sample's videos: from 1 s to 6 min, across 10 s and 100 s of timestamps
VIDEOS = [[(30, 30)], [(120, 30), (96, 24)], [(299, 30)], [(300, 30), (48, 24)], [(630, 60)], [(1800, 30)],
          [(2999, 30)], [(3100, 25)], [(10800, 30)]]


def test_the_qwen3_vl_preset_counts_what_pack_batch_packs():
    text = [3, 7, 0, 12, 1, 5, 2, 9, 4]  # tokens outside the videos
    rows, grids, metadata = [], [], []
    for sample, (videos, words) in enumerate(zip(VIDEOS, text)):
        sizes = [(4 + 4 * ((sample + k) % 3), 8 + 4 * (k % 2)) for k in range(len(videos))]
        made = [_video_tokens(frames, fps, h, w) for (frames, fps), (h, w) in zip(videos, sizes)]
        rows.append(_ids(["x"] * words + [token for _, tokens in made for token in tokens]))
        grids += [grid for grid, _ in made]
        metadata.append(SampleMetadata(words, video_grids=tuple(grid for grid, _ in made)))
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    keep = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    packed = pack_batch({"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep,
                         "video_grid_thw": torch.tensor(grids)}, label_style="hf", mrope=QWEN3_VL)
    counted = TokenCounter.for_family("qwen3_vl")(SampleTable.from_samples(metadata))
    assert counted.tolist() == list(packed.plan.real_lengths) == [len(row) for row in rows]
    assert int(counted.sum()) == packed.stats.real_tokens
    assert (TokenCounter()(SampleTable.from_samples(metadata)) < counted).all()  # the default: no timestamps


def test_the_qwen3_vl_preset_counts_the_four_step_video_of_the_report():
    table = SampleTable.from_samples([SampleMetadata(0, video_grids=((4, 16, 16),))])
    assert TokenCounter()(table).tolist() == [258]
    assert TokenCounter.for_family("qwen3_vl")(table).tolist() == [290]


def test_timestamps_count_their_digits_band_by_band():
    """A step's whole seconds take one token per digit: 6 + 2 tokens a step below 10 s, 7 + 2 to 100 s, 8 + 2 on,
    found without a token count per step (a grid of 2**40 steps is counted as fast)."""
    counter = TokenCounter.for_family("qwen3_vl")
    steps = [1, 10, 11, 100, 101, 1000, 2**40]
    table = SampleTable.from_samples([SampleMetadata(0, video_grids=((t, 2, 2),)) for t in steps])
    per_step = [8] * 10 + [9] * 90 + [10] * 900
    expected = [2 + sum(per_step[:t]) + t for t in steps[:-1]]
    got = counter(table).tolist()
    assert got[:-1] == expected
    big = 2**40  # 1e12 s: 13 digits at the end
    assert got[-1] == 2 + big + 2 * big + 5 * big + sum(d * (min(big, 10**d) - 10**(d - 1) + (d == 1))
                                                          for d in range(1, 14))


def test_other_families_keep_one_block_per_video_and_their_own_audio_rule():
    table = SampleTable.from_samples([SampleMetadata(5, image_grids=((1, 4, 4),), video_grids=((4, 16, 16),),
                                                     audio_frames=(100, 30))])
    one_block = 5 + (4 + 2) + (256 + 2)
    for family in ("qwen2_vl", "qwen2_5_vl"):
        assert TokenCounter.for_family(family) == TokenCounter()
    omni = TokenCounter.for_family("qwen3_omni")
    assert omni.video_frame_tokens == 0 and omni.video_timestamp_seconds is None  # its video text has no timestamps
    audio = sum(audio_tokens_per_clip([100, 30], 50).tokens) + 2 * 2
    assert omni(table).tolist() == [one_block + audio]
    assert TokenCounter.for_family("qwen3_omni", audio_n_window=25).audio_n_window == 25


def _hf_config(model_type: str, merge: int = 2, **extra) -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type, image_token_id=9, video_token_id=8, vision_start_token_id=5,
                           vision_config=SimpleNamespace(spatial_merge_size=merge, tokens_per_second=2), **extra)


@pytest.mark.parametrize("model_type, family", [("qwen2_vl", "qwen2_vl"), ("qwen2_5_vl", "qwen2_5_vl"),
                                                ("qwen3_vl", "qwen3_vl"), ("qwen3_vl_moe", "qwen3_vl")])
def test_from_hf_config_takes_the_family_and_merge_of_the_config(model_type, family):
    assert TokenCounter.from_hf_config(_hf_config(model_type)) == TokenCounter.for_family(family)
    assert TokenCounter.from_hf_config(_hf_config(model_type, merge=4)).spatial_merge == 4


def test_from_hf_config_of_qwen3_omni_reads_the_thinkers_audio_window():
    thinker = _hf_config("qwen3_omni_moe_thinker", audio_token_id=7, audio_start_token_id=6,
                         audio_config=SimpleNamespace(n_window=100))
    top = SimpleNamespace(model_type="qwen3_omni_moe", thinker_config=thinker)
    assert TokenCounter.from_hf_config(top) == TokenCounter.for_family("qwen3_omni", audio_n_window=100)


def test_from_a_real_transformers_config():
    transformers = pytest.importorskip("transformers")
    assert TokenCounter.from_hf_config(transformers.Qwen3VLConfig()) == TokenCounter.for_family("qwen3_vl")


def test_unknown_families_and_bad_seconds_are_refused():
    with pytest.raises(ValueError, match=r"TokenCounter.for_family: unknown family 'llava'; known: \['qwen2_5_vl', "
                                         r"'qwen2_vl', 'qwen3_omni', 'qwen3_vl'\]"):
        TokenCounter.for_family("llava")
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama'"):
        TokenCounter.from_hf_config(SimpleNamespace(model_type="llama"))
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match=r"TokenCounter.video_timestamp_seconds must be None or a finite "
                                             r"number > 0, got "):
            TokenCounter(video_timestamp_seconds=bad)
    slower = replace(TokenCounter.for_family("qwen3_vl"), video_timestamp_seconds=2.0)  # a processor at fps=1
    table = SampleTable.from_samples([SampleMetadata(0, video_grids=((6, 2, 2),))])
    assert slower(table).tolist() == [2 + 6 * (1 + 2 + 5) + 5 * 1 + 2]  # steps at 0.5 ... 10.5 s: the last has 2 digits


def _image_tokens(h: int, w: int) -> list[str]:
    """An image as every Qwen-VL processor expands it: vision_start, h*w/merge^2 placeholders, vision_end."""
    return ["<|vision_start|>"] + ["<|image_pad|>"] * (h * w // 4) + ["<|vision_end|>"]


def _one_block_video_tokens(t: int, h: int, w: int) -> list[str]:
    """A Qwen2-VL / Qwen2.5-VL video: one block of t*h*w/merge^2 placeholders inside its two wrappers."""
    return ["<|vision_start|>"] + ["<|video_pad|>"] * (t * h * w // 4) + ["<|vision_end|>"]


# Each sample: (text tokens, [(image h, w)], [(video total frames at 30 fps, h, w)]): images alone, videos alone,
# both, several of each, and none
MIXED = [(4, [(4, 4)], []), (0, [(8, 4), (4, 12)], []), (6, [(4, 8)], [(60, 4, 4)]), (2, [], [(330, 8, 4)]),
         (9, [(12, 8), (4, 4)], [(30, 4, 8), (120, 8, 8)]), (3, [], [])]


def _pack_mixed(family: str, mrope: MRopeConfig) -> tuple:
    """(pack_batch's packed batch, `TokenCounter.for_family(family)`'s counts) of the `MIXED` samples."""
    rows, image_grids, video_grids, metadata = [], [], [], []
    for words, images, videos in MIXED:
        tokens = ["x"] * words + [token for h, w in images for token in _image_tokens(h, w)]
        images_here = tuple((1, h, w) for h, w in images)
        videos_here = []
        for frames, h, w in videos:
            if family == "qwen3_vl":
                grid, made = _video_tokens(frames, 30, h, w)
            else:
                grid = (math.ceil(len(_sampled_frames(frames, 30)) / TEMPORAL_PATCH), h, w)
                made = _one_block_video_tokens(*grid)
            tokens += made
            videos_here.append(grid)
        rows.append(_ids(tokens))
        image_grids += images_here
        video_grids += videos_here
        metadata.append(SampleMetadata(words, image_grids=images_here, video_grids=tuple(videos_here)))
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    keep = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    batch = {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep,
             "image_grid_thw": torch.tensor(image_grids), "video_grid_thw": torch.tensor(video_grids)}
    if family == "qwen2_5_vl":
        batch["second_per_grid_ts"] = torch.ones(len(video_grids))
    packed = pack_batch(batch, label_style="hf", mrope=mrope)
    return packed, TokenCounter.for_family(family)(SampleTable.from_samples(metadata)), rows


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_each_preset_counts_what_pack_batch_packs_of_images_and_mixed_rows(family):
    """Rows of images alone, of images and videos together (Qwen3-VL's videos with their timestamps) and of text
    alone: each family's counter gives pack_batch's real tokens, row by row."""
    mrope = replace(QWEN3_VL, family=family, mrope_interleaved=False) if family != "qwen3_vl" else QWEN3_VL
    packed, counted, rows = _pack_mixed(family, mrope)
    assert counted.tolist() == list(packed.plan.real_lengths) == [len(row) for row in rows]
    assert int(counted.sum()) == packed.stats.real_tokens


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_omni"])
@pytest.mark.parametrize("window", [0, -5, 2.5, True])
def test_for_family_refuses_a_bad_audio_window_of_every_family(family, window):
    """`audio_n_window` is checked whatever the family: before, a family without audio dropped it unread, so
    for_family("qwen3_vl", audio_n_window=0) returned a counter as if the value were fine."""
    with pytest.raises(ValueError, match=rf"audio_n_window must be an int >= 1, got {window!r}"):
        TokenCounter.for_family(family, audio_n_window=window)
