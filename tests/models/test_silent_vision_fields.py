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
