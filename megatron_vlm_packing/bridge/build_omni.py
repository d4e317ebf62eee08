"""Tiny Qwen3-Omni thinkers built by Megatron-Bridge's own provider, and Omni-style samples.

    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, build_tiny_omni, omni_samples
    initialize_parallel(tp=2, cp=2)                         # Megatron's parallel state first
    cfg = TinyOmniConfig(tensor_parallel=2, context_parallel=2, sequence_parallel=True)
    model = build_tiny_omni(cfg, seed=0)                    # Bridge's Qwen3OmniModel, TE-free, fp32
    batch = collate_omni(omni_samples(cfg, 4, seed=1))     # images, videos and audio clips

The model is Bridge's `Qwen3OmniModel` (thinker: Hugging Face's vision and audio encoders, Bridge's
`Qwen3VLGPTModel` language model with deepstack), built by `Qwen3OmniModelProvider.provide()` with
the language layer spec swapped for Megatron-Core's local spec with our packing-capable core
attention (`bridge.build`). The provider's `moe_permute_fusion=True` default needs TE's fused
permute even for a dense model, so it is set False.

Sample layout as Qwen3-Omni's processor writes it: an image or a video is `vision_start`,
t*h*w/merge^2 placeholders, `vision_end`; an audio clip is `audio_start`, its encoder output length
(`rope.omni.audio_output_length`) of audio placeholders, `audio_end`. Videos have fractional seconds
per temporal grid step, so temporal positions are floats. Labels are Hugging Face style.

Shape legend: P = image patches, Pv = video patches, A = audio clips, F = mel bins, L = frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.bridge.build import build_with_provider, local_gpt_layer_spec, packed_core_attention
from megatron_vlm_packing.bridge.imports import import_bridge_module
from megatron_vlm_packing.bridge.samples import collate_qwen_vl
from megatron_vlm_packing.bridge.tiny import TinyModelConfig, language_fields

QWEN3_OMNI_PROVIDER = "megatron.bridge.models.qwen_omni.qwen3_omni_provider"
QWEN3_OMNI_THINKER = "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model"
AUDIO_DOWNSAMPLING = ("conv2d1", "conv2d2", "conv2d3", "conv_out")  # the encoder's layers before its positions
GRIDS = (2, 4)  # image / video h and w in patches (multiples of the 2x2 merge)


@dataclass(frozen=True, kw_only=True)
class TinyOmniConfig(TinyModelConfig):
    """A tiny Qwen3-Omni thinker: `bridge.tiny.TinyModelConfig` (language model, vision encoder,
    parallel layout) plus the audio encoder and the temporal scale.

    Attributes:
        audio_layers, audio_d_model, audio_heads, num_mel_bins: the audio encoder.
        audio_n_window, audio_n_window_infer: its windows, written into its config: n_window 50 (100 frames
            make 13 audio tokens; the only window transformers 5.12.1 and earlier count tokens for, whose default
            is 100, where 5.17 and later default to 50 and read it) and an inference window of 800 frames.
        audio_he_init: redraw the audio encoder's downsampling layers (`AUDIO_DOWNSAMPLING`) at He
            scale (`he_init_audio_downsampling`), so its output carries its clip. False keeps
            transformers' N(0, 0.02), under which the tiny thinker's losses hardly read its audio.
        position_id_per_seconds: temporal positions per second of video or audio.
        seconds_per_grid: seconds per video temporal grid step (fractional -> float t positions).
    Placeholder and wrapper ids are vocab_size - 1 .. vocab_size - 9.
    """

    audio_layers: int = 1
    audio_d_model: int = 32
    audio_heads: int = 2
    num_mel_bins: int = 16
    audio_n_window: int = 50
    audio_n_window_infer: int = 800
    audio_he_init: bool = True
    position_id_per_seconds: int = 25
    seconds_per_grid: float = 0.5

    @property
    def token_ids(self) -> dict[str, int]:
        top = self.vocab_size
        return dict(image_token_id=top - 1, video_token_id=top - 2, audio_token_id=top - 3,
                    vision_start_token_id=top - 4, vision_end_token_id=top - 5, audio_start_token_id=top - 6,
                    audio_end_token_id=top - 7, bos_token_id=top - 8, eos_token_id=top - 9)

    def mrope_config(self):
        """This model's `rope.MRopeConfig` (family "qwen3_omni", for `pack_batch(mrope=...)`)."""
        from megatron_vlm_packing.rope import MRopeConfig

        ids = self.token_ids
        return MRopeConfig(family="qwen3_omni", spatial_merge_size=self.spatial_merge_size,
                           image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
                           vision_start_token_id=ids["vision_start_token_id"], audio_token_id=ids["audio_token_id"],
                           audio_start_token_id=ids["audio_start_token_id"], mrope_section=self.mrope_section,
                           mrope_interleaved=True, position_id_per_seconds=self.position_id_per_seconds,
                           audio_n_window=self.audio_n_window)


