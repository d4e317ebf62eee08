"""`bridge.omni_dense_audio`: Bridge 0.6.2's dense Qwen3-Omni audio path cuts the encoder's output into clips by
the encoder's `_get_feat_extract_output_lengths`, which transformers 5.24 lacks and 5.12.1 (Bridge's own range)
has by another model's rule (25 tokens for 100 frames where the encoder makes 13). Under 5.12.1 the adapter let
dense audio rows through on the method's presence, and Bridge failed inside ("Audio features and audio tokens do
not match: tokens=16, features=13"). The question is asked of the method: here of the installed transformers'
real encoder, whose output is measured, and of stand-ins for each version's method. No Bridge needed."""

import types

import pytest
import torch

from megatron_vlm_packing.bridge.omni_dense_audio import dense_audio_problem, dense_audio_shim
from megatron_vlm_packing.rope.omni import audio_output_length

pytest.importorskip("transformers.models.qwen3_omni_moe", reason="transformers without Qwen3-Omni")


def _hf_encoder():
    """transformers' own Qwen3-Omni audio encoder, tiny, with the released window (n_window 50), weights at He scale."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    config = Qwen3OmniMoeAudioEncoderConfig(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2,
                                            encoder_ffn_dim=32, d_model=16, output_dim=8, downsample_hidden_size=8,
                                            max_source_positions=64, n_window=50, n_window_infer=800)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    encoder = Qwen3OmniMoeAudioEncoder._from_config(config).eval()
    for module in encoder.modules():  # He scale: transformers' N(0, 0.02) leaves attention next to no effect
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            torch.nn.init.normal_(module.weight, std=module.weight[0].numel() ** -0.5)
    return encoder


def _made(encoder, frames: list[int]) -> int:
    """Output rows the encoder makes for clips of these frame counts, encoded together."""
    features = torch.randn(16, sum(frames))  # [mel, total frames]
    with torch.no_grad():
        return encoder(features, feature_lens=torch.tensor(frames)).last_hidden_state.shape[0]


def test_the_installed_encoder_is_judged_by_what_it_makes():
    encoder = _hf_encoder()
    assert _made(encoder, [100, 37, 250]) == int(audio_output_length(torch.tensor([100, 37, 250]), 50).sum())  # 13+5+33
    problem = dense_audio_problem(encoder)
    method = getattr(encoder, "_get_feat_extract_output_lengths", None)
    if method is None:  # transformers 5.24
        assert "which this transformers' encoder lacks" in problem
    elif int(method(torch.tensor([100]))[1]) != 13:  # transformers 5.12.1: another model's rule
        claimed = int(method(torch.tensor([100]))[1])
        assert f"counts {claimed} tokens for a clip of 100 frames where the encoder makes 13 (n_window 50)" in problem
    else:
        assert problem is None
    dense_audio_shim(encoder)  # the parity truth's encoder: its count is now what it makes, whatever the version
    assert dense_audio_problem(encoder) is None
    assert encoder._get_feat_extract_output_lengths(torch.tensor([100, 37]))[1].tolist() == [13, 5]


def _stand_in(rule, n_window=50):
    encoder = types.SimpleNamespace(n_window=n_window)
    if rule is not None:
        encoder._get_feat_extract_output_lengths = rule
    return encoder


def _older_rule(lengths):  # transformers 5.8 to 5.12.1's Qwen3OmniMoeAudioEncoder._get_feat_extract_output_lengths
    features = (lengths - 1) // 2 + 1
    return features, (features - 2) // 2 + 1


@pytest.mark.parametrize("rule, expected", [
    (None, "which this transformers' encoder lacks"),
    (_older_rule, "counts 25 tokens for a clip of 100 frames where the encoder makes 13 (n_window 50)"),
    (lambda lengths: (lengths, audio_output_length(lengths, 50)), None),
])
def test_each_versions_method(rule, expected):
    problem = dense_audio_problem(_stand_in(rule))
    assert problem == expected if expected is None else expected in problem


def test_a_method_counting_for_another_window_is_named():
    problem = dense_audio_problem(_stand_in(lambda lengths: (lengths, audio_output_length(lengths, 50)), n_window=100))
    assert "counts 14 tokens for a clip of 101 frames where the encoder makes 13 (n_window 100)" in problem
