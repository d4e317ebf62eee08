"""What a model family's processor writes around its media, for `TokenCounter`: its presets and Qwen3-VL's
per-step video timestamps.

Qwen3-VL's processor (transformers' `Qwen3VLProcessor.replace_video_token`) writes each temporal grid step of a
video as `<{t:.1f} seconds>`, vision_start, its h*w/merge^2 placeholders, vision_end, where t is the mean time of
the step's two frames (`_calculate_timestamps`). Its video processor samples 2 frames a second (`fps=2`), so the
steps lie 1 s apart from 0.25 s on: step k at (k + 0.25) * 1.0 s. Qwen's tokenizer splits a timestamp as '<', one
token per digit of the whole seconds, '.', the tenth, ' seconds', '>'. Exact for videos sampled at the processor's
rate: up to `max_frames / fps` = 384 s at its defaults (a longer one is sampled sparser, its steps further apart,
its timestamps longer: set `video_timestamp_seconds` to its seconds per step). The other families write a video as
one block of placeholders inside its two wrappers (Qwen3-Omni too: its video text has no timestamps, time is in
its positions).
"""

from __future__ import annotations

import bisect

import numpy as np

from megatron_vlm_packing.packing.bounds import checked_int

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_omni", "qwen3_vl")
QWEN3_VL_STEP_SECONDS = 1.0  # the video processor's 2 frames a second, 2 frames a temporal patch
_FIXED_TOKENS = 5  # '<', '.', the tenth, ' seconds', '>'


def family_fields(family: str, *, audio_n_window: int) -> dict:
    """The `TokenCounter` fields that differ from its defaults (the Qwen2-VL / Qwen2.5-VL layout) for `family`.

    Raises:
        ValueError: a family not in `FAMILIES`, or an `audio_n_window` that is no int >= 1 (whatever the family:
            one without audio would otherwise drop it unread, a bad value passing as a good one).
    """
    if family not in FAMILIES:
        raise ValueError(f"TokenCounter.for_family: unknown family {family!r}; known: {sorted(FAMILIES)}")
    audio_n_window = checked_int(audio_n_window, "TokenCounter.for_family: audio_n_window", least=1)
    if family == "qwen3_vl":  # vision_start / vision_end and a timestamp around every temporal grid step
        return {"video_frame_tokens": 2, "video_timestamp_seconds": QWEN3_VL_STEP_SECONDS}
    if family == "qwen3_omni":  # each clip takes `audio_output_length` of its mel frames
        return {"audio_n_window": audio_n_window}
    return {}


def _whole_digits(step: int, seconds: float) -> int:
    """Digits of the whole seconds of step `step`'s timestamp, formatted as the processor formats it."""
    return len(f"{(step + 0.25) * seconds:.1f}".partition(".")[0])


def timestamp_tokens(steps: np.ndarray, seconds: float) -> np.ndarray:
    """[V] float64 tokens of the timestamps of videos of `steps` ([V] int64) temporal grid steps, `seconds` apart.

    Band by band of whole-second digits (monotone in the step, each band's end found by bisection): a few
    formatted timestamps per band, whatever the steps. Example: steps [4, 12], seconds 1.0 -> [24, 74]
    (6 tokens a step below 10 s, 7 from 10 s).
    """
    total = _FIXED_TOKENS * steps.astype(np.float64)
    longest = int(steps.max(initial=0))
    start = 0
    while start < longest:
        digits = _whole_digits(start, seconds)
        end = start + bisect.bisect_right(range(start, longest), digits, key=lambda k: _whole_digits(k, seconds))
        total += digits * np.clip(steps - start, 0, end - start).astype(np.float64)
        start = end
    return total
