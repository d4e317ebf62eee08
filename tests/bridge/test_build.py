"""The public CPU builder: Bridge's own providers give Bridge's own model classes, TE-free, fp32,
with vision towers, and a packed forward with images and videos equals each sample alone."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

pytestmark = pytest.mark.bridge


def test_tiny_models_of_every_family_build_and_pack_exactly():
    from megatron_vlm_packing.bridge.smoke import build_and_pack_smoke

    results = run_distributed(build_and_pack_smoke, 1, ("qwen25_vl", "qwen3_vl", "qwen3_vl_moe"), timeout_s=300)
    for family, r in results.items():
        assert r["model_class"] == {"qwen25_vl": "Qwen25VLModel"}.get(family, "Qwen3VLModel"), r
        assert r["model_module"].startswith("megatron.bridge.models.qwen_vl."), r
        assert r["vision_params"] > 0 and r["dtypes"] == ["torch.float32"], r
        assert not r["transformer_engine_imported"] and not r["bridge_package_imported"], r
        assert r["images"] >= 2 and r["videos"] >= 1, r
        assert r["abs_dloss"] <= 1e-4 * r["loss"], r
