"""Deterministic Qwen-VL samples (text, images, videos) for a `TinyBridgeConfig`: no downloads.

Layout as the Qwen processors write it: an image is `vision_start`, h*w/merge^2 image placeholders,
`vision_end`; a Qwen3-VL video is one such block of video placeholders per temporal grid step
(its processor puts a timestamp before each frame), a Qwen2.5-VL video one block of t*h*w/merge^2.
Labels are Hugging Face style (unshifted, -100 on vision tokens); rows are right-padded.

Shape legend: P = image patches, Pv = video patches, F = patch features.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig
from megatron_vlm_packing.packing.dense import right_pad_samples

GRIDS = (2, 4)  # h and w in patches (multiples of the 2x2 merge)


def _block(cfg: TinyBridgeConfig, token: int, count: int) -> torch.Tensor:
    ids = cfg.token_ids
    return torch.tensor([ids["vision_start_token_id"]] + [token] * count + [ids["vision_end_token_id"]])


def _media(rng, cfg: TinyBridgeConfig, *, video: bool):
    """(token blocks, grid [3], patches [t*h*w, F]) of one image or video."""
    h, w = (GRIDS[int(i)] for i in torch.randint(0, len(GRIDS), (2,), generator=rng))
    t = 2 if video else 1
    merged = h * w // cfg.spatial_merge_size ** 2
    token = cfg.token_ids["video_token_id" if video else "image_token_id"]
    if video and cfg.family != "qwen25_vl":
        blocks = [_block(cfg, token, merged) for _ in range(t)]
    else:
        blocks = [_block(cfg, token, t * merged)]
    patches = torch.randn(t * h * w, cfg.patch_features, generator=rng)
    return blocks, [t, h, w], patches


def qwen_vl_sample(rng: torch.Generator, cfg: TinyBridgeConfig, *, images: int, videos: int, text: int) -> dict:
    """One sample: `text` text tokens with `images` images and `videos` videos at random cuts."""
    text_ids = torch.randint(1, cfg.vocab_size - 8, (text,), generator=rng)
    kinds = [False] * images + [True] * videos
    kinds = [kinds[i] for i in torch.randperm(len(kinds), generator=rng).tolist()]
    cuts = sorted(torch.randint(0, text + 1, (len(kinds),), generator=rng).tolist())
    pieces, labels, prev = [], [], 0
    out = {"image_grid_thw": [], "pixel_values": [], "video_grid_thw": [], "pixel_values_videos": []}
    for cut, video in zip(cuts, kinds):
        pieces.append(text_ids[prev:cut])
        labels.append(text_ids[prev:cut])
        prev = cut
        blocks, grid, patches = _media(rng, cfg, video=video)
        for block in blocks:
            pieces.append(block)
            labels.append(torch.full_like(block, -100))
        out["video_grid_thw" if video else "image_grid_thw"].append(grid)
        out["pixel_values_videos" if video else "pixel_values"].append(patches)
    pieces.append(text_ids[prev:])
    labels.append(text_ids[prev:])
    sample = {"input_ids": torch.cat(pieces), "labels": torch.cat(labels)}
    for kind, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        grids = out[f"{kind}_grid_thw"]
        sample[f"{kind}_grid_thw"] = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        sample[pixels] = torch.cat(out[pixels]) if out[pixels] else torch.zeros(0, cfg.patch_features)
    if cfg.family == "qwen25_vl":
        sample["second_per_grid_ts"] = torch.full((len(out["video_grid_thw"]),), 0.5)
    return sample


def qwen_vl_samples(cfg: TinyBridgeConfig, num: int, *, seed: int, max_text: int = 24, max_images: int = 2,
                    max_videos: int = 1) -> list[dict]:
    """`num` samples, identical for the same seed; counts of text, images and videos vary per sample."""
    rng = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        images = int(torch.randint(0, max_images + 1, (1,), generator=rng))
        videos = int(torch.randint(0, max_videos + 1, (1,), generator=rng))
        text = int(torch.randint(3, max_text + 1, (1,), generator=rng))
        samples.append(qwen_vl_sample(rng, cfg, images=images, videos=videos, text=text))
    return samples


def collate_qwen_vl(samples: list[dict], *, pad_token_id: int = 0) -> dict:
    """Right-pad samples into one HF-style batch; images and videos concatenated in sample order.

    Keys with no image (or no video) in any sample are left out, as a processor would.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    ids, labels, mask = right_pad_samples(samples, longest, pad_token_id)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        grids = torch.cat([s[grid] for s in samples])
        if len(grids):
            batch[grid] = grids
            batch[pixels] = torch.cat([s[pixels] for s in samples])
            if grid == "video_grid_thw" and "second_per_grid_ts" in samples[0]:
                batch["second_per_grid_ts"] = torch.cat([s["second_per_grid_ts"] for s in samples])
    return batch
