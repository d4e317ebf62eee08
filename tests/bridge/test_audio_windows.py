"""`bridge.audio_windows`: transformers 5.8.0's Qwen3-Omni audio attention hands its windows (`cu_seqlens`) to
flash attention only, so under eager or sdpa the clips of one encoder call attend to each other. The packed Omni
path (`patches.bridge_qwen3_omni_packed.audio_embeddings`) encoded clips whose chunks pad alike in one call: under
5.8.0 two samples' 100-frame clips read each other (a cross-sample flow, silent). Now it asks the encoder first and
encodes clip by clip where they would. No Bridge needed: transformers' own tiny encoder, and stand-ins."""

import types

import pytest
import torch
from torch import nn

from megatron_vlm_packing.bridge.audio_windows import clip_groups, encoder_keeps_clips_apart
from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import audio_embeddings
from tests.bridge.test_omni_dense_audio_count import _hf_encoder

pytest.importorskip("transformers.models.qwen3_omni_moe", reason="transformers without Qwen3-Omni")

CLIPS = [100, 100, 37, 250]  # two clips that pad alike (one group), a short one, a long one


def _alone(encoder, frames: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    with torch.no_grad():
        return [encoder(frames[:, a:a + n], feature_lens=torch.tensor([n])).last_hidden_state
                for a, n in zip(starts, lengths)]


def test_the_probe_says_what_the_encoder_does():
    encoder = _hf_encoder()
    torch.manual_seed(1)
    frames = torch.randn(16, 200)  # two clips of 100 frames: chunks pad alike, so only attention can join them
    with torch.no_grad():
        together = encoder(frames, feature_lens=torch.tensor([100, 100])).last_hidden_state
    apart = torch.allclose(together, torch.cat(_alone(encoder, frames, [100, 100])), rtol=1e-5, atol=1e-6)
    assert encoder_keeps_clips_apart(encoder) == apart  # transformers 5.8.0 (eager): False; 5.12.1, 5.24: True


def test_every_clip_is_encoded_as_alone_whatever_the_transformers():
    encoder = _hf_encoder()
    torch.manual_seed(2)
    frames = torch.randn(16, sum(CLIPS))
    with torch.no_grad():
        packed = audio_embeddings(types.SimpleNamespace(audio_model=encoder), frames,
                                  audio_feature_lengths=torch.tensor(CLIPS))
    alone = torch.cat(_alone(encoder, frames, CLIPS))
    assert packed.shape == alone.shape == (13 + 13 + 5 + 33, 8)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


class _Attention(nn.Module):
    """Softmax attention over [S, D] states, within each cu_seqlens window or over all of them."""

    def __init__(self, keeps_windows: bool, width: int = 8):
        super().__init__()
        self.embed_dim, self.keeps_windows = width, keeps_windows
        self.proj = nn.Linear(width, width)

    def forward(self, states, cu_seqlens):
        bounds = cu_seqlens.tolist() if self.keeps_windows else [0, states.shape[0]]
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            x = self.proj(states[a:b])
            out.append(torch.softmax(x @ x.T, dim=-1) @ x)
        return torch.cat(out)


@pytest.mark.parametrize("keeps_windows", [True, False])
def test_stand_ins(keeps_windows):
    torch.manual_seed(0)
    encoder = types.SimpleNamespace(layers=[types.SimpleNamespace(self_attn=_Attention(keeps_windows))])
    assert encoder_keeps_clips_apart(encoder) == keeps_windows


def test_probed_once_per_attention_and_implementation():
    """The packed path asks on every micro-batch with several clips: the probe (two attention calls and a
    read-back) runs once per attention layer and attention implementation, not per question."""
    torch.manual_seed(0)
    attention = _Attention(keeps_windows=False)
    attention.config = types.SimpleNamespace(_attn_implementation="eager")
    calls = []
    attention.register_forward_hook(lambda *_: calls.append(1))
    encoder = types.SimpleNamespace(layers=[types.SimpleNamespace(self_attn=attention)])
    assert [encoder_keeps_clips_apart(encoder) for _ in range(3)] == [False] * 3
    assert len(calls) == 2
    attention.keeps_windows = True  # another implementation: asked again
    attention.config._attn_implementation = "sdpa"
    assert encoder_keeps_clips_apart(encoder) is True and len(calls) == 4


def test_clip_groups():
    assert clip_groups([30, 250, 30, 120], 50) == [[0, 2], [1, 3]]
    assert clip_groups([], 50) == []
