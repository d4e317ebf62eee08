"""Media inputs whose dtype or shape the towers or the mRoPE index would silently change: refused by the
packer with a ValueError naming the field and the dtype / shape, on every packing path (`pack_batch` on the
device and on the host, `pad_batch`, and a DataLoader's `PackingCollator`).

Before: integer / bool / complex `pixel_values`, `pixel_values_videos` and Qwen3-Omni `input_features` were
packed as given and cast to float by the tower (`.to(weight.dtype)`: uint8 pixels never normalised, complex
ones without their imaginary part); `audio_seqlens` of shape [A, 1] was flattened; a float
`feature_attention_mask` was read as 0/1 (the Qwen3-Omni processor gives int32, which still packs).
"""

import pytest
import torch

from megatron_vlm_packing import packing
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from tests.adversarial.test_audio_seqlens import OMNI, ONE, ONE_TOKEN, TEN, TWO_TOKENS, _batch, _features

QWEN25 = MRopeConfig(family="qwen2_5_vl", image_token_id=9, video_token_id=8, vision_start_token_id=5,
                     mrope_section=(24, 20, 20), tokens_per_second=2)
PACKERS = {
    "pack": packing.pack_batch,
    "pack_host": lambda batch, **kw: packing.pack_batch(batch, host_reads=True, **kw),
    "pad": packing.pad_batch,
    "collator": lambda batch, *, label_style, mrope: PackingCollator(label_style=label_style, mrope=mrope)(batch),
}
NOT_FLOATING = [torch.int64, torch.uint8, torch.bool, torch.complex64]


def _vision_batch(field: str, dtype: torch.dtype) -> dict:
    """Two rows, each one image (id 9) or one video (id 8) of grid [1, 2, 2] (1 placeholder), its patches `dtype`."""
    token, grid = (9, "image_grid_thw") if field == "pixel_values" else (8, "video_grid_thw")
    extra = {field: torch.ones(8, 6).to(dtype), grid: torch.tensor([[1, 2, 2], [1, 2, 2]])}
    if field == "pixel_values_videos":
        extra["second_per_grid_ts"] = torch.tensor([1.0, 2.0])
    return _batch([[1, 5, token, 3], [1, 5, token, 3]], **extra)


def _audio_batch(**change) -> dict:
    """Rows of 2 and 1 audio placeholders with clips of 10 and 1 frames (`_features`), fields replaced by `change`."""
    return _batch([TWO_TOKENS, ONE_TOKEN], **{**_features(TEN, ONE), **change})


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("dtype", NOT_FLOATING, ids=str)
@pytest.mark.parametrize("field", ["pixel_values", "pixel_values_videos"])
def test_vision_patches_that_are_not_floating_point_are_refused(packer, dtype, field):
    with pytest.raises(ValueError, match=rf"^{field} must hold floating-point pixel values, got dtype {dtype}"):
        PACKERS[packer](_vision_batch(field, dtype), label_style="hf", mrope=QWEN25)


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("dtype", NOT_FLOATING, ids=str)
def test_audio_features_that_are_not_floating_point_are_refused(packer, dtype):
    batch = _audio_batch(input_features=_features(TEN, ONE)["input_features"].to(dtype))
    with pytest.raises(ValueError, match=rf"^input_features must hold floating-point mel features, got dtype {dtype}"):
        PACKERS[packer](batch, label_style="hf", mrope=OMNI)


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_floating_media_of_any_width_are_packed_as_given(packer, dtype):
    for field in ("pixel_values", "pixel_values_videos"):
        vision = PACKERS[packer](_vision_batch(field, dtype), label_style="hf", mrope=QWEN25).vision
        assert getattr(vision, field).dtype == dtype
    features = _features(TEN, ONE)["input_features"].to(dtype)
    assert PACKERS[packer](_audio_batch(input_features=features), label_style="hf",
                           mrope=OMNI).audio.input_features.dtype == dtype


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
def test_feature_attention_mask_that_is_not_bool_or_integer_is_refused(packer, dtype):
    """A float 0.0 / 1.0 mask was read as the 0/1 mask it looks like (the audio tower took `.bool()`)."""
    mask = _features(TEN, ONE)["feature_attention_mask"].to(dtype)
    with pytest.raises(ValueError, match=rf"^feature_attention_mask must be a bool or integer tensor of 0/1 values, "
                                         rf"got dtype {dtype}"):
        PACKERS[packer](_audio_batch(feature_attention_mask=mask), label_style="hf", mrope=OMNI)


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_feature_attention_mask_as_processors_give_it_is_packed(packer, dtype):
    """The Qwen3-Omni processor's mask is int32 (Whisper's feature extractor, `np.int32`); bool and other
    integer 0/1 masks pack the same clips."""
    mask = _features(TEN, ONE)["feature_attention_mask"].to(dtype)
    audio = PACKERS[packer](_audio_batch(feature_attention_mask=mask), label_style="hf", mrope=OMNI).audio
    assert audio.audio_lengths == (TEN, ONE) and audio.feature_attention_mask.dtype == dtype


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_feature_attention_mask_with_a_value_other_than_0_and_1_is_still_named(packer):
    mask = _features(TEN, ONE)["feature_attention_mask"] * 2
    with pytest.raises(ValueError, match=r"feature_attention_mask row 0 has values other than 0 and 1: 2 at column 0"):
        PACKERS[packer](_audio_batch(feature_attention_mask=mask), label_style="hf", mrope=OMNI)


