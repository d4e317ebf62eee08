"""`PackedVLM`'s constructor against hostile arguments: a ValueError naming the argument and its value,
never a value that a later forward would read as something else (True as token id 1, a lambda tower whose
weights the optimizer never sees). Real Megatron-Core GPTModels (tiny, CPU, one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def models(single_process_megatron):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt

    torch.manual_seed(0)
    return {"rope": build_tiny_gpt(TinyGPTConfig(), scatter_embedding_sequence_parallel=False),
            "mrope": build_tiny_gpt(TinyGPTConfig(position_embedding_type="mrope", mrope_section=(1, 1, 2)),
                                    scatter_embedding_sequence_parallel=False)}


def _rope(**fields):
    from megatron_vlm_packing.rope import MRopeConfig

    return MRopeConfig(**{"family": "qwen2_vl", "image_token_id": 9, "video_token_id": 8, **fields})


VISION = nn.Linear(2, 2)


class _Windowed(nn.Linear):
    def __init__(self, n_window):
        super().__init__(2, 2)
        self.n_window = n_window


BAD = [
    # silently wrong before: True matched token 1, 5.5 / -1 / "5" / 2**70 no token (or a TypeError mid-forward)
    ("rope", dict(image_token_id=True), r"image_token_id must be None or an int >= 0 that fits int64, got True"),
    ("rope", dict(image_token_id=5.5), r"image_token_id must be None or an int >= 0 that fits int64, got 5\.5"),
    ("rope", dict(video_token_id="5"), r"video_token_id must be None or an int >= 0 that fits int64, got '5'"),
    ("rope", dict(image_token_id=-1), r"image_token_id must be None or an int >= 0 that fits int64, got -1"),
    ("rope", dict(audio=nn.Linear(2, 2), audio_token_id=2**70),
     r"audio_token_id must be None or an int >= 0 that fits int64, got 1180591620717411303424"),
    # one id for two kinds: each kind's embeddings went to the other's placeholders too
    ("rope", dict(image_token_id=5, video_token_id=5), r"image_token_id and video_token_id are both 5"),
    ("rope", dict(image_token_id=5, audio=nn.Linear(2, 2), audio_token_id=5), r"image_token_id and audio_token_id"),
    # 0 was a ZeroDivisionError at the first image, True a merge of 1, 2.5 a TypeError
    ("rope", dict(image_token_id=5, spatial_merge_size=0), r"spatial_merge_size must be an int >= 1, got 0"),
    ("rope", dict(image_token_id=5, spatial_merge_size=True), r"spatial_merge_size must be an int >= 1, got True"),
    ("rope", dict(image_token_id=5, spatial_merge_size=2.5), r"spatial_merge_size must be an int >= 1, got 2\.5"),
    # a tower that is no nn.Module: its weights were no parameters of the model (never trained), and the
    # forward an AttributeError; a vision tower with no placeholder id could never be used
    ("rope", dict(vision=lambda pixels, grid: pixels, image_token_id=5), r"vision must be None or an nn.Module"),
    ("rope", dict(audio="tower", audio_token_id=5),
     r"audio must be None or an nn.Module \(its weights train with the model\), got str 'tower'"),
    ("rope", dict(vision=VISION), r"a vision tower needs image_token_id or video_token_id"),
    # PackedVLM counts each clip's placeholders with the tower's encoder window (Qwen3-Omni's audio_output_length):
    # a tower without one was an AttributeError at the first clip, naming no argument
    ("rope", dict(image_token_id=5, audio=nn.Linear(2, 2), audio_token_id=7),
     r"the audio tower \(Linear\) has no n_window: give it the int window of its encoder"),
    ("rope", dict(image_token_id=5, audio=_Windowed(0), audio_token_id=7),
     r"the audio tower's n_window must be an int >= 1, got 0"),
    # a placeholder id outside the LM's vocabulary (128 here): every token is embedded before the media rows are
    # placed, so the step refused each micro-batch for an input_ids value outside [0, 128) (a direct call: an
    # IndexError in the embedding), naming no argument
    ("rope", dict(image_token_id=128), r"image_token_id=128 is no token id of the language model \(vocab_size=128\)"),
    ("rope", dict(image_token_id=5, video_token_id=4000), r"video_token_id=4000 is no token id of the language model"),
    # the mRoPE config and the model disagree: positions and placeholder counts used different merges
    ("mrope", dict(image_token_id=9, mrope=_rope(), spatial_merge_size=4),
     r"spatial_merge_size=4 but the mRoPE config says 2"),
    ("mrope", dict(image_token_id=9, mrope="qwen2_vl"), r"mrope must be a rope.MRopeConfig or None, got str"),
]


@pytest.mark.parametrize("lm, kwargs, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_packed_vlm_refuses_hostile_arguments_naming_them(models, lm, kwargs, message):
    from megatron_vlm_packing.models.packed_vlm import PackedVLM

    kwargs = {"vision": VISION, **kwargs} if "vision" not in kwargs else kwargs
    with pytest.raises(ValueError, match=message):
        PackedVLM(models[lm], **kwargs)


def test_packed_vlm_refuses_a_language_model_that_is_no_megatron_model(models):
    from megatron_vlm_packing.models.packed_vlm import PackedVLM

    for bad in ("lm", nn.Linear(2, 2)):  # an AttributeError on .config before
        with pytest.raises(ValueError, match=r"language_model must be a Megatron-Core GPTModel"):
            PackedVLM(bad, VISION, image_token_id=5)
    assert PackedVLM(models["rope"], VISION, image_token_id=5, video_token_id=6).spatial_merge_size == 2
    assert PackedVLM(models["rope"], VISION, image_token_id=5, audio=_Windowed(50), audio_token_id=7).audio.n_window == 50

def test_packed_vlm_refuses_a_language_model_that_scatters_its_own_embeddings_under_sp(models):
    """PackedVLM scatters once, after the merge and the CP selection; an LM that also scatters in its embedding
    would hand the decoder a quarter of the tokens at TP=2. (The config flag set by hand: one process has no TP=2.)"""
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt

    scattering = build_tiny_gpt(TinyGPTConfig())  # scatter_embedding_sequence_parallel left at Megatron's True
    assert scattering.embedding.scatter_to_sequence_parallel
    scattering.config.sequence_parallel = True
    try:
        with pytest.raises(ValueError, match=r"build the language model with scatter_embedding_sequence_parallel="
                                             r"False: PackedVLM scatters once"):
            PackedVLM(scattering, VISION, image_token_id=5)
    finally:
        scattering.config.sequence_parallel = False
    models["rope"].config.sequence_parallel = True  # built with the scatter off: accepted under SP
    try:
        assert PackedVLM(models["rope"], VISION, image_token_id=5).config.sequence_parallel
    finally:
        models["rope"].config.sequence_parallel = False
