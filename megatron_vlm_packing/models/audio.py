"""A tiny Qwen3-Omni-style audio tower: mel frames of each clip -> a few audio tokens per clip.

Inputs follow the Qwen3-Omni processor convention: `input_features` [A, F, L] (mel bins x frames,
each clip right-padded to L frames) and `feature_attention_mask` [A, L] (1 at real frames). Each
clip yields `audio_output_length(real frames, n_window)` tokens, the same count Qwen3-Omni's audio
encoder gives (so `rope.get_rope_index` for the qwen3_omni family places them right). Clips never
see each other: each is encoded alone, packed or not.

Shape legend: A = clips, F = mel bins, L = padded frames, D = tower width, M = audio tokens of all
clips, H = language-model hidden size.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_vlm_packing.rope.omni import audio_output_length


def audio_lengths_from_mask(feature_attention_mask: torch.Tensor) -> list[int]:
    """Real frames per clip from a right-padded [A, L] bool or integer 0/1 mask (1 = real); one host sync.

    Raises:
        ValueError: a mask that is not 2D, not bool or integer (`check_feature_mask_dtype`), or a clip
            whose real frames are not a prefix (holes or left padding would silently shift frames) or
            whose mask holds a value other than 0 and 1 (read as 1 by `.bool()`).
    """
    from megatron_vlm_packing.packing.media_audio import check_feature_mask_dtype

    if not isinstance(feature_attention_mask, torch.Tensor) or feature_attention_mask.dim() != 2:
        raise ValueError(f"feature_attention_mask must be an [A, L] tensor, got "
                         f"{getattr(feature_attention_mask, 'shape', type(feature_attention_mask))}")
    check_feature_mask_dtype(feature_attention_mask)
    keep = feature_attention_mask.bool()
    lengths = keep.sum(1)
    prefix = torch.arange(keep.shape[1], device=keep.device)[None] < lengths[:, None]
    not_binary = (feature_attention_mask != 0) & (feature_attention_mask != 1)  # [A, L]
    bad = torch.nonzero((keep != prefix).any(1) | not_binary.any(1)).flatten().tolist()
    if bad:
        raise ValueError(f"feature_attention_mask rows {bad} are not right-padded 0/1 masks (real frames are 1 and "
                         f"come first, pad frames 0)")
    return lengths.tolist()


def check_audio_lengths(audio_lengths, feature_attention_mask: torch.Tensor) -> None:
    """Real frames per clip given beside the mask (`AudioInputs.audio_lengths`) must be the mask's.

    A tower given lengths reads no mask; lengths that no packer checked (a micro-batch edited after
    packing) would encode other frames than the mask says, silently. One host sync.

    Raises:
        ValueError: naming both lists, or a mask that is not right-padded (`audio_lengths_from_mask`).
    """
    from_mask = audio_lengths_from_mask(feature_attention_mask)
    if [int(n) for n in audio_lengths] != from_mask:
        raise ValueError(f"audio_lengths {list(audio_lengths)} but feature_attention_mask has {from_mask} real frames "
                         f"per clip: give the lengths of the mask (or no lengths)")


def audio_tokens_per_clip_from_mask(feature_attention_mask: torch.Tensor, n_window: int) -> list[int]:
    """Language-model tokens of each clip of an [A, L] `feature_attention_mask`: Qwen3-Omni's encoder output length
    (`audio_output_length`) of its real frames (`audio_lengths_from_mask`: one host sync). A clip without real
    frames takes 0 tokens here; `rope.omni.audio_tokens_per_clip` (from raw lengths, host ints) refuses it."""
    lengths = torch.tensor(audio_lengths_from_mask(feature_attention_mask), dtype=torch.long)
    return audio_output_length(lengths, n_window).tolist()


class TinyAudioTower(nn.Module):
    """Frames -> MLP -> mean over `audio_output_length` equal chunks -> projector to the LM width."""

    def __init__(self, *, mel_bins: int, width: int, out_hidden: int, n_window: int = 50):
        super().__init__()
        self.n_window, self.out_hidden = n_window, out_hidden
        self.frame_embed = nn.Sequential(nn.Linear(mel_bins, width), nn.GELU(), nn.Linear(width, width))
        self.projector = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out_hidden))

    def forward(self, input_features: torch.Tensor, feature_attention_mask: torch.Tensor, *,
                audio_lengths: tuple[int, ...] | None = None) -> torch.Tensor:
        """input_features: [A, F, L]; feature_attention_mask: [A, L] -> [M, H] audio embeddings in clip order.

        `audio_lengths`: A host ints, real frames per clip, as packing's one read found them (mask
        checked right-padded there); given, the tower reads nothing back (no host sync).

        Raises:
            ValueError: features and mask disagree in clips or frames, or the mask is not right-padded.
        """
        if input_features.dim() != 3 or input_features.shape[0] != feature_attention_mask.shape[0] \
                or input_features.shape[2] != feature_attention_mask.shape[-1]:
            raise ValueError(f"input_features {tuple(input_features.shape)} must be [A, F, L] matching "
                             f"feature_attention_mask {tuple(feature_attention_mask.shape)} [A, L]")
        if audio_lengths is not None and len(audio_lengths) != input_features.shape[0]:
            raise ValueError(f"audio_lengths has {len(audio_lengths)} entries but input_features has "
                             f"{input_features.shape[0]} clips")
        lengths = list(audio_lengths) if audio_lengths is not None else audio_lengths_from_mask(feature_attention_mask)
        counts = [int(audio_output_length(n, self.n_window)) for n in lengths]  # host ints
        dtype = self.frame_embed[0].weight.dtype
        out = []
        for clip, (frames, tokens) in enumerate(zip(lengths, counts)):
            x = self.frame_embed(input_features[clip, :, :frames].transpose(0, 1).to(dtype))  # [frames, D]
            chunks = torch.tensor_split(x, tokens, dim=0)  # `tokens` nonempty chunks (tokens <= frames)
            out.append(torch.stack([c.mean(0) for c in chunks]))  # [tokens, D]
        if not out:
            return input_features.new_zeros(0, self.out_hidden)
        return self.projector(torch.cat(out))
