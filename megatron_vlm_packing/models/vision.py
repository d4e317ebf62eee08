"""A tiny Qwen-VL-style vision tower: patch embedding, a few transformer layers, 2x2 spatial merge.

Inputs follow the Qwen-VL processor convention: all images' patches flattened into one
`pixel_values` tensor, patches of each image ordered so that every 4 consecutive patches form one
2x2 block, and `image_grid_thw` giving each image's (t, h, w) in patches. Attention stays inside
each image (a block-diagonal mask), so images never see each other, packed or not.

Shape legend: P = patches of all images, F = flattened patch features, D = vision width,
M = merged tokens (P / 4), H = language-model hidden size, I = images.
"""

from __future__ import annotations

import torch
from torch import nn

MERGE = 2  # 2x2 spatial merge, as in Qwen2-VL / Qwen2.5-VL


def tokens_per_image(image_grid_thw: torch.Tensor) -> list[int]:
    """Merged (language-model) tokens of each image: t * h * w / 4."""
    return (image_grid_thw.prod(dim=1) // (MERGE * MERGE)).tolist()


def image_block_mask(image_grid_thw: torch.Tensor, device=None, patches: int | None = None) -> torch.Tensor:
    """[P, P] bool, True where two patches belong to the same image.

    `patches` (P, a host int known to match the grids) saves the host sync that reads the total.
    """
    counts = image_grid_thw.prod(dim=1).to(device)
    image_of_patch = torch.repeat_interleave(torch.arange(len(counts), device=device), counts, output_size=patches)
    return image_of_patch[:, None] == image_of_patch[None, :]


class VisionBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, same_image: torch.Tensor) -> torch.Tensor:
        """x: [P, D]; same_image: [P, P] bool."""
        h = self.norm1(x)[None]
        x = x + self.attn(h, h, h, attn_mask=~same_image, need_weights=False)[0][0]
        return x + self.mlp(self.norm2(x))


class TinyVisionTower(nn.Module):
    """Patches -> vision transformer -> 2x2 merge -> projector into the language model's width."""

    def __init__(self, *, patch_features: int, width: int, out_hidden: int, num_layers: int = 2, heads: int = 4):
        super().__init__()
        self.patch_embed = nn.Linear(patch_features, width)
        self.blocks = nn.ModuleList([VisionBlock(width, heads) for _ in range(num_layers)])
        self.merger = nn.Sequential(nn.LayerNorm(MERGE * MERGE * width), nn.Linear(MERGE * MERGE * width, width),
                                    nn.GELU(), nn.Linear(width, out_hidden))

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *,
                inputs_checked: bool = False) -> torch.Tensor:
        """pixel_values: [P, F]; image_grid_thw: [I, 3] long -> [M, H] merged image embeddings.

        `inputs_checked`: packing's one read already checked the grids against the patches and the
        2x2 merge (packing/media.py), so the tower reads nothing back (no host sync).

        Raises:
            ValueError: patch count disagrees with the grids, or a grid not divisible by 2x2.
        """
        if not inputs_checked:
            patches = int(image_grid_thw.prod(dim=1).sum())
            if pixel_values.shape[0] != patches:
                raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but image_grid_thw "
                                 f"describes {patches}")
            if bool((image_grid_thw[:, 1:] % MERGE != 0).any()):
                raise ValueError(f"image_grid_thw h and w must be multiples of {MERGE}, "
                                 f"got {image_grid_thw.tolist()}")
        same_image = image_block_mask(image_grid_thw, pixel_values.device, patches=pixel_values.shape[0])
        # Under bf16 training (Megatron's Float16Module) the weights are bf16 but pixel_values come
        # from the data loader in float32: compute in the tower's own dtype, as transformers does.
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        for block in self.blocks:
            x = block(x, same_image)
        return self.merger(x.reshape(-1, MERGE * MERGE * x.shape[-1]))
