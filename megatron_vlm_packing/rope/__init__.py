"""mRoPE that stays exact under packing: HF-identical `get_rope_index` per family (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-Omni) and a packed-aware multimodal rotary."""

from megatron_vlm_packing.rope.config import FAMILIES, MRopeConfig
from megatron_vlm_packing.rope.index import RopeIndex, get_rope_index, token_types
from megatron_vlm_packing.rope.rotary import PackedMultimodalRotaryEmbedding, mrope_frequencies, use_packed_mrope

__all__ = [
    "FAMILIES", "MRopeConfig", "PackedMultimodalRotaryEmbedding", "RopeIndex", "get_rope_index", "mrope_frequencies",
    "token_types", "use_packed_mrope",
]
