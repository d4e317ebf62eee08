"""A one-process check that a tiny Bridge model of each family builds and packs exactly.

`build_and_pack_smoke(rank, world_size, families)` is a `testing.run_distributed` target: it builds
each family with `build_tiny_bridge_model`, runs three samples (text, images, videos) packed in one
THD sequence through the model as Bridge built it, and each sample alone as a dense row (positions
from Bridge's own `get_rope_index`), and reports the loss sums.
"""

from __future__ import annotations

import sys

import torch

from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, build_tiny_bridge_model
from megatron_vlm_packing.packing.media import VISION_KEYS


def call_bridge_vlm(model, family: str, batch: dict, *, input_ids, position_ids, labels, packed_seq_params=None):
    """Bridge's forward with the batch's vision inputs, by keyword (per-token loss [1, T] back)."""
    vision = {k: batch[k] for k in VISION_KEYS if k in batch}
    if family != "qwen25_vl":
        vision.pop("second_per_grid_ts", None)  # Qwen3-VL's forward has no such parameter
    out = model(input_ids=input_ids, position_ids=position_ids, labels=labels,
                packed_seq_params=packed_seq_params, **vision)
    return out[0] if isinstance(out, tuple) else out


def alone_losses(model, family: str, sample: dict) -> torch.Tensor:
    """[targets] next-token losses of one sample run alone, dense, unpadded (Bridge's own positions)."""
    batch = collate_qwen_vl([sample])
    targets = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)
    losses = call_bridge_vlm(model, family, batch, input_ids=batch["input_ids"], position_ids=None,
                             labels=targets.clamp_min(0))
    return losses[targets != -100]


def alone_loss_sum(model, family: str, sample: dict) -> torch.Tensor:
    """Sum of next-token losses of one sample run alone, dense, unpadded."""
    return alone_losses(model, family, sample).sum()


def _family_smoke(family: str) -> dict:
    from megatron_vlm_packing import pack_batch

    cfg = TinyBridgeConfig(family=family)
    model = build_tiny_bridge_model(cfg, seed=0)
    samples = qwen_vl_samples(cfg, 3, seed=1)
    batch = collate_qwen_vl(samples)
    packed = pack_batch(batch, label_style="hf", mrope=cfg.mrope_config())
    losses = call_bridge_vlm(model, family, batch, input_ids=packed.input_ids, position_ids=packed.position_ids,
                             labels=packed.labels.clamp_min(0), packed_seq_params=packed.packed_seq_params)
    packed_sum = (losses * packed.loss_mask).sum()
    alone_sum = sum(alone_loss_sum(model, family, s) for s in samples)
    inner = model.visual if family == "qwen25_vl" else model.vision_model
    return {
        "model_class": type(model).__name__, "model_module": type(model).__module__,
        "vision_params": sum(p.numel() for p in inner.parameters()),
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "images": len(batch.get("image_grid_thw", [])), "videos": len(batch.get("video_grid_thw", [])),
        "loss": float(alone_sum), "abs_dloss": float((packed_sum - alone_sum).abs()),
        "transformer_engine_imported": "transformer_engine" in sys.modules,
        "bridge_package_imported": "megatron.bridge" in sys.modules,
    }


def build_and_pack_smoke(rank: int, world_size: int, families) -> dict:
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    initialize_parallel()
    return {family: _family_smoke(family) for family in families}
