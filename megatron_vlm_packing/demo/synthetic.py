"""A deterministic synthetic multimodal dataset in the Qwen-VL / Qwen3-Omni layout (no downloads).

Each sample: variable-length text with a learnable rule (token i+1 = token i + stride, mod the
text vocabulary) and 0-4 images of varying grids. An image is `vision_start`, t*h*w/4 `image`
placeholder tokens and `vision_end`; its patches are random features. With `max_videos` /
`max_audios` > 0 a sample also gets videos (`vision_start`, t*h*w/4 `video` placeholders,
`vision_end`; t = 2 frames) and audio clips (`audio_start`, one `audio` placeholder per encoder
output token, `audio_end`; random mel frames), each followed by a few more text tokens. Labels are
Hugging Face style (unshifted, -100 on every multimodal token and pads), rows are right-padded.

With the defaults (no videos, no audio) the samples are exactly those of the image-only dataset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.models.vision import MERGE
from megatron_vlm_packing.packing.dense import right_pad_samples


@dataclass(frozen=True)
class SyntheticVLMConfig:
    vocab_size: int = 256
    image_token_id: int = 253
    vision_start_id: int = 254
    vision_end_id: int = 255
    pad_token_id: int = 0
    patch_features: int = 48  # 3 channels x 4 x 4 pixels per patch
    min_text: int = 4
    max_text: int = 96
    max_images: int = 4
    grid_choices: tuple[int, ...] = (2, 4, 6)  # h and w in patches, multiples of the 2x2 merge
    max_videos: int = 0
    video_token_id: int = 252
    video_frames: int = 2
    max_audios: int = 0
    audio_token_id: int = 251
    audio_start_id: int = 250
    audio_end_id: int = 249
    mel_bins: int = 16
    audio_frames: tuple[int, int] = (8, 40)  # real mel frames per clip, inclusive range
    audio_n_window: int = 50

    @property
    def text_vocab(self) -> int:
        """Text ids are 1 .. text_vocab; every special id in use lies above."""
        special = [self.image_token_id]
        if self.max_videos:
            special.append(self.video_token_id)
        if self.max_audios:
            special += [self.audio_token_id, self.audio_start_id, self.audio_end_id]
        return min(special) - 1


def _ints(rng: torch.Generator, low: int, high: int, n: int = 1) -> list[int]:
    return torch.randint(low, high, (n,), generator=rng).tolist()


def _video_block(rng: torch.Generator, cfg: SyntheticVLMConfig):
    h, w = (cfg.grid_choices[i] for i in _ints(rng, 0, len(cfg.grid_choices), 2))
    t = cfg.video_frames
    n = t * h * w // (MERGE * MERGE)
    block = torch.tensor([cfg.vision_start_id] + [cfg.video_token_id] * n + [cfg.vision_end_id])
    return block, [t, h, w], torch.randn(t * h * w, cfg.patch_features, generator=rng)


def _audio_block(rng: torch.Generator, cfg: SyntheticVLMConfig):
    from megatron_vlm_packing.rope.omni import audio_output_length

    frames = _ints(rng, cfg.audio_frames[0], cfg.audio_frames[1] + 1)[0]
    n = int(audio_output_length(torch.tensor(frames), cfg.audio_n_window))
    block = torch.tensor([cfg.audio_start_id] + [cfg.audio_token_id] * n + [cfg.audio_end_id])
    return block, torch.randn(cfg.mel_bins, frames, generator=rng)


def _more_media(rng: torch.Generator, cfg: SyntheticVLMConfig, last_token: int, stride: int) -> dict:
    """Videos, then audio clips, each followed by 3 text tokens continuing the rule."""
    pieces, labels, grids, pixels, clips = [], [], [], [], []
    kinds = ["video"] * _ints(rng, 0, cfg.max_videos + 1)[0] if cfg.max_videos else []
    kinds += ["audio"] * _ints(rng, 0, cfg.max_audios + 1)[0] if cfg.max_audios else []
    for kind in kinds:
        if kind == "video":
            block, grid, patches = _video_block(rng, cfg)
            grids.append(grid), pixels.append(patches)
        else:
            block, features = _audio_block(rng, cfg)
            clips.append(features)
        text = (last_token + stride * torch.arange(1, 4)) % cfg.text_vocab + 1
        last_token = int(text[-1]) - 1
        pieces += [block, text]
        labels += [torch.full_like(block, -100), text]
    return dict(pieces=pieces, labels=labels, video_grid_thw=grids, pixel_values_videos=pixels, audio=clips)


def _sample(rng: torch.Generator, cfg: SyntheticVLMConfig) -> dict:
    text_vocab = cfg.text_vocab
    num_images = int(torch.randint(0, cfg.max_images + 1, (1,), generator=rng))
    text_len = int(torch.randint(cfg.min_text, cfg.max_text + 1, (1,), generator=rng))
    stride = int(torch.randint(1, 4, (1,), generator=rng))
    start = int(torch.randint(1, text_vocab, (1,), generator=rng))
    text = (start + stride * torch.arange(text_len)) % text_vocab + 1
    cuts = sorted(torch.randint(0, text_len + 1, (num_images,), generator=rng).tolist())
    pieces, labels, grids, pixels, prev = [], [], [], [], 0
    for cut in cuts + [text_len]:
        pieces.append(text[prev:cut]); labels.append(text[prev:cut]); prev = cut
        if len(grids) == num_images:
            break
        h, w = (cfg.grid_choices[int(i)] for i in torch.randint(0, len(cfg.grid_choices), (2,), generator=rng))
        n = h * w // (MERGE * MERGE)
        block = torch.tensor([cfg.vision_start_id] + [cfg.image_token_id] * n + [cfg.vision_end_id])
        pieces.append(block); labels.append(torch.full_like(block, -100))
        grids.append([1, h, w]); pixels.append(torch.randn(h * w, cfg.patch_features, generator=rng))
    sample = {"image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
              "pixel_values": torch.cat(pixels) if pixels else torch.zeros(0, cfg.patch_features)}
    if cfg.max_videos or cfg.max_audios:
        more = _more_media(rng, cfg, int(text[-1]) - 1, stride)
        pieces += more["pieces"]; labels += more["labels"]
        sample["video_grid_thw"] = torch.tensor(more["video_grid_thw"], dtype=torch.long).reshape(-1, 3)
        sample["pixel_values_videos"] = torch.cat(more["pixel_values_videos"]) if more["pixel_values_videos"] \
            else torch.zeros(0, cfg.patch_features)
        sample["audio"] = more["audio"]  # list of [F, frames] mel features
    return {"input_ids": torch.cat(pieces), "labels": torch.cat(labels), **sample}


def synthetic_samples(num: int, *, seed: int, cfg: SyntheticVLMConfig = SyntheticVLMConfig()) -> list[dict]:
    """`num` samples, identical for the same seed."""
    rng = torch.Generator().manual_seed(seed)
    return [_sample(rng, cfg) for _ in range(num)]


def _collate_audio(samples: list[dict]) -> dict:
    """Clips of every sample in order: input_features [A, F, Lmax], feature_attention_mask [A, Lmax]."""
    clips = [clip for s in samples for clip in s["audio"]]
    if not clips:
        return {}
    frames = max(c.shape[1] for c in clips)
    features = torch.zeros(len(clips), clips[0].shape[0], frames)
    mask = torch.zeros(len(clips), frames, dtype=torch.long)
    for i, clip in enumerate(clips):
        features[i, :, :clip.shape[1]], mask[i, :clip.shape[1]] = clip, 1
    return {"input_features": features, "feature_attention_mask": mask}


def collate(samples: list[dict], *, pad_token_id: int = 0, row_length: int | None = None) -> dict:
    """Right-pad samples into a batch: input_ids, labels, attention_mask [B, S]; media concatenated.

    Images always give `pixel_values` / `image_grid_thw` (possibly empty); videos and audio keys
    appear only when some sample has a video / an audio clip.

    Raises:
        ValueError: no samples, or a sample longer than `row_length` (nothing is truncated silently).
    """
    if not samples:  # else max()'s "iterable argument is empty"
        raise ValueError("collate got no samples: a batch needs at least one (did a batch sampler yield [])?")
    longest = max(len(s["input_ids"]) for s in samples)
    row_length = row_length or longest
    if longest > row_length:
        raise ValueError(f"a sample has {longest} tokens but row_length is {row_length}")
    ids, labels, mask = right_pad_samples(samples, row_length, pad_token_id)
    batch = {
        "input_ids": ids, "labels": labels, "attention_mask": mask,
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
    }
    if any(len(s.get("video_grid_thw", ())) for s in samples):
        batch["pixel_values_videos"] = torch.cat([s["pixel_values_videos"] for s in samples if "pixel_values_videos" in s])
        batch["video_grid_thw"] = torch.cat([s["video_grid_thw"] for s in samples if "video_grid_thw" in s])
    if any(s.get("audio") for s in samples):
        batch.update(_collate_audio([s for s in samples if "audio" in s]))
    return batch
