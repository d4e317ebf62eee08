"""`second_per_grid_ts` (seconds per temporal grid step of each video) is read by one thing only: an mRoPE index
that places video tokens in time (Qwen2.5-VL's, Qwen3-Omni's; Bridge's Qwen2.5-VL runs its own). Given where
nothing reads it, it is a ValueError naming the field and why, never carried to the model and dropped.

Before: a 1D-rotary `PackedVLM` (and a GPTModel handed a micro-batch with seconds) trained the videos with
the seconds accepted and unused; Qwen2-VL's and Qwen3-VL's index (which place frames by their index, or by
timestamp text) took them and read nothing. Real Megatron-Core models (tiny, CPU, one process).
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
    from megatron_vlm_packing.testing.step_models import step_batch, tiny_step_models
    from megatron_vlm_packing.testing.vlm_parity import LM, MEDIA, build_vlm

    batch = collate(synthetic_samples(4, seed=3, cfg=MEDIA))
    videos = batch["video_grid_thw"].shape[0]
    assert videos and "pixel_values_videos" in batch
    return dict(flat=build_vlm(LM, 0, media=True, mrope=False), models=tiny_step_models(), batch=batch,
                seconds={**batch, "second_per_grid_ts": torch.full((videos,), 0.5)}, videos=videos,
                gpt_batch=step_batch("gpt"))


def _loader(batch: dict, mrope=None):
    from megatron_vlm_packing.packing.collate import PackingCollator
    from megatron_vlm_packing.testing.vlm_parity import MEDIA

    return PackingCollator(label_style="hf", mrope=mrope, pack_options=dict(
        image_token_id=MEDIA.image_token_id, video_token_id=MEDIA.video_token_id,
        audio_token_id=MEDIA.audio_token_id, spatial_merge_size=2))(batch)


ONE_D = r"second_per_grid_ts has {n} entries but {model} \(a 1D rotary\) reads none"


@pytest.mark.parametrize("pack", [True, False])
def test_seconds_for_a_1d_rotary_packed_vlm_are_refused(setup, pack):
    with pytest.raises(ValueError, match=ONE_D.format(n=setup["videos"], model="PackedVLM")):
        step_loss(setup["flat"], setup["seconds"], pack=pack)
    assert step_loss(setup["flat"], setup["batch"], pack=pack) > 0  # the same batch without them trains


def test_seconds_in_a_loader_micro_batch_for_a_1d_rotary_packed_vlm_are_refused(setup):
    with pytest.raises(ValueError, match=ONE_D.format(n=setup["videos"], model="PackedVLM")):
        step_loss(setup["flat"], _loader(setup["seconds"]))


def test_seconds_handed_to_a_gpt_model_are_refused(setup):
    from megatron_vlm_packing.packing.micro_batch import VisionInputs

    add = lambda mb: R(mb, vision=VisionInputs(second_per_grid_ts=torch.ones(2)))  # noqa: E731
    with pytest.raises(ValueError, match=ONE_D.format(n=2, model="GPTModel")):
        step_loss(setup["models"]["gpt"], setup["gpt_batch"], transform=add)


def test_seconds_added_beside_positions_of_an_index_that_reads_none_are_refused(setup):
    """The mRoPE PackedVLM's positions come from Qwen2-VL's index (`vlm_parity.ROPE`), which reads no seconds."""
    from megatron_vlm_packing.packing.micro_batch import VisionInputs

    add = lambda mb: R(mb, vision=R(mb.vision or VisionInputs(), second_per_grid_ts=torch.ones(1)))  # noqa: E731
    with pytest.raises(ValueError, match=r"second_per_grid_ts has 1 entries but PackedVLM \(the qwen2_vl mRoPE "
                                         r"index\) reads none"):
        step_loss(setup["models"]["vlm"], setup["batch"], transform=add)
