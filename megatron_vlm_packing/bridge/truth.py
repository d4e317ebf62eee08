"""Each Bridge family's truth for parity: Bridge's own dense path on one sample at a time.

One interface over the families ("qwen3_vl", "qwen3_vl_moe", "qwen25_vl", "qwen3_omni"), so a
parity run is written once:
- `build_family(family, cfg, seed)`: Bridge's model built by its provider (`bridge.tiny`,
  `bridge.build_omni`) for this rank's pipeline stage;
- `family_samples` / `collate_for`: deterministic samples and their HF-style collation;
- `alone_losses(model, family, sample)`: [targets] per-token losses of one sample alone, dense,
  unpadded, batch 1, on Bridge's unpatched code (Qwen-VL: Bridge's own mRoPE positions; Qwen3-Omni:
  positions from `rope.get_rope_index`, identical to transformers');
- `TOWERS`: the parameter-name prefixes of each family's vision / audio towers.

Bridge 0.6.2's dense Qwen3-Omni audio path cuts the encoder's output by
`audio_model._get_feat_extract_output_lengths`, which transformers 5.24's encoder lacks and 5.12.1's counts
by another model's rule (`bridge.omni_dense_audio`): `dense_audio_shim` gives that one instance the method
counting what the encoder makes, so the truth stays Bridge's dense code.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.bridge.omni_dense_audio import dense_audio_shim

TOWERS = {"qwen3_vl": ("vision_model.",), "qwen3_vl_moe": ("vision_model.",), "qwen25_vl": ("visual.",),
          "qwen3_omni": ("thinker.visual.", "thinker.audio_model.")}
OMNI_MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "input_features",
                   "feature_attention_mask")


def build_family(family: str, cfg, seed: int):
    """Bridge's model of `family` for `cfg` (this rank's pipeline stage); Omni gets `dense_audio_shim`."""
    if family == "qwen3_omni":
        from megatron_vlm_packing.bridge.build_omni import build_tiny_omni

        model = build_tiny_omni(cfg, seed=seed)
        if model.thinker.audio_model is not None:
            dense_audio_shim(model.thinker.audio_model)
        return model
    from megatron_vlm_packing.bridge.tiny import build_tiny_bridge_model

    return build_tiny_bridge_model(cfg, seed=seed)


def family_samples(family: str, cfg, num: int, *, seed: int) -> list[dict]:
    """`num` deterministic samples of the family's layout (images, videos; Omni also audio clips)."""
    if family == "qwen3_omni":
        from megatron_vlm_packing.bridge.build_omni import omni_samples

        return omni_samples(cfg, num, seed=seed)
    from megatron_vlm_packing.bridge.samples import qwen_vl_samples

    return qwen_vl_samples(cfg, num, seed=seed)


def collate_for(family: str, samples: list[dict]) -> dict:
    """The family's HF-style collated batch of `samples`."""
    if family == "qwen3_omni":
        from megatron_vlm_packing.bridge.build_omni import collate_omni

        return collate_omni(samples)
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl

    return collate_qwen_vl(samples)


def alone_losses(model, family: str, sample: dict, cfg=None) -> torch.Tensor:
    """[targets] next-token losses of `sample` alone on Bridge's dense path (cfg: Omni's, for positions)."""
    if family != "qwen3_omni":
        from megatron_vlm_packing.bridge.smoke import alone_losses as qwen_vl_alone_losses

        return qwen_vl_alone_losses(model, family, sample)
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig
    from megatron_vlm_packing.packing import shift_labels_within_rows

    batch = collate_for(family, [sample])
    labels = shift_labels_within_rows(batch["labels"], batch["attention_mask"].bool())
    out = model(input_ids=batch["input_ids"], position_ids=omni_positions(batch, cfg or TinyOmniConfig()),
                labels=labels, loss_mask=(labels != -100).float(), **omni_media(batch))
    return out[labels != -100]


def omni_positions(batch: dict, cfg) -> torch.Tensor:
    """[3, B, S] float positions of each row alone (transformers' rule)."""
    from megatron_vlm_packing.rope import get_rope_index

    return get_rope_index(batch["input_ids"], cfg.mrope_config(), attention_mask=batch["attention_mask"],
                          image_grid_thw=batch.get("image_grid_thw"), video_grid_thw=batch.get("video_grid_thw"),
                          second_per_grid_ts=batch.get("second_per_grid_ts"),
                          audio_seqlens=batch.get("audio_seqlens")).position_ids


def omni_media(batch: dict) -> dict:
    """The thinker's media keywords of a collated Omni batch (Bridge's names)."""
    out = {k: batch[k] for k in OMNI_MEDIA_KEYS if k in batch}
    if "second_per_grid_ts" in batch:
        out["video_second_per_grid"] = batch["second_per_grid_ts"]
    return out
