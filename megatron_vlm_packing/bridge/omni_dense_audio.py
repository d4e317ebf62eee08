"""Whether Bridge 0.6.2's dense Qwen3-Omni audio path can pair each clip with its own audio features.

That path (`Qwen3OmniThinkerModel`, rows without `packed_seq_params`) runs the encoder on every clip at
once, then cuts its output into clips by `audio_model._get_feat_extract_output_lengths(frames)[1]`, the
second of a (feature, output) lengths pair. The transformers versions a Bridge user meets differ there:
- 5.24.0's `Qwen3OmniMoeAudioEncoder` has no such method: an AttributeError inside Bridge.
- 5.8 to 5.12.1 (Bridge 0.6.2's declared range) have one, by an older audio model's rule,
  (F - 1) // 2 + 1 then (x - 2) // 2 + 1: 25 for a clip of 100 frames, where the encoder makes 13
  (`rope.omni.audio_output_length`, its three stride-2 convolutions per 2 * n_window frames). Bridge then
  cuts later clips at the wrong offsets or fails ("Audio features and audio tokens do not match").
So the question is asked of the encoder's method, not of the version: the counts it gives for a few clip
lengths against the counts the encoder makes.
"""

from __future__ import annotations

import torch

PROBE_FRAMES = (100, 1, 37, 101, 250, 1000)  # one whole chunk (n_window 50), short, a chunk and a frame, several


def dense_audio_problem(encoder) -> str | None:
    """Why Bridge's dense audio path cannot run on this audio encoder (a clause for an error), or None.

    Args:
        encoder: the thinker's `audio_model` (transformers' `Qwen3OmniMoeAudioEncoder`, with its `n_window`).
    """
    from megatron_vlm_packing.rope.omni import audio_output_length

    method = getattr(encoder, "_get_feat_extract_output_lengths", None)
    if method is None:
        return "calls the audio encoder's _get_feat_extract_output_lengths, which this transformers' encoder lacks"
    frames = torch.tensor(PROBE_FRAMES)
    claimed = torch.as_tensor(method(frames)[1])
    made = audio_output_length(frames, int(encoder.n_window))
    if torch.equal(claimed, made):
        return None
    at = int(torch.nonzero(claimed != made)[0, 0])
    return (f"cuts the encoder's output into clips by the audio encoder's _get_feat_extract_output_lengths, which "
            f"in this transformers counts {int(claimed[at])} tokens for a clip of {PROBE_FRAMES[at]} frames where "
            f"the encoder makes {int(made[at])} (n_window {int(encoder.n_window)})")


def dense_audio_shim(encoder) -> None:
    """Give this audio encoder instance the `_get_feat_extract_output_lengths` Bridge 0.6.2's dense path calls,
    counting what the encoder makes, where its own method is missing or counts otherwise (`dense_audio_problem`);
    for the parity truth (`bridge.truth`), whose dense path must be Bridge's own code."""
    from megatron_vlm_packing.rope.omni import audio_output_length

    if dense_audio_problem(encoder) is not None:
        encoder.__dict__["_get_feat_extract_output_lengths"] = lambda lengths: (
            lengths, audio_output_length(lengths, int(encoder.n_window)))
