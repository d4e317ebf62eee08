"""`PackedVLM` with a Qwen3-Omni `MRopeConfig`, end to end through the shipped step: one packed
micro-batch of text-only, audio-only, image + audio and image + video + audio samples equals each
sample run alone (dense, batch of one), per token and in every gradient (towers included).

Real Megatron-Core modules: a tiny GPTModel with position_embedding_type="mrope" (Qwen3's
interleaved layout), our tiny vision and audio towers, the Omni samples of `bridge.build_omni`
(pure torch: Qwen3-Omni's block layout, `second_per_grid_ts`, `audio_seqlens`). The video's
seconds per grid step (0.5) times `position_id_per_seconds` (25) make fractional temporal
positions; the test checks that they reach the rotary in both runs, and that flooring them (a cast
to integers, made on purpose) breaks the parity, so the check bites.

One 2-process launch: the reference and the packed run at CP=1, then the packed run at CP=2
(compared with the reference and with the CP=1 run); each packed run also takes the batch with a
collator's [3, B, S] float positions beside `audio_seqlens` / `use_audio_in_video` (refused before),
and a second micro-batch with `use_audio_in_video` (a video and its audio track in one block, their
positions merged by time) against its samples alone (losses only).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed

SEED = 5
TOLERANCE = 2e-5  # fp32 on CPU; measured: 4.8e-7 (9.5e-7 with audio in video); flooring the positions: 1.2e-3
MEDIA = {"text_only": dict(images=0, videos=0, audios=0, text=7),
         "audio_only": dict(images=0, videos=0, audios=1, text=5),
         "image_video_audio": dict(images=1, videos=1, audios=1, text=12),
         "images_audio": dict(images=2, videos=0, audios=2, text=9)}


def _omni_cfg():
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig

    return TinyOmniConfig()  # hidden 64, 4 heads: mrope_section (2, 3, 3) sums to kv_channels / 2


def _samples(cfg) -> list[dict]:
    from megatron_vlm_packing.bridge.build_omni import omni_sample

    rng = torch.Generator().manual_seed(SEED)
    return [omni_sample(rng, cfg, **counts) for counts in MEDIA.values()]


def _with_audio_in_video(sample: dict, cfg, frames: int, rng) -> dict:
    """`sample`'s one video with an audio track (Qwen3-Omni `use_audio_in_video`): `vision_start,
    audio_start`, the clip's audio placeholders, the video's, `audio_end, vision_end`. The processor
    interleaves the two kinds by time; positions only need the counts (the index is checked against
    transformers' in tests/rope/test_omni.py) and each tower's embeddings go to its own kind in order."""
    from megatron_vlm_packing.rope.omni import audio_output_length

    ids = cfg.token_ids
    tokens, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    start = tokens.index(ids["vision_start_token_id"])
    end = tokens.index(ids["vision_end_token_id"], start)
    assert tokens[start + 1] == ids["video_token_id"], "the sample's first vision block must be its video"
    audio = [ids["audio_start_token_id"]] + [ids["audio_token_id"]] * int(audio_output_length(torch.tensor(frames), 50))
    tokens = tokens[:start + 1] + audio + tokens[start + 1:end] + [ids["audio_end_token_id"]] + tokens[end:]
    labels = labels[:start + 1] + [-100] * len(audio) + labels[start + 1:end] + [-100] + labels[end:]
    return dict(sample, input_ids=torch.tensor(tokens), labels=torch.tensor(labels),
                audio_features=[torch.randn(cfg.num_mel_bins, frames, generator=rng)], audio_frames=[frames])


def _audio_in_video_samples(cfg) -> list[dict]:
    """A video with its audio track, a text-only sample, an image with a separate clip."""
    from megatron_vlm_packing.bridge.build_omni import omni_sample

    rng = torch.Generator().manual_seed(SEED + 1)
    video = omni_sample(rng, cfg, images=0, videos=1, audios=0, text=8)
    return [_with_audio_in_video(video, cfg, 120, rng), omni_sample(rng, cfg, images=0, videos=0, audios=0, text=6),
            omni_sample(rng, cfg, images=1, videos=0, audios=1, text=10)]


def _collate(samples: list[dict], *, audio_in_video: bool = False) -> dict:
    from megatron_vlm_packing.bridge.build_omni import collate_omni

    batch = collate_omni(samples)
    return {**batch, "use_audio_in_video": True} if audio_in_video else batch


def _build(cfg, cp: int):
    """PackedVLM: tiny mRoPE GPTModel + vision tower (images, videos) + audio tower, Qwen3-Omni rotary."""
    from megatron_vlm_packing.models.audio import TinyAudioTower
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.models.vision import TinyVisionTower
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    initialize_parallel(cp=cp, seed=SEED)
    torch.manual_seed(SEED)
    lm_cfg = TinyGPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           num_attention_heads=cfg.num_attention_heads, ffn_hidden_size=cfg.ffn_hidden_size,
                           position_embedding_type="mrope", mrope_section=cfg.mrope_section,
                           max_sequence_length=1024, context_parallel=cp)
    lm = build_tiny_gpt(lm_cfg, scatter_embedding_sequence_parallel=False)
    vision = TinyVisionTower(patch_features=cfg.patch_features, width=16, out_hidden=cfg.hidden_size, heads=2)
    audio = TinyAudioTower(mel_bins=cfg.num_mel_bins, width=16, out_hidden=cfg.hidden_size, n_window=50)
    ids = cfg.token_ids
    return PackedVLM(lm, vision, image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
                     audio=audio, audio_token_id=ids["audio_token_id"], mrope=cfg.mrope_config(),
                     spatial_merge_size=cfg.spatial_merge_size)


class _RotaryInputs:
    """Records the positions the language model's rotary is called with (a forward pre-hook)."""

    def __init__(self, model):
        self.seen = []
        self.hook = model.language_model.rotary_pos_emb.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        self.seen.append(args[0].detach().clone())

    def fractional(self) -> int:
        """Positions (of every call so far) that are not whole numbers."""
        return sum(int((p.float() != p.float().round()).sum()) for p in self.seen)


def _step_losses(model, batch, *, pack: bool, transform=None):
    """(per-token losses at targets [R], in packed order; loss sum [] with autograd) of one micro-batch
    through the shipped `make_forward_step`; packed losses are gathered over CP."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.step import make_forward_step
    from megatron_vlm_packing.testing.parity import gather_cp_tokens

    seen = []

    def observe(mb):
        mb = mb if transform is None else transform(mb)
        seen.append(mb)
        return mb

    output, reduce = make_forward_step(pack=pack, label_style="hf", transform=observe)(iter([batch]), model)
    loss_sum = reduce(output)[0]
    mb = seen[0]
    full = output.detach()
    if pack and ps.get_context_parallel_world_size() > 1:
        full = gather_cp_tokens(full, mb.packed_seq_params.cu_seqlens_q_padded, ps.get_context_parallel_group())
    return full[mb.loss_mask.bool()], loss_sum


def _floored(mb):
    """Bug made on purpose: fractional temporal positions cast to integers (floored)."""
    return replace(mb, position_ids=mb.position_ids.floor())


def _reference(cfg, samples):
    """Each sample alone (pack=False, batch of one): losses at targets, summed grads, weights."""
    model = _build(cfg, cp=1)
    rotary = _RotaryInputs(model)
    losses, fractional = [], []
    for sample in samples:
        before = rotary.fractional()
        loss, loss_sum = _step_losses(model, _collate([sample]), pack=False)
        loss_sum.backward()
        losses.append(loss)
        fractional.append(rotary.fractional() - before)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    before, av = rotary.fractional(), []
    with torch.no_grad():
        for sample in _audio_in_video_samples(cfg):
            av.append(_step_losses(model, _collate([sample], audio_in_video=True), pack=False)[0])
    return dict(losses=losses, fractional=fractional, grads=grads, state=state, audio_in_video=torch.cat(av),
                audio_in_video_fractional=rotary.fractional() - before)


def _omni_batch_with_positions():
    """The Omni batch with its `get_rope_index` float [3, B, S] positions, as a collator that computes
    them writes it (the index's inputs `audio_seqlens` and `use_audio_in_video` stay in the batch)."""
    from megatron_vlm_packing.bridge.build_omni import collate_omni
    from megatron_vlm_packing.rope import get_rope_index

    cfg = _omni_cfg()
    batch = collate_omni(_samples(cfg))
    positions = get_rope_index(batch["input_ids"], cfg.mrope_config(), image_grid_thw=batch["image_grid_thw"],
                               video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"],
                               audio_seqlens=batch["audio_seqlens"],
                               second_per_grid_ts=batch["second_per_grid_ts"]).position_ids
    return cfg, {**batch, "position_ids": positions, "use_audio_in_video": False}


def _packed(cfg, samples, cp: int, state: dict) -> dict:
    """The packed micro-batch at context-parallel size `cp`: losses, grads, fractional rotary positions;
    then (no grad) the losses with floored positions, with given positions, and of the audio-in-video pack."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.testing.parity import full_gradients

    model = _build(cfg, cp=cp)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    rotary = _RotaryInputs(model)
    batch = _collate(samples)
    losses, loss_sum = _step_losses(model, batch, pack=True)
    loss_sum.backward()
    fractional = rotary.fractional()
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(),
                           cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        floored, _ = _step_losses(model, batch, pack=True, transform=_floored)
        given, _ = _step_losses(model, _omni_batch_with_positions()[1], pack=True)
        av, _ = _step_losses(model, _collate(_audio_in_video_samples(cfg), audio_in_video=True), pack=True)
    return dict(losses=losses, grads=grads, fractional=fractional, floored=floored, given=given, audio_in_video=av,
                lengths=[len(s["input_ids"]) for s in samples])


def run_omni_packed_vlm(rank: int, world_size: int) -> dict:
    """Reference and packed at CP=1, packed at CP=2; errors as max |diff| (grads: relative)."""
    from megatron_vlm_packing.testing.parity import max_relative_error

    cfg = _omni_cfg()
    samples = _samples(cfg)
    truth = _reference(cfg, samples)
    alone = torch.cat(truth["losses"])
    out = dict(names=list(MEDIA), alone_fractional=truth["fractional"], tokens=[len(x) for x in truth["losses"]],
               audio_in_video_fractional=truth["audio_in_video_fractional"])
    runs = {}
    for cp in (1, 2):
        run = _packed(cfg, samples, cp, truth["state"])
        runs[cp] = run
        out[f"cp{cp}"] = dict(
            max_dloss=(run["losses"] - alone).abs().max().item(),
            max_dloss_floored=(run["floored"] - alone).abs().max().item(),
            max_dloss_given_positions=(run["given"] - alone).abs().max().item(),
            max_dloss_audio_in_video=(run["audio_in_video"] - truth["audio_in_video"]).abs().max().item(),
            max_rel_grad=max(max_relative_error(g, truth["grads"][n]) for n, g in run["grads"].items()),
            towers_with_grad=sorted({n.split(".")[0] for n, g in run["grads"].items() if g.abs().sum() > 0}),
            fractional=run["fractional"], tokens=len(run["losses"]), lengths=run["lengths"])
    out["cp2_vs_cp1"] = (runs[2]["losses"] - runs[1]["losses"]).abs().max().item()
    return out


@pytest.fixture(scope="module")
def result():
    return run_distributed(run_omni_packed_vlm, 2, timeout_s=600)


def test_samples_cover_the_mix(result):
    """3+ samples of different lengths, one text-only, one audio-only, images with audio, a video."""
    lengths = result["cp1"]["lengths"]
    assert len(set(lengths)) == len(lengths) >= 3, lengths
    assert result["names"] == ["text_only", "audio_only", "image_video_audio", "images_audio"]


def test_fractional_positions_reach_the_rotary(result):
    """The video's temporal positions (k * 0.5 s * 25 / s) are non-integers in the rotary's input,
    alone (only the sample with the video) and packed."""
    alone = dict(zip(result["names"], result["alone_fractional"]))
    assert alone["image_video_audio"] > 0 and alone["text_only"] == alone["audio_only"] == 0, alone
    assert result["cp1"]["fractional"] > 0 and result["cp2"]["fractional"] > 0
    assert result["audio_in_video_fractional"] > 0


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_equals_each_sample_alone(result, cp):
    row = result[f"cp{cp}"]
    assert row["tokens"] == sum(result["tokens"]), (row["tokens"], result["tokens"])
    assert row["max_dloss"] < TOLERANCE, row
    assert row["max_dloss_given_positions"] < TOLERANCE, row  # the collator's [3, B, S] positions, packed as given
    assert row["max_dloss_audio_in_video"] < TOLERANCE, row  # a second micro-batch: a video with its audio track
    assert row["max_rel_grad"] < 1e-4, row
    assert {"language_model", "vision", "audio"} <= set(row["towers_with_grad"]), row


@pytest.mark.parametrize("cp", [1, 2])
def test_floored_positions_break_parity(result, cp):
    """The parity check bites: integer temporal positions (fractions dropped) change the losses."""
    assert result[f"cp{cp}"]["max_dloss_floored"] > 10 * TOLERANCE, result[f"cp{cp}"]


def test_cp2_equals_cp1(result):
    assert result["cp2_vs_cp1"] < TOLERANCE, result["cp2_vs_cp1"]


@pytest.mark.parametrize("pack", [True, False])
def test_given_omni_positions_beside_their_index_inputs_are_taken(pack):
    """[3, B, S] positions given with `audio_seqlens` / `use_audio_in_video` (what they were computed
    from) are packed as given: those keys were refused as 'read only by an mRoPE index, and no mrope=
    was given', and with mrope= the positions were ('pass one of them'), so no such batch could pass."""
    from megatron_vlm_packing.packing import pack_batch, pad_batch

    cfg, batch = _omni_batch_with_positions()
    ids = {k: cfg.token_ids[k] for k in ("image_token_id", "video_token_id", "audio_token_id")}
    mb = (pack_batch if pack else pad_batch)(batch, label_style="hf", **ids)
    expected = (pack_batch if pack else pad_batch)({k: v for k, v in batch.items() if k != "position_ids"},
                                                   label_style="hf", mrope=cfg.mrope_config(), **ids)
    assert mb.position_ids.dtype == torch.float32 and torch.equal(mb.position_ids, expected.position_ids)
    assert (mb.position_ids != mb.position_ids.round()).any()
    assert mb.audio.audio_lengths == expected.audio.audio_lengths
    bad = {**batch, "audio_seqlens": batch["audio_seqlens"] + 1}  # still checked against feature_attention_mask
    with pytest.raises(ValueError, match=r"audio_seqlens and feature_attention_mask disagree on audio 0"):
        (pack_batch if pack else pad_batch)(bad, label_style="hf", **ids)
