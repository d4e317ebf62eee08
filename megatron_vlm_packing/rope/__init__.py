"""mRoPE that stays exact under packing: HF-identical `get_rope_index` per family."""

from megatron_vlm_packing.rope.config import FAMILIES, MRopeConfig
from megatron_vlm_packing.rope.index import RopeIndex, get_rope_index, token_types

__all__ = ["FAMILIES", "MRopeConfig", "RopeIndex", "get_rope_index", "token_types"]
