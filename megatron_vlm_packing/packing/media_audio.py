"""Audio inputs of a collated batch (Qwen3-Omni), typed and counted per sample.

Two inputs carry each clip's length: `feature_attention_mask` (the clip's real mel frames, read by
the audio tower) and `audio_seqlens` (its raw length, read by the mRoPE index). Each must give every
row exactly the audio placeholder tokens it holds (clip k takes `rope.omni.audio_tokens_per_clip` of
its length, `media_counts.items_per_row`), and when both are given they must agree clip by clip. Their
values ride the rows' one host read (`queue_audio_reads`), beside the vision values of `media.py`.

Shape legend: A = clips, F = mel bins, L = frames.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.packing.bounds import int_entries
from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.packing.media import media_tensor
from megatron_vlm_packing.packing.media_counts import MediaHost, items_per_row, never_fails, position_input, row_counts
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.micro_batch import AudioInputs

AUDIO_KEYS = ("input_features", "feature_attention_mask")


def queue_audio_reads(batch: dict, input_ids: torch.Tensor, keep, tokens: MediaTokens, checks, *,
                      counted: bool) -> dict:
    """Queue on `checks` (a `rows.DeferredChecks`) the audio values, so that they ride the rows' one
    host read: with `audio_seqlens` entries, its values and the audio placeholder tokens per row (when
    the id is known and not `counted` already by `media_counts.queue_media_reads`), for `check_audio_seqlens`;
    the clip frame lengths of `feature_attention_mask` (checked right-padded; its detailed error raised
    when not), for `audio_inputs`. `keep()`: the [B, S] keep-mask. Returns name -> entry.
    """
    entries = {}
    _queue_audio_seqlens(batch, input_ids, keep, tokens, checks, entries, counted)
    mask = batch.get("feature_attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() and not mask.is_floating_point() \
            and not mask.is_complex():
        from megatron_vlm_packing.packing.lengths import lengths_from_keep_mask, right_padded_reads

        values, fails = right_padded_reads(mask.to(input_ids.device), "feature_attention_mask")
        entries["audio_frames"] = checks.add(
            values, fails, lambda: lengths_from_keep_mask(mask, field="feature_attention_mask"))
    return entries


def _queue_audio_seqlens(batch: dict, input_ids, keep, tokens: MediaTokens, checks, entries: dict,
                         counted: bool) -> None:
    """With `audio_seqlens` entries (Qwen3-Omni raw audio lengths, read by the mRoPE index), queue its
    values and the audio placeholder tokens per row (when the id is known and not `counted` already), for
    `check_audio_seqlens`. Integer tensors only: another dtype is refused there, not cast here."""
    seqlens = batch.get("audio_seqlens")
    if not position_input(seqlens):
        return
    if tokens.audio_token_id is not None and not counted:
        entries["audio"] = checks.add(((input_ids == tokens.audio_token_id) & keep()).sum(dim=1), never_fails, None)
    if isinstance(seqlens, torch.Tensor) and is_integer_tensor(seqlens):
        entries["audio_seqlens"] = checks.add(seqlens.to(input_ids.device, torch.long).reshape(-1), never_fails,
                                              None)


def audio_inputs(batch: dict, host: MediaHost, tokens: MediaTokens) -> AudioInputs | None:
    """The batch's audio clips with real frame counts and per-row counts; None without audio."""
    if batch.keys().isdisjoint(AUDIO_KEYS):
        return None
    features = media_tensor(batch, "input_features", (3,), "[A, F, L] mel features", floating="mel features")
    mask = media_tensor(batch, "feature_attention_mask", (2,), "an [A, L] 0/1 mask")
    if features is None and mask is None:
        return None
    if features is None or mask is None:
        missing = "feature_attention_mask" if features is not None else "input_features"
        raise ValueError(f"audio needs both input_features and feature_attention_mask; {missing} is missing")
    if tuple(mask.shape) != (features.shape[0], features.shape[2]):
        raise ValueError(f"feature_attention_mask is {tuple(mask.shape)} but input_features {tuple(features.shape)} "
                         f"needs [A, L] = [{features.shape[0]}, {features.shape[2]}]")
    check_feature_mask_dtype(mask)
    if features.shape[0] == 0:
        return None
    from megatron_vlm_packing.packing.lengths import lengths_from_keep_mask
    from megatron_vlm_packing.rope.omni import audio_tokens_per_clip

    read = host.values.get("audio_frames")  # None for a mask of no frames ([A, 0]): read on its own
    frames = read[:mask.shape[0]] if read is not None else lengths_from_keep_mask(mask, field="feature_attention_mask")
    clips = audio_tokens_per_clip(frames, tokens.audio_n_window)  # frames are counts of 1s: empty means 0 frames
    if clips.empty:
        raise ValueError(f"feature_attention_mask gives clip {clips.empty[0]} no real frames")
    rows = row_counts(host, tokens.audio_token_id, "audio", "input_features", tokens.require_counts)
    per_row = items_per_row(rows, clips.tokens, kind="audio", field="feature_attention_mask", row_name=host.row_name)
    return AudioInputs(input_features=features, feature_attention_mask=mask, audio_lengths=tuple(frames),
                       audios_per_sample=per_row)