def thinker_hf_config(cfg: TinyOmniConfig):
    """Hugging Face's `Qwen3OmniMoeThinkerConfig` holding the tiny vision and audio encoder configs."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    ids = cfg.token_ids
    vision = dict(depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=2 * cfg.vision_hidden,
                  num_heads=cfg.vision_heads, in_channels=3, patch_size=cfg.patch_size,
                  temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
                  out_hidden_size=cfg.hidden_size, num_position_embeddings=64,
                  deepstack_visual_indexes=list(cfg.deepstack_visual_indexes))
    audio = dict(num_mel_bins=cfg.num_mel_bins, encoder_layers=cfg.audio_layers,
                 encoder_attention_heads=cfg.audio_heads, encoder_ffn_dim=2 * cfg.audio_d_model,
                 d_model=cfg.audio_d_model, output_dim=cfg.hidden_size, downsample_hidden_size=8,
                 max_source_positions=64, n_window=cfg.audio_n_window, n_window_infer=cfg.audio_n_window_infer)
    thinker = Qwen3OmniMoeThinkerConfig(
        vision_config=vision, audio_config=audio, position_id_per_seconds=cfg.position_id_per_seconds,
        audio_token_id=ids["audio_token_id"], image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"], audio_start_token_id=ids["audio_start_token_id"])
    for sub in (thinker.vision_config, thinker.audio_config):
        sub._attn_implementation = "eager"  # per-chunk attention on any device, no kernels
    return thinker


def tiny_omni_provider(cfg: TinyOmniConfig):
    """Bridge's `Qwen3OmniModelProvider` for `cfg` (not yet built)."""
    module = import_bridge_module(QWEN3_OMNI_PROVIDER)
    return module.Qwen3OmniModelProvider(
        **language_fields(cfg), thinker_config=thinker_hf_config(cfg), language_max_sequence_length=1024,
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
        spatial_merge_size=cfg.spatial_merge_size, position_id_per_seconds=cfg.position_id_per_seconds,
        moe_permute_fusion=False, moe_grouped_gemm=False)


def omni_te_free_swaps(core_attention: type) -> list[tuple[str, dict]]:
    """(module, {name: replacement}) making the Omni provider build the local spec with `core_attention`.

    The provider picks TE's spec when TE imports; both spec functions are swapped so a TE machine
    builds the same TE-free model.
    """
    def gpt_spec(**kwargs):
        return local_gpt_layer_spec(core_attention=core_attention, num_experts=kwargs.get("num_experts"),
                                    qk_layernorm=kwargs.get("qk_layernorm", False))

    return [(QWEN3_OMNI_PROVIDER, {"get_gpt_layer_with_transformer_engine_spec": gpt_spec,
                                   "get_gpt_layer_local_spec": gpt_spec})]


