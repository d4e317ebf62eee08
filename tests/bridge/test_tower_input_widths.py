"""Megatron-Bridge's towers handed media of another width than they were built for, and Qwen3-VL handed an image of
several frames beside a video: ValueErrors naming the field and the numbers, checked by the adapters on every
micro-batch (the step packing it, pack=False and a loader micro-batch alike: no packer knows the model's towers).

Before: patches of 93 features for a tower of 96 were a RuntimeError inside Bridge (`torch.cat` sizes in Qwen3-VL's
`reorganize_inputs`, a `view` in the Hugging Face patch embedding of Qwen2.5-VL and Qwen3-Omni); Qwen3-Omni's audio
tower took clips of 14 mel bins where it was built for 16 and trained on them without a word (its stride-2
convolutions bring 14 and 16 to the same width); Qwen3-VL with an image of grid t=2 beside a video failed on a bare
`assert` in `reorganize_inputs` (which reads such an image as 2 placeholder runs, as it reads a video). Tiny Bridge
models (CPU, one process, local specs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from tests.bridge.tiny_qwen_vl import tiny_qwen_vl_case

pytestmark = pytest.mark.bridge
R = dataclasses.replace
FAMILIES = {"qwen3_vl": "Qwen3VLModel", "qwen25_vl": "Qwen25VLModel"}


@pytest.fixture(scope="module")
def bridge(single_process_megatron):
    out = {}
    for family in FAMILIES:
        case = out[family] = tiny_qwen_vl_case(family)
        batch, cfg = case["batch"], case["cfg"]
        assert batch["pixel_values"].shape[1] == cfg.patch_features == 96 and "pixel_values_videos" in batch
    return out


def _narrowed(batch: dict, field: str, features: int) -> dict:
    return dict(batch, **{field: batch[field][:, :features]})


@pytest.mark.parametrize("field", ["pixel_values", "pixel_values_videos"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patches_narrower_than_the_tower_are_named(bridge, family, field):
    case = bridge[family]
    narrow = _narrowed(case["batch"], field, 93)
    message = (rf"{field} has 93 features per patch but {FAMILIES[family]}'s vision tower takes 96 "
               r"\(3 channels x 2 frames x 4 x 4 pixels\)")
    for item, options in ((narrow, {}), (narrow, dict(pack=False)), (case["collator"](narrow), {})):
        with pytest.raises(ValueError, match=message):
            step_loss(case["model"], item, label_style="hf", **options)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patches_edited_by_a_transform_to_another_width_are_named(bridge, family):
    case = bridge[family]
    wide = lambda mb: R(mb, vision=R(mb.vision, pixel_values=torch.cat([mb.vision.pixel_values] * 2, dim=1)))
    with pytest.raises(ValueError, match=rf"pixel_values has 192 features per patch but {FAMILIES[family]}'s"):
        step_loss(case["model"], case["batch"], label_style="hf", transform=wide)


def _sample_with_image_of_frames(cfg, frames: int, seed: int) -> dict:
    """Text, one image of grid (frames, 2, 4) in one run of frames*2*4/4 placeholders (as Qwen3-VL's index reads an
    image: no split per frame), text."""
    g = torch.Generator().manual_seed(seed)
    ids = cfg.token_ids
    text = torch.randint(1, cfg.vocab_size - 8, (4,), generator=g)
    block = torch.tensor([ids["vision_start_token_id"]] + [ids["image_token_id"]] * (frames * 2)
                         + [ids["vision_end_token_id"]])
    labels = torch.cat([text, torch.full_like(block, -100), text])
    return {"input_ids": torch.cat([text, block, text]), "labels": labels,
            "image_grid_thw": torch.tensor([[frames, 2, 4]]),
            "pixel_values": torch.randn(frames * 8, cfg.patch_features, generator=g),
            "video_grid_thw": torch.zeros(0, 3, dtype=torch.long),
            "pixel_values_videos": torch.zeros(0, cfg.patch_features)}


def test_qwen3_vl_image_of_two_frames_beside_a_video_is_named(bridge):
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl

    case = bridge["qwen3_vl"]
    with_video = next(s for s in case["samples"] if len(s["video_grid_thw"]))
    batch = collate_qwen_vl([with_video, _sample_with_image_of_frames(case["cfg"], 2, seed=1)])
    message = (r"image_grid_thw row \d+ is \[2, 2, 4\]: Qwen3VLModel reads an image of t=2 frames beside videos "
               r"as 2 placeholder runs")
    for options in ({}, dict(pack=False)):
        with pytest.raises(ValueError, match=message):
            step_loss(case["model"], batch, label_style="hf", **options)


def test_qwen3_vl_image_of_two_frames_without_videos_equals_each_sample_alone(bridge):
    """The refusal is only where Bridge fails: without videos its tower takes such an image as one run."""
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl

    case = bridge["qwen3_vl"]
    samples = [s for s in case["samples"] if not len(s["video_grid_thw"])][:1]
    samples.append(_sample_with_image_of_frames(case["cfg"], 2, seed=1))
    alone = sum(step_loss(case["model"], collate_qwen_vl([s]), label_style="hf", pack=False) for s in samples)
    assert step_loss(case["model"], collate_qwen_vl(samples), label_style="hf") == pytest.approx(alone, rel=1e-5)


@pytest.fixture(scope="module")
def omni(single_process_megatron):
    """Bridge's tiny Qwen3-Omni with this package's packed-thinker patch (undone after the module)."""
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, build_tiny_omni, collate_omni, omni_samples
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    applied = patch.apply_bridge_qwen3_omni_packed()
    cfg = TinyOmniConfig()
    batch = collate_omni(omni_samples(cfg, 4, seed=3))
    assert batch["input_features"].shape[1] == cfg.num_mel_bins == 16 and "pixel_values_videos" in batch
    yield dict(model=build_tiny_omni(cfg, seed=0), batch=batch)
    if applied:
        patch.undo_bridge_qwen3_omni_packed()


OMNI_NARROWED = {
    "pixel_values": (93, r"pixel_values has 93 features per patch but Qwen3OmniModel's vision tower takes 96 "
                         r"\(3 channels x 2 frames x 4 x 4 pixels\)"),
    "pixel_values_videos": (93, r"pixel_values_videos has 93 features per patch but Qwen3OmniModel's vision tower"),
    # 14 and 16 bins both leave 2 after the encoder's three stride-2 convolutions: it ran without a word
    "input_features": (14, r"input_features has 14 mel bins \(\[A, F, L\] = \(2, 14, 90\)\) but Qwen3OmniModel's "
                           r"audio tower takes 16 \(num_mel_bins\)"),
}


@pytest.mark.parametrize("field", sorted(OMNI_NARROWED))
def test_omni_media_of_another_width_are_named(omni, field):
    width, message = OMNI_NARROWED[field]
    with pytest.raises(ValueError, match=message):
        step_loss(omni["model"], _narrowed(omni["batch"], field, width), label_style="hf")


def test_omni_media_of_the_towers_widths_run(omni):
    assert step_loss(omni["model"], omni["batch"], label_style="hf") > 0
