"""A realistic synthetic metadata distribution for benchmarks, tests and the demo (no data needed).

Per sample: lognormal text (median `text_median` tokens, sigma `text_sigma`, clipped to
`text_max`); 0-8 images (none for `p_text_only` of samples) with h and w patches drawn from 4..64
(even, so a 2x2 merge divides them); a video for `p_video` of samples (2-16 temporal patches of
8..32 x 8..32); an audio clip for `p_audio` (2-30 s at 50 encoder frames per second).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_vlm_packing.planner.metadata import SampleTable


@dataclass(frozen=True, kw_only=True)
class SyntheticMix:
    text_median: float = 400.0
    text_sigma: float = 1.0
    text_max: int = 16384
    p_text_only: float = 0.4
    max_images: int = 8
    grid_min: int = 4
    grid_max: int = 64
    p_video: float = 0.1
    p_audio: float = 0.1


def synthetic_table(num_samples: int, *, seed: int, mix: SyntheticMix = SyntheticMix()) -> SampleTable:
    """`num_samples` samples of `mix`, identical for the same seed."""
    rng = np.random.default_rng(seed)
    n = num_samples
    text = np.minimum(np.rint(rng.lognormal(np.log(mix.text_median), mix.text_sigma, n)), mix.text_max)
    text = np.maximum(text, 1).astype(np.int64)
    images = np.where(rng.random(n) < mix.p_text_only, 0, rng.integers(1, mix.max_images + 1, n))
    image_owner = np.repeat(np.arange(n), images)
    hw = 2 * rng.integers(mix.grid_min // 2, mix.grid_max // 2 + 1, (len(image_owner), 2))
    image_grids = np.column_stack([np.ones(len(image_owner), np.int64), hw])
    video_owner = np.flatnonzero(rng.random(n) < mix.p_video)
    video_grids = np.column_stack([rng.integers(2, 17, len(video_owner)),
                                   2 * rng.integers(4, 17, (len(video_owner), 2))])
    audio_owner = np.flatnonzero(rng.random(n) < mix.p_audio)
    audio_frames = rng.integers(100, 1501, len(audio_owner))
    return SampleTable(text_tokens=text, image_grids=image_grids.astype(np.int64), image_owner=image_owner,
                       video_grids=video_grids.astype(np.int64), video_owner=video_owner.astype(np.int64),
                       audio_frames=audio_frames.astype(np.int64), audio_owner=audio_owner.astype(np.int64))
