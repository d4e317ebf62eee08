"""`make_forward_step(parity_probe_every=1)` on Megatron-Bridge's own models (built by their providers, no TE):
Qwen2.5-VL with images and videos whose `second_per_grid_ts` differ per video, and the Qwen3-Omni thinker with
images, videos and audio clips (its packed patch applied). One CPU process, one launch.

Before, the first probed micro-batch was a ValueError (videos, seconds and audio could not be split per sample).
Now the probe passes on the step's own packs and raises `ParityProbeError` on the same batch packed wrong on
purpose (`testing.probe_controls`): Qwen2.5-VL's videos swapping their seconds (Bridge computes the temporal
positions from them), a moved boundary; Qwen3-Omni's videos, images and audio clips holding another sample's values,
a moved boundary. The audio control needs the tiny thinker's He-scale audio downsampling
(`TinyOmniConfig.audio_he_init`, tests/bridge/test_omni_audio_signal.py): at transformers' N(0, 0.02) its losses
hardly read a clip, and the probe passed a pack of foreign clips (3.8e-6 under its 1e-4 tolerance; now 0.22).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge

SEED = 3
TOLERANCE = 2e-5  # fp32 on CPU; measured ~1e-6
CASES = (("qwen25_vl", "clean"), ("qwen25_vl", "swapped_seconds"), ("qwen25_vl", "moved_boundary"),
         ("qwen3_omni", "clean"), ("qwen3_omni", "foreign_video"), ("qwen3_omni", "foreign_image"),
         ("qwen3_omni", "foreign_audio"), ("qwen3_omni", "moved_boundary"))


def _batch(family: str, cfg) -> dict:
    from megatron_vlm_packing.bridge.truth import collate_for, family_samples

    batch = collate_for(family, family_samples(family, cfg, 4, seed=SEED))
    if family == "qwen25_vl":  # each video its own timing: one given another's seconds would show
        batch["second_per_grid_ts"] = 0.5 * torch.arange(1, batch["second_per_grid_ts"].numel() + 1)
    return batch


def run_bridge_probe_cases(rank, world_size):
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig
    from megatron_vlm_packing.bridge.truth import build_family
    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import (
        apply_bridge_qwen3_omni_packed, undo_bridge_qwen3_omni_packed)
    from megatron_vlm_packing.testing import probe_controls
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from tests.validate.test_probe_media import _probed

    initialize_parallel(seed=SEED)
    controls = {"clean": None, "swapped_seconds": probe_controls.swapped_seconds,
                "moved_boundary": probe_controls.moved_boundary,
                "foreign_image": probe_controls.foreign_media("image"),
                "foreign_video": probe_controls.foreign_media("video"),
                "foreign_audio": probe_controls.foreign_media("audio")}
    configs = {"qwen25_vl": TinyBridgeConfig(family="qwen25_vl"), "qwen3_omni": TinyOmniConfig()}
    apply_bridge_patches()
    apply_bridge_qwen3_omni_packed()
    out = {}
    try:
        for family, cfg in configs.items():
            model, batch = build_family(family, cfg, seed=SEED), _batch(family, cfg)
            out[(family, "keys")] = sorted(batch)
            for case_family, name in CASES:
                if case_family == family:
                    out[(family, name)] = _probed(model, batch, controls[name])
    finally:
        undo_bridge_qwen3_omni_packed()
        undo_bridge_patches()
    return out


@pytest.fixture(scope="module")
def cases():
    return run_distributed(run_bridge_probe_cases, 1, timeout_s=900)


def test_the_batches_hold_videos_with_seconds_and_audio(cases):
    assert {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= set(cases[("qwen25_vl", "keys")])
    assert {"pixel_values_videos", "second_per_grid_ts", "input_features", "feature_attention_mask",
            "audio_seqlens"} <= set(cases[("qwen3_omni", "keys")])


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(case))
def test_the_probe_passes_on_the_steps_packs_and_raises_on_wrong_ones(cases, case):
    result = cases[case]
    if case[1] == "clean":
        assert not result["raised"] and result["max_abs_diff"] <= TOLERANCE and "of 4 samples" in result["message"]
    else:
        assert result["raised"] and result["max_abs_diff"] > 100 * TOLERANCE, result
        assert "packing is not exact" in result["message"]
