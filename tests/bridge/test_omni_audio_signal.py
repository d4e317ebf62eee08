"""The tiny Bridge Qwen3-Omni thinker reads its audio clips, so a clip routed to the wrong sample shows in its losses.

transformers draws every audio encoder weight from N(0, 0.02). The tiny encoder's downsampling fan-ins (9, 72, 72,
16, each behind a GELU) then shrink a clip to ~1e-5 of the sinusoidal positions it is added to: the encoder's output
was its positions alone, every clip zeroed moved the thinker's per-token losses by 4.3e-6, and the parity suites'
loss checks (1e-5 per token, the step's probe 1e-4) passed a pack handing each sample another sample's clip.
`build_tiny_omni` redraws those layers at He scale (`TinyOmniConfig.audio_he_init`, on by default). Measured on the
parity suite's 5 samples (3 clips, 53 targets), each alone on Bridge's dense path: losses move by 0.28 with every
clip zeroed, 0.22 with every clip another sample's (vision, for scale: 0.71 zeroed, 0.35 other patches); at
transformers' scale by 4.3e-6 and 5.7e-6.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.bridge

SEED = 3


def _cfg(he: bool):
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig

    return TinyOmniConfig(audio_he_init=he)


@pytest.fixture(scope="module")
def models(single_process_megatron):
    from megatron_vlm_packing.bridge.truth import build_family

    return {he: build_family("qwen3_omni", _cfg(he), seed=SEED) for he in (True, False)}


@pytest.fixture(scope="module")
def samples():
    from megatron_vlm_packing.bridge.build_omni import omni_samples

    out = omni_samples(_cfg(True), 5, seed=SEED)
    assert sum(len(s["audio_features"]) for s in out) >= 3
    return out


def _zeroed(samples):
    return [dict(s, audio_features=[torch.zeros_like(f) for f in s["audio_features"]]) for s in samples]


def _foreign(samples):
    """Every clip holds the mel features of the next sample's clip (cyclic), tiled to its own frames."""
    clips = [f for s in samples for f in s["audio_features"]]
    donors = iter(clips[1:] + clips[:1])
    out = []
    for s in samples:
        taken = []
        for clip in s["audio_features"]:
            donor = next(donors)
            taken.append(donor.repeat(1, -(-clip.shape[1] // donor.shape[1]))[:, :clip.shape[1]])
        out.append(dict(s, audio_features=taken))
    return out


def _losses(model, samples, he: bool) -> torch.Tensor:
    from megatron_vlm_packing.bridge.truth import alone_losses

    with torch.no_grad():
        return torch.cat([alone_losses(model, "qwen3_omni", s, _cfg(he)) for s in samples])


def _content_share(model, samples) -> float:
    """Over the clips, the smallest mean share of the audio encoder's output rows (norm) that changes when the
    clip is zeroed."""
    encoder = model.thinker.audio_model
    shares = []
    with torch.no_grad():
        for clip in (f for s in samples for f in s["audio_features"]):
            lengths = torch.tensor([clip.shape[1]])
            out = encoder(clip, feature_lens=lengths).last_hidden_state
            blank = encoder(torch.zeros_like(clip), feature_lens=lengths).last_hidden_state
            shares.append(((out - blank).norm(dim=1) / out.norm(dim=1)).mean().item())
    return min(shares)


@pytest.mark.parametrize("edit", [_zeroed, _foreign], ids=["zeroed", "foreign"])
def test_the_losses_read_every_clip(models, samples, edit):
    moved = (_losses(models[True], edit(samples), True) - _losses(models[True], samples, True)).abs()
    assert moved.max() > 0.05, moved.max()  # measured 0.28 / 0.22; the suites' loss tolerances are <= 1e-4


def test_the_encoder_output_is_mostly_its_clip(models, samples):
    assert _content_share(models[True], samples) > 0.5  # measured 0.63 (transformers' draw: 1.7e-5)


@pytest.mark.parametrize("edit", [_zeroed, _foreign], ids=["zeroed", "foreign"])
def test_at_transformers_scale_the_losses_hardly_read_a_clip(models, samples, edit):
    """The cause, kept visible: with transformers' own draw, no loss check could see a clip."""
    moved = (_losses(models[False], edit(samples), False) - _losses(models[False], samples, False)).abs()
    assert moved.max() < 1e-4, moved.max()  # measured 4.3e-6 / 5.7e-6
    assert _content_share(models[False], samples) < 1e-3  # measured 1.7e-5


def test_he_init_redraws_only_the_downsampling_layers_and_the_same_on_every_build(models, single_process_megatron):
    from megatron_vlm_packing.bridge.build_omni import AUDIO_DOWNSAMPLING, build_tiny_omni

    he, hf = (dict(models[k].named_parameters()) for k in (True, False))
    changed = {n for n in he if not torch.equal(he[n], hf[n])}
    assert changed == {f"thinker.audio_model.{name}.weight" for name in AUDIO_DOWNSAMPLING}, changed
    again = dict(build_tiny_omni(_cfg(True), seed=SEED).named_parameters())
    assert all(torch.equal(again[n], he[n]) for n in changed)
    for name in AUDIO_DOWNSAMPLING:
        weight = he[f"thinker.audio_model.{name}.weight"]
        assert abs(weight.std().item() * weight[0].numel() ** 0.5 / 2 ** 0.5 - 1) < 0.3, (name, weight.std())
