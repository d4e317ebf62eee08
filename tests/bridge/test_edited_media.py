"""Megatron-Bridge's Qwen-VL models given vision inputs that no packer checked against the placeholders (a
`transform=`, an edited loader micro-batch) get them checked by the adapter first.

Bridge's models do not compare placeholders with the vision inputs: with the vision removed, Qwen3-VL
trained the image and video placeholders as text tokens (a different loss, no error), Qwen2.5-VL failed
with a TypeError; patches that no longer match the grids were a RuntimeError / IndexError inside the
tower. Tiny Bridge models (CPU, one process, local specs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from tests.bridge.tiny_qwen_vl import tiny_qwen_vl_case

pytestmark = pytest.mark.bridge
R = dataclasses.replace
FAMILIES = ("qwen3_vl", "qwen25_vl")


@pytest.fixture(scope="module")
def bridge(single_process_megatron):
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl

    out = {}
    for family in FAMILIES:
        case = out[family] = tiny_qwen_vl_case(family)
        assert case["batch"]["pixel_values"].shape[0] and "pixel_values_videos" in case["batch"]
        case.update(loader=case["collator"](case["batch"]), alone=[collate_qwen_vl([s]) for s in case["samples"]])
    return out


EDITS = {
    "vision removed": (lambda mb: R(mb, vision=None), r"image placeholder tokens \(id 255\) but no image inputs"),
    # every video field removed (one left without the pixels is refused first: `test_silent_vision_fields`)
    "videos removed": (lambda mb: R(mb, vision=R(mb.vision, pixel_values_videos=None, video_grid_thw=None,
                                                 videos_per_sample=None, second_per_grid_ts=None)),
                       r"video placeholder tokens \(id 254\) but no video inputs"),
    "4 patches cut": (lambda mb: R(mb, vision=R(mb.vision, pixel_values=mb.vision.pixel_values[:-4])),
                      r"pixel_values has 44 patches but image_grid_thw describes 48"),
    "grids of two samples swapped": (
        lambda mb: R(mb, vision=R(mb.vision, image_grid_thw=_grids_of_two_samples_swapped(mb.vision))),
        r"image placeholder tokens \(id 255\), which do not cover whole images"),
    # Bridge's towers cast them (`.type(self.visual.dtype)`) without a word
    "images made uint8": (lambda mb: R(mb, vision=R(mb.vision, pixel_values=mb.vision.pixel_values.to(torch.uint8))),
                          r"pixel_values must hold floating-point pixel values, got dtype torch.uint8"),
    "videos made complex": (
        lambda mb: R(mb, vision=R(mb.vision, pixel_values_videos=mb.vision.pixel_values_videos.to(torch.complex64))),
        r"pixel_values_videos must hold floating-point pixel values, got dtype torch.complex64"),
}


def _grids_of_two_samples_swapped(vision) -> torch.Tensor:
    """The first image's grid swapped with one of another sample and another shape (the patches still add up)."""
    grid, owner = vision.image_grid_thw, []
    for sample, count in enumerate(vision.images_per_sample):
        owner += [sample] * count
    other = next(i for i in range(1, len(grid)) if owner[i] != owner[0] and not torch.equal(grid[i], grid[0]))
    swapped = grid.clone()
    swapped[[0, other]] = grid[[other, 0]]
    return swapped


@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("family", FAMILIES)
def test_vision_edited_by_a_transform_is_checked(bridge, family, edit):
    change, message = EDITS[edit]
    with pytest.raises(ValueError, match=message):
        step_loss(bridge[family]["model"], bridge[family]["batch"], transform=change)


