"""`MRopeConfig`: everything mRoPE position computation needs, read from a Hugging Face config."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from megatron_vlm_packing.packing.bounds import is_int

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_omni")
_MODEL_TYPES = {
    "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
    "qwen3_omni_moe": "qwen3_omni", "qwen3_omni_moe_thinker": "qwen3_omni",
}

# transformers' own default when a config's rope parameters carry no mrope_section (read from the
# installed modeling code: Qwen2/2.5-VL rotary `get("mrope_section", [16, 24, 24])`, Qwen3-VL and
# Qwen3-Omni `get("mrope_section", [24, 20, 20])`).
DEFAULT_MROPE_SECTION = {"qwen2_vl": (16, 24, 24), "qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20),
                         "qwen3_omni": (24, 20, 20)}
# Every Qwen-VL / Qwen3-Omni vocabulary opens a vision block with this id (transformers' class
# default); used when a Qwen3-Omni thinker config does not carry it (its default config does not).
QWEN_VISION_START_TOKEN_ID = 151652


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
        text_offset: where text resumes after a vision block. "max_hw" (the installed transformers
            5.x: start + max(h, w) / merge; the default, tested against the HF model) or
            "max_position" (transformers 4.57: 1 + the block's largest position, which differs only
            after videos whose t positions outrun h and w; transformers #45381). "max_position"
            reproduces 4.57's resume rule only: masked slots stay 0 (4.57 wrote 1) and t positions
            truncate in 5.x's arithmetic; it is tested on hand-computed cases, not against 4.57.
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
        section = self.mrope_section
        if not isinstance(section, (tuple, list)) or len(section) != 3 or any(not is_int(x) or x < 1 for x in section):
            raise ValueError(f"mrope_section must be 3 positive ints, got {section}")
        # numpy ints (accepted) kept as Python ints, here and below
        ints = [int(x) for x in section]
        object.__setattr__(self, "mrope_section", tuple(ints) if isinstance(section, tuple) else ints)
        if not isinstance(self.mrope_interleaved, bool):  # a truthy "no" was read as True
            raise ValueError(f"mrope_interleaved must be True or False, got {self.mrope_interleaved!r}")
        for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("audio_token_id", "audio_start_token_id"):  # None: a family without audio
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise ValueError(f"{name} must be None or a non-negative int, got {value!r}")
            object.__setattr__(self, name, None if value is None else int(value))
        # Token counts are computed from these: 2.0 was a TypeError at the first image (a slice), True a
        # merge of 1, audio_n_window=0 a ZeroDivisionError at the first audio, -1 or 2.5 a wrong audio length.
        for name in ("spatial_merge_size", "audio_n_window"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("position_id_per_seconds", "tokens_per_second"):
            value = getattr(self, name)
            if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                    or value <= 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))  # np.float32 (a number) was refused; numpy kept as float

    @classmethod
    def from_hf_config(cls, hf_config, *, text_offset: str = "max_hw") -> "MRopeConfig":
        """Read a transformers config of a supported family (top level, text_config, vision_config,
        rope_scaling or rope_parameters).

        Without an `mrope_section` the family's transformers default is used ([16, 24, 24] for
        Qwen2/2.5-VL, [24, 20, 20] for Qwen3-VL / Qwen3-Omni), as the HF rotary does. A Qwen3-Omni
        thinker without `vision_start_token_id` takes the top-level / talker value, else 151652.
        """
        model_type = getattr(hf_config, "model_type", None)
        top = hf_config
        if model_type == "qwen3_omni_moe":
            hf_config = _part(hf_config, "thinker_config", f"hf_config of model_type {model_type!r}")
            model_type = getattr(hf_config, "model_type", None)
        family = _MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
        if family is None:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(_MODEL_TYPES)}")
        text = getattr(hf_config, "text_config", None) or hf_config
        vision = _part(hf_config, "vision_config", "hf_config")
        rope_name = "rope_parameters" if getattr(text, "rope_parameters", None) else "rope_scaling"
        rope = getattr(text, rope_name, None) or {}
        if not isinstance(rope, Mapping):
            raise ValueError(f"hf_config {rope_name} must be a dict, got {rope!r}")
        interleaved = rope.get("mrope_interleaved", family in ("qwen3_vl", "qwen3_omni"))
        if interleaved is not None and not isinstance(interleaved, (bool, np.bool_)):  # bool("false") is True
            raise ValueError(f"hf_config {rope_name} mrope_interleaved must be true or false, got {interleaved!r}")
        talker = getattr(top, "talker_config", None)
        return cls(
            family=family,
            spatial_merge_size=_int("vision_config.spatial_merge_size", getattr(vision, "spatial_merge_size", None)),
            image_token_id=_int("image_token_id", getattr(hf_config, "image_token_id", None)),
            video_token_id=_int("video_token_id", getattr(hf_config, "video_token_id", None)),
            vision_start_token_id=_int("vision_start_token_id", _first_attr(
                (hf_config, top, talker), "vision_start_token_id", QWEN_VISION_START_TOKEN_ID)),
            audio_token_id=getattr(hf_config, "audio_token_id", None),
            audio_start_token_id=getattr(hf_config, "audio_start_token_id", None),
            position_id_per_seconds=_number("position_id_per_seconds",
                                            getattr(hf_config, "position_id_per_seconds", None), 25.0),
            audio_n_window=_int("audio_config.n_window",
                                getattr(getattr(hf_config, "audio_config", None), "n_window", None), 50),
            tokens_per_second=_tokens_per_second(family, getattr(vision, "tokens_per_second", None)),
            mrope_section=_section(rope.get("mrope_section"), DEFAULT_MROPE_SECTION[family]),
            mrope_interleaved=bool(interleaved),
            text_offset=text_offset,
        )


# The fields `get_rope_index` reads for each family: the positions it gives depend on these and on no
# other field (tests/rope/test_position_fields.py: changing any other field leaves every position as it
# was; changing one of these changes some, or makes the index refuse the rows). `mrope_section` and
# `mrope_interleaved` are never among them: they lay the rotary's frequencies out over (t, h, w) inside
# the model, from the model's own settings, after the positions are made. `vision_start_token_id`, the
# audio fields and `position_id_per_seconds` are read by Qwen3-Omni's rule only, `tokens_per_second` by
# Qwen2.5-VL's only, `text_offset` by all but Qwen3-Omni's (rope/omni.py resumes text by its own rule).
_BLOCK_FIELDS = ("family", "spatial_merge_size", "image_token_id", "video_token_id")
POSITION_FIELDS: dict[str, tuple[str, ...]] = {
    "qwen2_vl": _BLOCK_FIELDS + ("text_offset",),
    "qwen2_5_vl": _BLOCK_FIELDS + ("tokens_per_second", "text_offset"),
    "qwen3_vl": _BLOCK_FIELDS + ("text_offset",),
    "qwen3_omni": _BLOCK_FIELDS + ("vision_start_token_id", "audio_token_id", "audio_start_token_id",
                                   "position_id_per_seconds", "audio_n_window"),
}


# The families whose `get_rope_index` reads `second_per_grid_ts` (the time step of each video's frames); Qwen2-VL's
# places frames by their index, Qwen3-VL's by the timestamp text between them, and neither model takes seconds.
SECONDS_FAMILIES = frozenset({"qwen2_5_vl", "qwen3_omni"})


def position_differences(made_with: MRopeConfig, wanted: MRopeConfig) -> tuple[tuple[str, object, object], ...]:
    """(field, `made_with`'s value, `wanted`'s value) of each field that makes positions (`POSITION_FIELDS` of
    either config's family) and differs, in the dataclass's field order; empty when the positions `made_with`
    gives are the ones `wanted` gives, whatever the rows.

    MRopeConfig(family="qwen2_5_vl", tokens_per_second=1.0, mrope_section=(1, 1, 2)) against
    MRopeConfig(family="qwen2_5_vl", tokens_per_second=2.0) -> (("tokens_per_second", 1.0, 2.0),)
    """
    compared = set(POSITION_FIELDS[made_with.family]) | set(POSITION_FIELDS[wanted.family])
    return tuple((f.name, getattr(made_with, f.name), getattr(wanted, f.name)) for f in fields(MRopeConfig)
                 if f.name in compared and getattr(made_with, f.name) != getattr(wanted, f.name))


# Readers of one config field: a JSON config may write an int as 2.0 (kept, as int() did), but 2.5, True or "2"
# were truncated or coerced by int() / float() into a different model's numbers; they are ValueErrors now.
def _part(config, name: str, where: str):
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"{where} has no {name}")
    return value


def _int(name: str, value, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"hf_config {name} must be an int, got {value!r}")
    return int(value)


def _number(name: str, value, default: float) -> float:
    if value is None:  # transformers writes None for an unset field
        return default
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"hf_config {name} must be a number, got {value!r}")
    return float(value)  # range (finite, > 0) checked by MRopeConfig


def _tokens_per_second(family: str, value) -> float:
    """Qwen2.5-VL's `vision_config.tokens_per_second`: its video t positions step by it. transformers'
    config class fills 4 when the field is absent, and its own `get_rope_index` fails on null, so a
    null here (or a config object without the field) is not read as any number. The other families
    have no such field: their videos step by 1."""
    if family != "qwen2_5_vl":
        return _number("vision_config.tokens_per_second", value, 1.0)
    if value is None:
        raise ValueError("hf_config vision_config.tokens_per_second is null or missing: a Qwen2.5-VL config needs it "
                         "(its videos' t positions step by it; transformers' config class writes 4 when absent)")
    return _number("vision_config.tokens_per_second", value, 1.0)


def _section(value, default: tuple[int, ...]) -> tuple[int, ...]:
    if value is None:
        return default
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"hf_config mrope_section must be a list of 3 ints, got {value!r}")
    return tuple(_int(f"mrope_section entry {i}", x) for i, x in enumerate(value))