def he_init_audio_downsampling(encoder: torch.nn.Module, seed: int) -> None:
    """Redraw the weights of the audio encoder's `AUDIO_DOWNSAMPLING` layers from N(0, 2 / fan_in), from a
    generator of its own seeded by `seed` (the same weights on every rank and stage, the rest of the model's
    draw untouched).

    Why: transformers draws every encoder weight from N(0, initializer_range = 0.02) whatever its fan-in.
    Through the real encoder's downsampling fan-ins (9, 4320, 4320, 7680), each behind a GELU that halves
    small values, a clip of std 1 leaves at std 2e-2; through the tiny one's (9, 72, 72, 16) at 1.5e-5,
    before it is added to sinusoidal positions of std 0.6. Measured on `TinyOmniConfig()`: 1.7e-5 of the
    encoder's output (row norm) changed with its clip zeroed, and every clip zeroed moved the thinker's
    per-token losses by 4.3e-6, so a pack handing a sample another sample's clip passed any loss check.
    At He scale 63% of the output is the clip's, and the same zeroing moves the losses by 0.28.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in AUDIO_DOWNSAMPLING:
            weight = encoder.get_submodule(name).weight  # conv [out, in, kh, kw] / linear [out, in]
            fan_in = weight[0].numel()
            drawn = torch.randn(weight.shape, generator=generator, dtype=torch.float32) * (2.0 / fan_in) ** 0.5
            weight.copy_(drawn)


def build_tiny_omni(cfg: TinyOmniConfig, seed: int = 0):
    """Bridge's `Qwen3OmniModel` for `cfg`. With the same seed the weights at any TP are the shards of
    the TP=1 weights (CPU initialization); the vision and audio encoders are replicated (the audio
    encoder's downsampling layers redrawn by `he_init_audio_downsampling` when `cfg.audio_he_init`)."""
    provider = tiny_omni_provider(cfg)
    model = build_with_provider(provider, swaps=omni_te_free_swaps(packed_core_attention(cfg.attention_backend)),
                                seed=seed)
    audio = model.thinker.audio_model
    if cfg.audio_he_init and audio is not None:  # None on later pipeline stages
        he_init_audio_downsampling(audio, seed)
    return model


def _block(open_id: int, close_id: int, token: int, count: int) -> torch.Tensor:
    return torch.tensor([open_id] + [token] * count + [close_id])


def _vision_item(rng, cfg: TinyOmniConfig, *, video: bool) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(token block, grid [t, h, w], patches [t*h*w, F]) of one image or video."""
    h, w = (GRIDS[int(i)] for i in torch.randint(0, len(GRIDS), (2,), generator=rng))
    t = 2 if video else 1
    ids = cfg.token_ids
    token = ids["video_token_id" if video else "image_token_id"]
    block = _block(ids["vision_start_token_id"], ids["vision_end_token_id"], token,
                   t * h * w // cfg.spatial_merge_size ** 2)
    return block, [t, h, w], torch.randn(t * h * w, cfg.patch_features, generator=rng)


def _audio_item(rng, cfg: TinyOmniConfig) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(token block, frames, features [F, frames]) of one audio clip (16 to 130 frames)."""
    from megatron_vlm_packing.rope.omni import audio_output_length

    frames = int(torch.randint(16, 131, (1,), generator=rng))
    ids = cfg.token_ids
    count = int(audio_output_length(torch.tensor(frames), 50))
    block = _block(ids["audio_start_token_id"], ids["audio_end_token_id"], ids["audio_token_id"], count)
    return block, frames, torch.randn(cfg.num_mel_bins, frames, generator=rng)


def omni_sample(rng: torch.Generator, cfg: TinyOmniConfig, *, images: int, videos: int, audios: int,
                text: int) -> dict:
    """One sample: `text` text tokens with images, videos and audio clips at random cuts.

    Returns a dict with input_ids [S], labels [S] (HF style, -100 on media blocks), image_grid_thw
    [I, 3], pixel_values [P, F], video_grid_thw [V, 3], pixel_values_videos [Pv, F],
    second_per_grid_ts [V], audio_features (list of [mel, frames]), audio_frames (list of ints).
    """
    text_ids = torch.randint(1, cfg.vocab_size - 10, (text,), generator=rng)
    kinds = ["image"] * images + ["video"] * videos + ["audio"] * audios
    kinds = [kinds[i] for i in torch.randperm(len(kinds), generator=rng).tolist()]
    cuts = sorted(torch.randint(0, text + 1, (len(kinds),), generator=rng).tolist())
    pieces, labels, prev = [], [], 0
    out = {"image_grid_thw": [], "pixel_values": [], "video_grid_thw": [], "pixel_values_videos": [],
           "audio_features": [], "audio_frames": []}
    for cut, kind in zip(cuts, kinds):
        pieces.append(text_ids[prev:cut])
        labels.append(text_ids[prev:cut])
        prev = cut
        if kind == "audio":
            block, frames, features = _audio_item(rng, cfg)
            out["audio_frames"].append(frames)
            out["audio_features"].append(features)
        else:
            block, grid, patches = _vision_item(rng, cfg, video=kind == "video")
            out[f"{kind}_grid_thw"].append(grid)
            out["pixel_values_videos" if kind == "video" else "pixel_values"].append(patches)
        pieces.append(block)
        labels.append(torch.full_like(block, -100))
    pieces.append(text_ids[prev:])
    labels.append(text_ids[prev:])
    sample = {"input_ids": torch.cat(pieces), "labels": torch.cat(labels),
              "audio_features": out["audio_features"], "audio_frames": out["audio_frames"]}
    for kind, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        sample[f"{kind}_grid_thw"] = torch.tensor(out[f"{kind}_grid_thw"], dtype=torch.long).reshape(-1, 3)
        sample[pixels] = torch.cat(out[pixels]) if out[pixels] else torch.zeros(0, cfg.patch_features)
    sample["second_per_grid_ts"] = torch.full((len(out["video_grid_thw"]),), cfg.seconds_per_grid)
    return sample


def omni_samples(cfg: TinyOmniConfig, num: int, *, seed: int, max_text: int = 20, max_images: int = 1,
                 max_videos: int = 1, max_audios: int = 1) -> list[dict]:
    """`num` samples, identical for the same seed. The first four are fixed whatever the draw
    (0: an image and an audio clip, 1: a video, 2: text only, 3: an image, a video and a clip)."""
    rng = torch.Generator().manual_seed(seed)
    forced = [dict(images=1, videos=0, audios=1), dict(images=0, videos=1, audios=0),
              dict(images=0, videos=0, audios=0), dict(images=1, videos=1, audios=1)]
    samples = []
    for i in range(num):
        counts = forced[i] if i < len(forced) else dict(
            images=int(torch.randint(0, max_images + 1, (1,), generator=rng)),
            videos=int(torch.randint(0, max_videos + 1, (1,), generator=rng)),
            audios=int(torch.randint(0, max_audios + 1, (1,), generator=rng)))
        text = int(torch.randint(3, max_text + 1, (1,), generator=rng))
        samples.append(omni_sample(rng, cfg, **counts, text=text))
    return samples


def collate_omni(samples: list[dict], *, pad_token_id: int = 0) -> dict:
    """Right-pad samples into one HF-style batch (Qwen3-Omni processor keys).

    Media are concatenated in sample order; audio features are padded to the longest clip:
    input_features [A, F, L], feature_attention_mask [A, L] long, audio_seqlens [A] (real frames,
    for the rope index). Keys of a kind no sample has are left out, as a processor would.
    """
    batch = collate_qwen_vl(samples, pad_token_id=pad_token_id)  # text, images, videos (+ seconds per grid)
    clips = [f for s in samples for f in s["audio_features"]]
    if clips:
        frames = torch.tensor([f.shape[1] for f in clips])
        features = torch.zeros(len(clips), clips[0].shape[0], int(frames.max()))
        for i, f in enumerate(clips):
            features[i, :, :f.shape[1]] = f
        batch["input_features"] = features
        batch["feature_attention_mask"] = (torch.arange(features.shape[2])[None] < frames[:, None]).long()
        batch["audio_seqlens"] = frames
    return batch
