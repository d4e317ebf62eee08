"""Kept import path: the synthetic multimodal data set lives with the demo (`megatron_vlm_packing.demo.synthetic`)."""

from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples

__all__ = ["SyntheticVLMConfig", "collate", "synthetic_samples"]
