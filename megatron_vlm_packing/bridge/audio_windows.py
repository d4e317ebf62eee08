"""Whether a Qwen3-Omni audio encoder keeps the clips of one call apart in its attention.

The encoder attends within windows (each clip, or each `n_window_infer` piece of a long clip) that it
passes to its attention as `cu_seqlens`. transformers 5.8.0's `Qwen3OmniMoeAudioAttention` hands them
to flash attention only: under eager or sdpa attention every frame of a call attends to every frame of
it, so clips encoded together read each other (5.12.1 and 5.24 split the windows for those too).
Megatron-Bridge 0.6.2 allows 5.8. The question is asked of the encoder's first attention layer itself,
once per attention layer and attention implementation (the answer is the attention code's, fixed for the
process): the packed path asks it on every micro-batch with several clips, which must not re-run the probe
and its read-back each time.
"""

from __future__ import annotations

import weakref

import torch

# attention module -> {its config's _attn_implementation (None without a config): the probe's answer}
_ANSWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def encoder_keeps_clips_apart(encoder) -> bool:
    """True when two windows given to the encoder's attention in one call each get what they get alone.
    Probed once per attention layer and attention implementation, then remembered.

    Args:
        encoder: a Qwen3-Omni audio encoder (transformers' `Qwen3OmniMoeAudioEncoder`: `layers[0].self_attn`
            taking `(hidden_states [S, D], cu_seqlens [W+1] int32)`).
    """
    attention = encoder.layers[0].self_attn
    implementation = getattr(getattr(attention, "config", None), "_attn_implementation", None)
    answers = _ANSWERS.setdefault(attention, {})
    if implementation not in answers:
        answers[implementation] = _windows_kept_apart(attention)
    return answers[implementation]


def _windows_kept_apart(attention) -> bool:
    """The probe: two windows in one call of `attention` vs the first alone (one small read-back)."""
    weight = next(attention.parameters())
    generator = torch.Generator().manual_seed(0)
    width = attention.embed_dim
    # A second window of 8x the scale: read by the first, it moves the first's output by O(1), far above rounding.
    states = torch.cat([torch.randn(2, width, generator=generator), 8 * torch.randn(2, width, generator=generator)])
    states = states.to(device=weight.device, dtype=weight.dtype)
    bounds = torch.tensor([0, 2, 4], dtype=torch.int32, device=weight.device)
    with torch.no_grad():
        together = attention(states, cu_seqlens=bounds)[:2].float()
        alone = attention(states[:2], cu_seqlens=bounds[:2]).float()
    return torch.allclose(together, alone, rtol=2e-2, atol=2e-2 * float(alone.abs().max()))


def clip_groups(lengths: list[int], n_window: int) -> list[list[int]]:
    """Clips (indices) whose chunks pad alike alone, the same min(frames, 2 * n_window): an encoder call of
    one group gives each clip what it gets alone, where the encoder keeps clips apart.

    Example: lengths [30, 250, 30, 120], n_window 50 -> [[0, 2], [1, 3]].
    """
    groups: dict[int, list[int]] = {}
    for clip, length in enumerate(lengths):
        groups.setdefault(min(length, 2 * n_window), []).append(clip)
    return list(groups.values())
