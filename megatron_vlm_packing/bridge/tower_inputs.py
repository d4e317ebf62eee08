"""What Megatron-Bridge's vision and audio towers were built to take, read from the towers themselves, and each
micro-batch held to it by the Bridge adapters (`check` runs for every micro-batch: no packer knows the model).

- Patch rows: the patch embedding is a Conv3d of kernel (frames, height, width) over `in_channels`, and each row of
  `pixel_values` / `pixel_values_videos` is one patch flattened, C * frames * height * width features. Rows of
  another width failed inside Bridge (`torch.cat` sizes in Qwen3-VL's `reorganize_inputs`, a `view` in the
  Hugging Face patch embedding of Qwen2.5-VL and Qwen3-Omni) with numbers that name neither field nor tower.
- Mel bins: Qwen3-Omni's audio encoder reads `input_features` [A, F, L] with F = its `num_mel_bins`. Its three
  stride-2 convolutions bring neighbouring widths to the same size (14 and 16 both leave 2), so clips of the
  wrong F trained without a word.

Shape legend: P = patches, A = audio clips, F = mel bins, L = frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_vlm_packing.packing.micro_batch import MicroBatch


def patch_kernel(vision_tower: nn.Module | None) -> tuple[int, int, int, int] | None:
    """(channels, frames, height, width) of `vision_tower.patch_embed.proj`'s Conv3d (Qwen2.5-VL, Qwen3-VL and
    Qwen3-Omni all name it so); None without a tower (a later pipeline stage) or without such a convolution."""
    proj = getattr(getattr(vision_tower, "patch_embed", None), "proj", None)
    if not isinstance(proj, nn.Conv3d):
        return None
    channels, frames, height, width = proj.weight.shape[1:]
    return int(channels), int(frames), int(height), int(width)


def mel_bins(audio_tower: nn.Module | None) -> int | None:
    """The mel bins `audio_tower` reads (Hugging Face's Qwen3-Omni encoder: `num_mel_bins`); None without a tower."""
    bins = getattr(audio_tower, "num_mel_bins", None)
    if bins is None:
        bins = getattr(getattr(audio_tower, "config", None), "num_mel_bins", None)
    return None if bins is None else int(bins)


@dataclass(frozen=True)
class TowerWidths:
    """The widths a Bridge model's towers take (None: no such tower on this stage, nothing to hold).

    Attributes:
        model_name: named in messages.
        patch_kernel: (channels, frames, height, width) of the vision tower's patch embedding.
        mel_bins: F of the audio tower's `input_features` [A, F, L].
    """

    model_name: str
    patch_kernel: tuple[int, int, int, int] | None
    mel_bins: int | None = None

    @classmethod
    def of(cls, model_name: str, vision_tower: nn.Module | None, audio_tower: nn.Module | None = None) -> TowerWidths:
        return cls(model_name, patch_kernel(vision_tower), mel_bins(audio_tower))

    @property
    def patch_features(self) -> int | None:
        if self.patch_kernel is None:
            return None
        channels, frames, height, width = self.patch_kernel
        return channels * frames * height * width

    def check(self, micro_batch: MicroBatch) -> None:
        """Refuse patch rows and clips of another width than the towers take. Reads shapes only (no sync).

        Raises:
            ValueError: naming the field, its width and the tower's (with the kernel or `num_mel_bins`).
        """
        vision, audio = micro_batch.vision, micro_batch.audio
        if vision is not None and self.patch_kernel is not None:
            for field in ("pixel_values", "pixel_values_videos"):
                self._check_patches(field, getattr(vision, field))
        if audio is not None and self.mel_bins is not None:
            features = audio.input_features
            if features.dim() == 3 and features.shape[1] != self.mel_bins:
                raise ValueError(f"input_features has {features.shape[1]} mel bins ([A, F, L] = "
                                 f"{tuple(features.shape)}) but {self.model_name}'s audio tower takes "
                                 f"{self.mel_bins} (num_mel_bins)")

    def _check_patches(self, field: str, pixels: torch.Tensor | None) -> None:
        if pixels is None or pixels.dim() != 2 or pixels.shape[1] == self.patch_features:
            return
        channels, frames, height, width = self.patch_kernel
        raise ValueError(f"{field} has {pixels.shape[1]} features per patch but {self.model_name}'s vision tower "
                         f"takes {self.patch_features} ({channels} channels x {frames} frames x {height} x {width} "
                         f"pixels): flatten each patch as the model's image processor does")


def refuse_images_of_frames_beside_videos(micro_batch: MicroBatch, model_name: str) -> None:
    """Bridge's Qwen3-VL, given images and videos together, pairs them with the placeholders in
    `reorganize_inputs`, which reads every grid of t frames as t placeholder runs (a video's frames, each its own
    block): an image of t > 1 (one run, as Qwen3-VL's index and its processor lay an image out) failed there on a
    bare `assert`. With images alone it takes such an image. One host read of the image grids, only when both
    kinds are present (Bridge reads both grids to the host then itself).

    Raises:
        ValueError: naming the first image grid row of t > 1.
    """
    vision = micro_batch.vision
    if vision is None or vision.pixel_values is None or vision.pixel_values_videos is None \
            or vision.image_grid_thw is None:
        return
    grids = vision.image_grid_thw.tolist()  # the one read (see above)
    for row, grid in enumerate(grids):
        if grid[0] > 1:
            raise ValueError(
                f"image_grid_thw row {row} is {grid}: {model_name} reads an image of t={grid[0]} frames beside videos "
                f"as {grid[0]} placeholder runs (Bridge's reorganize_inputs), which Qwen3-VL's index and processor "
                f"never write (its processor gives every image t=1); give images t=1, or train such images in "
                f"micro-batches without videos")
