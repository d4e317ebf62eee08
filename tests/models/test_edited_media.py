"""A micro-batch whose media or ids were replaced after packing (a `transform=`, `dataclasses.replace` on a
loader micro-batch) is checked by the model again, never trusted on the packer's marks.

Packing checks every sample's placeholders against its items, the grids against the patches and the
audio masks in its one read, and marks the micro-batch (`placeholders_checked`, per-sample counts) so
that `PackedVLM` need not read again. The marks were kept by `dataclasses.replace`, so a transform that
removed the vision inputs trained the image placeholders as text, one that handed the video tower the
images' patches left most video placeholders with their text embedding, and audio lengths that
disagree with the mask were used as given: each a different loss, silently. Patches that no longer
match the grids were a RuntimeError deep in the tower. Real Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
    from megatron_vlm_packing.packing.collate import PackingCollator
    from megatron_vlm_packing.testing.vlm_parity import LM, MEDIA, ROPE, build_vlm

    samples = synthetic_samples(4, seed=3, cfg=MEDIA)
    batch = collate(samples)
    assert {"pixel_values_videos", "input_features"} <= set(batch) and batch["pixel_values"].shape[0]
    collator = PackingCollator(label_style="hf", mrope=ROPE, pack_options=dict(
        image_token_id=MEDIA.image_token_id, video_token_id=MEDIA.video_token_id,
        audio_token_id=MEDIA.audio_token_id, spatial_merge_size=2))
    return dict(model=build_vlm(LM, 0, media=True, mrope=True), batch=batch, loader=collator(batch),
                alone=[collate([s]) for s in samples])


def _one_placeholder_made_text(input_ids: torch.Tensor, token_id: int) -> torch.Tensor:
    ids = input_ids.clone()
    ids.view(-1)[int(torch.nonzero(ids.view(-1) == token_id)[0])] = 5
    return ids


EDITS = {
    "vision removed": (lambda mb: R(mb, vision=None), r"image placeholder tokens \(id 253\) but no image inputs"),
    "audio removed": (lambda mb: R(mb, audio=None), r"audio placeholder tokens \(id 251\) but no audio inputs"),
    "videos given the images' patches": (
        lambda mb: R(mb, vision=R(mb.vision, pixel_values_videos=mb.vision.pixel_values,
                                  video_grid_thw=mb.vision.image_grid_thw)),
        r"video placeholder tokens \(id 252\) in input_ids but the 2 video inputs give"),
    "4 patches cut": (lambda mb: R(mb, vision=R(mb.vision, pixel_values=mb.vision.pixel_values[:-4])),
                      r"pixel_values has 4 patches but image_grid_thw describes 8"),
    "audio lengths one short": (
        lambda mb: R(mb, audio=R(mb.audio, audio_lengths=tuple(n - 1 for n in mb.audio.audio_lengths))),
        r"audio_lengths .* but feature_attention_mask has .* real frames"),
    "images_per_sample rotated": (
        lambda mb: R(mb, vision=R(mb.vision, images_per_sample=mb.vision.images_per_sample[1:]
                                  + mb.vision.images_per_sample[:1])),
        r"images_per_sample says"),
    "an image placeholder made text": (lambda mb: R(mb, input_ids=_one_placeholder_made_text(mb.input_ids, 253)),
                                       r"1 image placeholder tokens \(id 253\) in input_ids but the 2 image inputs give 2"),
    # the towers cast these (`.to(weight.dtype)`, `.bool()`) without a word
    "images made uint8": (lambda mb: R(mb, vision=R(mb.vision, pixel_values=mb.vision.pixel_values.to(torch.uint8))),
                          r"pixel_values must hold floating-point pixel values, got dtype torch.uint8"),
    "videos made int64": (
        lambda mb: R(mb, vision=R(mb.vision, pixel_values_videos=mb.vision.pixel_values_videos.long())),
        r"pixel_values_videos must hold floating-point pixel values, got dtype torch.int64"),
    "audio features made bool": (lambda mb: R(mb, audio=R(mb.audio, input_features=mb.audio.input_features.bool())),
                                 r"input_features must hold floating-point mel features, got dtype torch.bool"),
    "feature mask values made 2": (
        lambda mb: R(mb, audio=R(mb.audio, feature_attention_mask=mb.audio.feature_attention_mask * 2)),
        r"feature_attention_mask rows \[.*\] are not right-padded 0/1 masks"),
    "feature mask made float": (
        lambda mb: R(mb, audio=R(mb.audio, feature_attention_mask=mb.audio.feature_attention_mask.float())),
        r"feature_attention_mask must be a bool or integer tensor of 0/1 values, got dtype torch.float32"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_media_edited_by_a_transform_are_checked_again(setup, edit):
    change, message = EDITS[edit]
    with pytest.raises(ValueError, match=message):
        step_loss(setup["model"], setup["batch"], transform=change)


@pytest.mark.parametrize("edit", ["vision removed", "audio removed", "4 patches cut", "audio lengths one short",
                                  "images made uint8", "feature mask made float"])
def test_media_edited_in_a_loader_micro_batch_are_checked_again(setup, edit):
    change, message = EDITS[edit]
    with pytest.raises(ValueError, match=message):
        step_loss(setup["model"], change(setup["loader"]))


def test_unedited_micro_batches_still_equal_each_sample_alone(setup):
    alone = sum(step_loss(setup["model"], one, pack=False) for one in setup["alone"])
    for item, options in ((setup["batch"], {}), (setup["batch"], dict(transform=lambda mb: mb)),
                          (setup["loader"], {}), (setup["batch"], dict(pack=False))):
        assert step_loss(setup["model"], item, **options) == pytest.approx(alone, rel=1e-5)


def test_the_packers_mark_is_trusted_through_moves_and_a_dataloader_worker(setup):
    """No read of the media in the model for a micro-batch as packed (moved, pinned, sent by a worker)."""
    from megatron_vlm_packing.packing.collate import map_tensors
    import pickle

    loader = setup["loader"]
    assert loader.media_checked_by_packer
    assert map_tensors(loader, lambda t: t.clone()).media_checked_by_packer
    assert pickle.loads(pickle.dumps(loader)).media_checked_by_packer
    assert not R(loader, vision=R(loader.vision)).media_checked_by_packer
    assert not R(loader, input_ids=loader.input_ids.clone()).media_checked_by_packer
