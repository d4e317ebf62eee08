"""Vision fields a model does not read are a ValueError naming the field and its numbers, never dropped.

Only a micro-batch built or edited by hand (a `transform`, a `dataclasses.replace`) can carry them:
`num_image_tiles` (read by LLaVA alone) given to another model, and grids, per-sample counts or seconds without
the pixels they describe (no model reads a grid without its patches; an mRoPE index reads grids alone before the
micro-batch is built, and the packers then leave them out of it).

Before: the GPTModel and PackedVLM trained each such micro-batch to the very loss of the one without the field.
Real Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.packing.micro_batch import VisionInputs
from megatron_vlm_packing.testing.step_models import step_loss

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.testing.step_models import step_batch, tiny_step_models
    from megatron_vlm_packing.testing.vlm_parity import LM, build_vlm

    return dict(models=tiny_step_models(), flat=build_vlm(LM, 0, media=True, mrope=False),
                gpt_batch=step_batch("gpt"), vlm_batch=step_batch("vlm"))


@pytest.mark.parametrize("model", ["vlm", "flat"])
def test_image_tiles_handed_to_a_model_that_reads_none_are_refused(setup, model):
    model = setup["models"]["vlm"] if model == "vlm" else setup["flat"]
    images = setup["vlm_batch"]["image_grid_thw"].shape[0]

    def add_tiles(mb):
        return R(mb, vision=R(mb.vision, num_image_tiles=torch.full((images,), 2)))

    with pytest.raises(ValueError, match=rf"carries \['image_tiles'\] but PackedVLM's adapter \(PackedVLMAdapter\) "
                                         rf"consumes only \['audio', 'images', 'videos'\].*image_tiles: "
                                         rf"vision.num_image_tiles, {images} entries"):
        step_loss(model, setup["vlm_batch"], transform=add_tiles)
    assert step_loss(model, setup["vlm_batch"]) > 0  # the same micro-batch without them trains


def test_image_tiles_handed_to_a_gpt_model_are_refused(setup):
    add = lambda mb: R(mb, vision=VisionInputs(num_image_tiles=torch.tensor([2, 1])))  # noqa: E731
    with pytest.raises(ValueError, match=r"carries \['image_tiles'\] but GPTModel's adapter \(GPTModelAdapter\) "
                                         r"consumes only no optional inputs.*vision.num_image_tiles, 2 entries"):
        step_loss(setup["models"]["gpt"], setup["gpt_batch"], transform=add)


def test_the_llava_adapter_consumes_tiles():
    from megatron_vlm_packing.models.llava import LLaVAAdapter

    assert {"images", "image_tiles"} <= LLaVAAdapter.consumes


WITHOUT_MEDIA = {
    "image grid": (dict(image_grid_thw=torch.tensor([[1, 2, 2], [1, 4, 4]])),
                   r"vision.image_grid_thw describes 2 image\(s\) but vision.pixel_values is None"),
    "video grid": (dict(video_grid_thw=torch.tensor([[2, 2, 2]])),
                   r"vision.video_grid_thw describes 1 video\(s\) but vision.pixel_values_videos is None"),
    "images per sample": (dict(images_per_sample=(1, 0, 2, 0)),
                          r"vision.images_per_sample describes 3 image\(s\) but vision.pixel_values is None"),
    "videos per sample": (dict(videos_per_sample=(0, 1, 0, 0)),
                          r"vision.videos_per_sample describes 1 video\(s\) but vision.pixel_values_videos is None"),
}


@pytest.mark.parametrize("case", sorted(WITHOUT_MEDIA))
def test_vision_fields_without_their_pixels_are_refused(setup, case):
    fields, message = WITHOUT_MEDIA[case]
    gpt, batch = setup["models"]["gpt"], setup["gpt_batch"]
    with pytest.raises(ValueError, match=message + r".*nothing reads them"):
        step_loss(gpt, batch, transform=lambda mb: R(mb, vision=VisionInputs(**fields)))
    assert step_loss(gpt, batch, transform=lambda mb: R(mb, vision=VisionInputs())) > 0  # empty: nothing dropped


def test_seconds_without_videos_beside_mrope_positions_given_by_hand_are_refused(setup):
    """A micro-batch whose mRoPE positions no config made (`mrope_config` None) took seconds as read by whatever
    made them; beside no video pixels nothing reads them."""
    vlm, batch = setup["models"]["vlm"], setup["vlm_batch"]

    def images_only(mb):
        ids = torch.where(mb.input_ids == vlm.video_token_id, 0, mb.input_ids)  # video placeholders become text
        vision = R(mb.vision, pixel_values_videos=None, video_grid_thw=None, videos_per_sample=None)
        return R(mb, input_ids=ids, vision=vision, mrope_config=None)

    assert step_loss(vlm, batch, transform=images_only) > 0
    with_seconds = lambda mb: R(images_only(mb), vision=R(images_only(mb).vision,  # noqa: E731
                                                          second_per_grid_ts=torch.ones(2)))
    with pytest.raises(ValueError, match=r"vision.second_per_grid_ts describes 2 video\(s\) but "
                                         r"vision.pixel_values_videos is None"):
        step_loss(vlm, batch, transform=with_seconds)


def test_a_packed_micro_batch_carries_no_vision_field_without_its_pixels(setup):
    """What the packers hand the model passes the same check: every grid and count beside its pixels."""
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.testing.vlm_parity import MEDIA

    mb = pack_batch(setup["vlm_batch"], label_style="hf", image_token_id=MEDIA.image_token_id,
                    video_token_id=MEDIA.video_token_id, audio_token_id=MEDIA.audio_token_id, spatial_merge_size=2)
    assert mb.vision.fields_without_media() == ()
    assert R(mb.vision, pixel_values=None).fields_without_media() == (
        f"vision.image_grid_thw describes {mb.vision.image_grid_thw.shape[0]} image(s) but vision.pixel_values is None",
        f"vision.images_per_sample describes {sum(mb.vision.images_per_sample)} image(s) but vision.pixel_values is "
        f"None")
