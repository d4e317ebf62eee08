"""A deterministic synthetic multimodal dataset in the Qwen-VL layout (no downloads).

Each sample: variable-length text with a learnable rule (token i+1 = token i + stride, mod the
text vocabulary) and 0-4 images of varying grids. An image is `vision_start`, t*h*w/4 `image`
placeholder tokens and `vision_end`; its patches are random features. Labels are Hugging Face
style (unshifted, -100 on vision tokens and pads), rows are right-padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.models.vision import MERGE


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


def _sample(rng: torch.Generator, cfg: SyntheticVLMConfig) -> dict:
    text_vocab = cfg.image_token_id - 1  # ids 1 .. image_token_id-1 are text
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
    return {
        "input_ids": torch.cat(pieces), "labels": torch.cat(labels),
        "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        "pixel_values": torch.cat(pixels) if pixels else torch.zeros(0, cfg.patch_features),
    }


def synthetic_samples(num: int, *, seed: int, cfg: SyntheticVLMConfig = SyntheticVLMConfig()) -> list[dict]:
    """`num` samples, identical for the same seed."""
    rng = torch.Generator().manual_seed(seed)
    return [_sample(rng, cfg) for _ in range(num)]


def collate(samples: list[dict], *, pad_token_id: int = 0, row_length: int | None = None) -> dict:
    """Right-pad samples into a batch: input_ids, labels, attention_mask [B, S]; images concatenated.

    Raises:
        ValueError: a sample longer than `row_length` (nothing is truncated silently).
    """
    longest = max(len(s["input_ids"]) for s in samples)
    row_length = row_length or longest
    if longest > row_length:
        raise ValueError(f"a sample has {longest} tokens but row_length is {row_length}")
    ids = torch.full((len(samples), row_length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), row_length), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), row_length, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    return {
        "input_ids": ids, "labels": labels, "attention_mask": mask,
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
    }
