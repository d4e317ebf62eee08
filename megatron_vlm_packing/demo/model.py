"""The demo's own tiny VLM and data: a 2-layer Megatron-Core GPTModel with the tiny vision tower
(images and videos) and the tiny audio tower, trained on the embedded synthetic data set with
images, videos and audio clips (`demo/synthetic.py`)."""

from __future__ import annotations

import torch

from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig
from megatron_vlm_packing.models.audio import TinyAudioTower
from megatron_vlm_packing.models.packed_vlm import PackedVLM
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.models.vision import TinyVisionTower

DEMO_DATA = SyntheticVLMConfig(max_videos=1, max_audios=1)


def build_demo_model(*, tp: int, cp: int, sp: bool, seed: int, device: str,
                     data: SyntheticVLMConfig = DEMO_DATA) -> PackedVLM:
    """The demo VLM on the current parallel state; the same `seed` gives every rank the same model's shards."""
    # The exact reference attention on every device: the demo model is float32 (flash-style varlen
    # kernels want bf16/fp16) and tiny, and the point is the packed-vs-unpacked parity.
    cfg = TinyGPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=128, vocab_size=data.vocab_size, max_sequence_length=2048,
                        backend="reference", tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    torch.manual_seed(seed)  # identical weights on every rank (shards of the same model)
    lm = build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False)
    vision = TinyVisionTower(patch_features=data.patch_features, width=32, out_hidden=cfg.hidden_size)
    audio = TinyAudioTower(mel_bins=data.mel_bins, width=32, out_hidden=cfg.hidden_size, n_window=data.audio_n_window)
    return PackedVLM(lm, vision, image_token_id=data.image_token_id, video_token_id=data.video_token_id,
                     audio=audio, audio_token_id=data.audio_token_id).to(device)