SEQLENS_SHAPES = {"[A, 1]": torch.tensor([[TEN], [ONE]]), "[1, A]": torch.tensor([[TEN, ONE]]),
                  "0-dim": torch.tensor(TEN)}


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("shape", sorted(SEQLENS_SHAPES))
def test_audio_seqlens_that_is_not_one_dimensional_is_refused(packer, shape):
    seqlens = SEQLENS_SHAPES[shape]
    with pytest.raises(ValueError, match=rf"^audio_seqlens must be \[A\], one raw length per audio clip, got shape "
                                         rf"{tuple(seqlens.shape)}".replace("(", r"\(").replace(")", r"\)")):
        PACKERS[packer](_batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=seqlens), label_style="hf", mrope=OMNI)


@pytest.mark.parametrize("shape", sorted(SEQLENS_SHAPES))
def test_get_rope_index_refuses_audio_seqlens_that_is_not_one_dimensional(shape):
    seqlens = SEQLENS_SHAPES[shape]
    ids = torch.tensor([TWO_TOKENS, ONE_TOKEN])
    with pytest.raises(ValueError, match=r"^audio_seqlens must be \[A\], one raw length per audio clip"):
        get_rope_index(ids, OMNI, audio_seqlens=seqlens)
    assert get_rope_index(ids, OMNI, audio_seqlens=torch.tensor([TEN, ONE])).position_ids.shape == (3, 2, 5)


@pytest.mark.parametrize("seconds", [torch.tensor([[1.0], [2.0]]), torch.tensor(1.0)], ids=["[V, 1]", "0-dim"])
def test_get_rope_index_refuses_seconds_that_are_not_one_dimensional(seconds):
    """pack_batch refused these already (`media_tensor`); the index flattened them."""
    ids, grid = torch.tensor([[1, 5, 8, 3], [1, 5, 8, 3]]), torch.tensor([[1, 2, 2], [1, 2, 2]])
    with pytest.raises(ValueError, match=r"^second_per_grid_ts must be \[V\], one entry per video, got shape "):
        get_rope_index(ids, QWEN25, video_grid_thw=grid[:seconds.numel()], second_per_grid_ts=seconds)
    assert get_rope_index(ids, QWEN25, video_grid_thw=grid, second_per_grid_ts=torch.tensor([1.0, 2.0])).position_ids \
        .shape == (3, 2, 4)