@pytest.mark.parametrize("edit", ["vision removed", "images made uint8"])
@pytest.mark.parametrize("family", FAMILIES)
def test_vision_edited_in_a_loader_micro_batch_is_refused(bridge, family, edit):
    change, message = EDITS[edit]
    with pytest.raises(ValueError, match=message):
        step_loss(bridge[family]["model"], change(bridge[family]["loader"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_unedited_and_identity_transformed_micro_batches_equal_each_sample_alone(bridge, family):
    case = bridge[family]
    alone = sum(step_loss(case["model"], one, pack=False) for one in case["alone"])
    for item, options in ((case["batch"], {}), (case["batch"], dict(transform=lambda mb: R(mb, vision=R(mb.vision)))),
                          (case["loader"], {})):
        assert step_loss(case["model"], item, **options) == pytest.approx(alone, rel=1e-5)


@pytest.fixture(scope="module")
def omni(single_process_megatron):
    """Bridge's tiny Qwen3-Omni with this package's packed-thinker patch (undone after the module)."""
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, build_tiny_omni, collate_omni, omni_samples
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    applied = patch.apply_bridge_qwen3_omni_packed()
    cfg = TinyOmniConfig()
    batch = collate_omni(omni_samples(cfg, 4, seed=3))
    assert {"pixel_values", "pixel_values_videos", "input_features"} <= set(batch)
    yield dict(model=build_tiny_omni(cfg, seed=0), batch=batch)
    if applied:
        patch.undo_bridge_qwen3_omni_packed()


OMNI_EDITS = {
    "vision removed": (lambda mb: R(mb, vision=None), r"image placeholder tokens \(id 255\) but no image inputs"),
    "audio removed": (lambda mb: R(mb, audio=None), r"audio placeholder tokens \(id 253\) but no audio inputs"),
    "4 patches cut": (lambda mb: R(mb, vision=R(mb.vision, pixel_values=mb.vision.pixel_values[:-4])),
                      r"pixel_values has 4 patches but image_grid_thw describes 8"),
    "clips of two samples swapped": (
        lambda mb: R(mb, audio=R(mb.audio, feature_attention_mask=mb.audio.feature_attention_mask.flip(0),
                                 input_features=mb.audio.input_features.flip(0),
                                 audio_lengths=mb.audio.audio_lengths[::-1])),  # else refused as lengths cut
        r"audio placeholder tokens \(id 253\), which do not cover whole audios"),
    # the thinker reads the mask alone: lengths (what positions and `validate` read as the clips' frames) that are
    # not the mask's were dropped silently
    "audio lengths cut": (lambda mb: R(mb, audio=R(mb.audio, audio_lengths=tuple(n - 1 for n in
                                                                                 mb.audio.audio_lengths))),
                          r"audio_lengths \[\d+, .*\] but feature_attention_mask has \[\d+, .*\] real frames per clip"),
    # the thinker's audio tower casts the features and takes the mask's `.bool()` / `.sum()`
    "audio features made int64": (lambda mb: R(mb, audio=R(mb.audio, input_features=mb.audio.input_features.long())),
                                  r"input_features must hold floating-point mel features, got dtype torch.int64"),
    "feature mask made float": (
        lambda mb: R(mb, audio=R(mb.audio, feature_attention_mask=mb.audio.feature_attention_mask.float())),
        r"feature_attention_mask must be a bool or integer tensor of 0/1 values, got dtype torch.float32"),
}


@pytest.mark.parametrize("edit", sorted(OMNI_EDITS))
def test_omni_media_edited_by_a_transform_are_checked(omni, edit):
    change, message = OMNI_EDITS[edit]
    with pytest.raises(ValueError, match=message):
        step_loss(omni["model"], omni["batch"], transform=change)


def test_omni_identity_transform_equals_the_pack(omni):
    packed = step_loss(omni["model"], omni["batch"])
    assert step_loss(omni["model"], omni["batch"], transform=lambda mb: R(mb, vision=R(mb.vision))) == \
        pytest.approx(packed, rel=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_handed_over_as_ids_are_refused(bridge, family):
    """-100 at the ignored slots was an IndexError in Bridge's embedding."""
    with pytest.raises(ValueError, match=r"input_ids row 0 position \d+ is -100: token ids must lie in \[0, 256\)"):
        step_loss(bridge[family]["model"], bridge[family]["batch"], transform=lambda mb: R(mb, input_ids=mb.labels))


def test_seconds_are_refused_for_qwen3_vl_which_reads_none(bridge):
    """Bridge's Qwen3-VL takes no `second_per_grid_ts` (its adapter never handed them on) and its mRoPE index reads
    none: given in the batch, or added by a transform, they are refused, not dropped."""
    from megatron_vlm_packing.packing.micro_batch import VisionInputs

    case = bridge["qwen3_vl"]
    videos = case["batch"]["video_grid_thw"].shape[0]
    with pytest.raises(ValueError, match=rf"second_per_grid_ts has {videos} entries but the qwen3_vl mRoPE index "
                                         rf"reads none"):
        step_loss(case["model"], {**case["batch"], "second_per_grid_ts": torch.ones(videos)})
    add = lambda mb: R(mb, vision=R(mb.vision or VisionInputs(), second_per_grid_ts=torch.ones(videos)))  # noqa: E731
    with pytest.raises(ValueError, match=rf"second_per_grid_ts has {videos} entries but Qwen3VLModel \(the qwen3_vl "
                                         rf"mRoPE index\) reads none"):
        step_loss(case["model"], case["batch"], transform=add)


SECONDS_EDITS = {
    # one more entry than videos: Bridge's index read the first ones and dropped the rest; one fewer an IndexError
    "one entry more": (lambda s: torch.cat([s, s[:1]]), r"second_per_grid_ts has {more} entries but video_grid_thw has "
                                                        r"{videos} videos"),
    "one entry fewer": (lambda s: s[1:], r"second_per_grid_ts has {fewer} entries but video_grid_thw has {videos} "
                                         r"videos"),
    "nan": (lambda s: torch.full_like(s, float("nan")), r"second_per_grid_ts entry 0 is nan"),
    "complex": (lambda s: s.to(torch.complex64), r"second_per_grid_ts must hold real numbers of seconds, got dtype "
                                                 r"torch.complex64"),
}


@pytest.mark.parametrize("edit", sorted(SECONDS_EDITS))
def test_qwen25_vl_seconds_edited_by_a_transform_are_checked(bridge, edit):
    """Bridge's Qwen2.5-VL computes its video positions from `second_per_grid_ts` itself: seconds no packer
    checked (a transform's) are checked against the videos as packing checks them."""
    case = bridge["qwen25_vl"]
    videos = case["batch"]["video_grid_thw"].shape[0]
    assert videos and case["batch"]["second_per_grid_ts"].numel() == videos
    change, message = SECONDS_EDITS[edit]
    edited = lambda mb: R(mb, vision=R(mb.vision, second_per_grid_ts=change(mb.vision.second_per_grid_ts)))  # noqa
    with pytest.raises(ValueError, match=message.format(more=videos + 1, fewer=videos - 1, videos=videos)):
        step_loss(case["model"], case["batch"], transform=edited)
