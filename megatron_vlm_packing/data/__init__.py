"""Embedded synthetic multimodal data for the demo, tests and benchmarks."""

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples

__all__ = ["SyntheticVLMConfig", "collate", "synthetic_samples"]
