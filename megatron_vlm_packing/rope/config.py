"""`MRopeConfig`: everything mRoPE position computation needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_omni")
_MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
    "qwen3_omni_moe": "qwen3_omni", "qwen3_omni_moe_thinker": "qwen3_omni",
}


def _first_attr(configs, name, default):
    """`name` from the first config that has it (transformers configs may raise, not return None)."""
    for config in configs:
        try:
            value = getattr(config, name)
        except AttributeError:
            continue
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class MRopeConfig:
    """Multimodal rotary position settings of one model family.

    Attributes:
        family: one of `FAMILIES`.
        spatial_merge_size: vision tokens per side merged into one LM token (2 in every Qwen-VL).
        image_token_id, video_token_id: placeholder ids (one per merged vision token).
        vision_start_token_id: id that opens a vision block (kept for reference; blocks are found
            from the placeholder ids, like transformers' `mm_token_type_ids`).
        audio_token_id, audio_start_token_id: Qwen3-Omni audio placeholder and block-opening ids.
        position_id_per_seconds: Qwen3-Omni temporal scale (t positions per second).
        audio_n_window: Qwen3-Omni audio encoder window (sets each audio run's token count).
        tokens_per_second: Qwen2.5-VL temporal scale: a video's t positions step by
            `tokens_per_second * second_per_grid_ts`.
        mrope_section: rotary frequency pairs given to (t, h, w), e.g. (16, 24, 24).
        mrope_interleaved: Qwen3 style (frequencies interleaved t, h, w, ...) instead of contiguous.
        text_offset: where text resumes after a vision block. "max_hw" (transformers >= 5: start +
            max(h, w) / merge) or "max_position" (transformers 4.57: 1 + the block's largest
            position, which differs after videos whose t positions outrun h and w; transformers #45381).
    """

    family: str
    spatial_merge_size: int = 2
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    audio_token_id: int | None = None
    audio_start_token_id: int | None = None
    position_id_per_seconds: float = 25.0
    audio_n_window: int = 50
    tokens_per_second: float = 1.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    mrope_interleaved: bool = False
    text_offset: str = "max_hw"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.text_offset not in ("max_hw", "max_position"):
            raise ValueError(f"text_offset must be 'max_hw' or 'max_position', got {self.text_offset!r}")
        if self.spatial_merge_size < 1 or len(self.mrope_section) != 3:
            raise ValueError(f"need spatial_merge_size >= 1 and 3 mrope sections, got "
                             f"{self.spatial_merge_size}, {self.mrope_section}")

    @classmethod
    def from_hf_config(cls, hf_config, *, text_offset: str = "max_hw") -> "MRopeConfig":
        """Read a transformers config of a supported family (top level, text_config, vision_config,
        rope_scaling or rope_parameters)."""
        model_type = getattr(hf_config, "model_type", None)
        top = hf_config
        if model_type == "qwen3_omni_moe":
            hf_config = hf_config.thinker_config
            model_type = hf_config.model_type
        family = _MODEL_TYPES.get(model_type)
        if family is None:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_MODEL_TYPES)}")
        text = getattr(hf_config, "text_config", None) or hf_config
        vision = hf_config.vision_config
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        section = rope.get("mrope_section")
        if section is None:
            raise ValueError(f"{model_type} config has no mrope_section in rope_parameters/rope_scaling: {rope}")
        return cls(
            family=family,
            spatial_merge_size=int(vision.spatial_merge_size),
            image_token_id=int(hf_config.image_token_id),
            video_token_id=int(hf_config.video_token_id),
            vision_start_token_id=int(_first_attr((hf_config, top), "vision_start_token_id", -1)),
            audio_token_id=getattr(hf_config, "audio_token_id", None),
            audio_start_token_id=getattr(hf_config, "audio_start_token_id", None),
            position_id_per_seconds=float(getattr(hf_config, "position_id_per_seconds", 25.0)),
            audio_n_window=int(getattr(getattr(hf_config, "audio_config", None), "n_window", 50)),
            tokens_per_second=float(getattr(vision, "tokens_per_second", 1.0) or 1.0),
            mrope_section=tuple(int(x) for x in section),
            mrope_interleaved=bool(rope.get("mrope_interleaved", family in ("qwen3_vl", "qwen3_omni"))),
            text_offset=text_offset,
        )
