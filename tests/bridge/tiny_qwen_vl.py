"""One tiny Bridge Qwen-VL case per family, as the single-process Bridge tests build it: the model (seed 0), four
samples (seed 5) with images and videos, their collated batch and a `PackingCollator` for the family's mRoPE
config. Needs megatron-bridge: call it from a fixture of a test module marked `bridge`."""

from __future__ import annotations


def tiny_qwen_vl_case(family: str) -> dict:
    """{"model", "cfg", "samples", "batch", "collator"} of `family` ("qwen3_vl" or "qwen25_vl")."""
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, build_tiny_bridge_model
    from megatron_vlm_packing.packing.collate import PackingCollator

    cfg = TinyBridgeConfig(family=family)
    samples = qwen_vl_samples(cfg, 4, seed=5)
    return dict(model=build_tiny_bridge_model(cfg, seed=0), cfg=cfg, samples=samples, batch=collate_qwen_vl(samples),
                collator=PackingCollator(label_style="hf", mrope=cfg.mrope_config()))