def check_feature_mask_dtype(mask: torch.Tensor) -> None:
    """`feature_attention_mask` [A, L] is a bool or integer 0/1 mask, as the Qwen3-Omni processor gives it
    (int32, from Whisper's feature extractor): a float one was read as the 0/1 mask it looked like (the audio
    tower takes `.bool()`), a complex one without its imaginary part. Its values are checked with the lengths.

    Raises:
        ValueError: naming the dtype.
    """
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"feature_attention_mask must be a bool or integer tensor of 0/1 values, got dtype "
                         f"{mask.dtype}")


def check_audio_seqlens(batch: dict, host: MediaHost, tokens: MediaTokens, audio: AudioInputs | None = None) -> None:
    """`audio_seqlens` (raw audio lengths, one per clip in token order) must give each row exactly the
    audio placeholder tokens it holds: clip k takes `rope.omni.audio_tokens_per_clip` of its entry. Checked
    whatever else the batch holds, with or without an mRoPE index (which checks it only when it runs). With the
    batch's clips (`audio`, from `audio_inputs`) each entry must also equal its clip's real frames
    (`feature_attention_mask[k].sum()`, read in the one sync): two lengths that give the same tokens
    would otherwise pass, and the mRoPE index and the audio tower would read different lengths.

    Raises:
        ValueError: a non-integer `audio_seqlens` or one not [A], an entry < 1 (no encoder output), a row whose audio
        placeholders disagree with its clips' lengths, or clips left over (naming the row, the clips
        and both counts); no `audio_token_id` known to count them (unless counts are not required);
        an entry (or the number of entries) that differs from `feature_attention_mask`'s.
    """
    seqlens = batch.get("audio_seqlens")
    if not position_input(seqlens):
        return
    from megatron_vlm_packing.rope.index_checks import check_audio_seqlens_type  # the one type / shape check of them
    from megatron_vlm_packing.rope.omni import audio_tokens_per_clip

    check_audio_seqlens_type(seqlens)
    # Python ints either way: numpy ints (`int_entries`) would wrap in `audio_output_length`'s arithmetic.
    raw = host.values["audio_seqlens"] if isinstance(seqlens, torch.Tensor) else int_entries(seqlens, "audio_seqlens",
                                                                                              "raw audio lengths")

    clips = audio_tokens_per_clip(raw, tokens.audio_n_window)
    if clips.empty:
        short = clips.empty[0]
        raise ValueError(f"audio_seqlens entry {short} is {raw[short]}: raw audio lengths must be >= 1 (its audio "
                         f"encoder output has no tokens)")
    rows = row_counts(host, tokens.audio_token_id, "audio", "audio_seqlens", tokens.require_counts)
    items_per_row(rows, clips.tokens, kind="audio", field="audio_seqlens", row_name=host.row_name)
    if audio is not None:
        _check_against_feature_mask(raw, audio.audio_lengths)


def _check_against_feature_mask(raw: list[int], frames: tuple[int, ...]) -> None:
    """`audio_seqlens` entries (host ints) equal the clips' real frames of `feature_attention_mask`."""
    if len(raw) != len(frames):
        raise ValueError(f"audio_seqlens has {len(raw)} entries but feature_attention_mask has {len(frames)} clips: "
                         f"both give the raw length of each audio clip")
    bad = next((k for k, (n, f) in enumerate(zip(raw, frames)) if n != f), None)
    if bad is not None:
        raise ValueError(f"audio_seqlens and feature_attention_mask disagree on audio {bad}: audio_seqlens[{bad}] is "
                         f"{raw[bad]} but feature_attention_mask[{bad}] sums to {frames[bad]} (the mRoPE index would "
                         f"read one length and the audio tower the other)")
