"""Megatron-Bridge's data side and its two Qwen3-VL steps, for `bridge_step_vs_bridge.py`.

- samples: Hugging-Face-style Qwen3-VL samples (lognormal text, images, videos);
- collates: Bridge's unpacked collate (packing deferred to `qwen3_vl_step`) and its collate-time
  in-batch packing (for `vlm_step`), built on Bridge's own `pad_or_truncate_sequence_batch` and
  `build_mcore_thd_sequence_batch_from_rows`;
- steps: the argument plumbing of `qwen3_vl_step` (in-batch packing) and `vlm_step`, rewritten from
  `models/qwen_vl/qwen3_vl_step.py:155-210, 290-353` and `training/vlm_step.py:278-321` (both modules
  import `megatron.bridge.training.config`, which needs Hugging Face `datasets`), then Bridge's model
  and Bridge's loss `create_masked_next_token_loss_function`; the per-sample rows follow
  `models/qwen_vl/data/collate_fn.py:153-232, 318-347` (labels and loss mask shifted per sample).
"""

from __future__ import annotations

import math

import torch

SEQ_LENGTH_CAP = 16384  # Bridge's dataset seq_length (the collate's cap); no sample here reaches it
QWEN3_VL_STEP = "megatron.bridge.models.qwen_vl.qwen3_vl_step"


# --- samples -------------------------------------------------------------------------------------

def _media(rng, cfg, grids, *, video: bool):
    """(token blocks, [t, h, w], patches [t*h*w, F]): Qwen3-VL layout, one block per video frame."""
    h, w = (grids[int(i)] for i in torch.randint(0, len(grids), (2,), generator=rng))
    t, ids = (2 if video else 1), cfg.token_ids
    token = ids["video_token_id" if video else "image_token_id"]
    block = torch.tensor([ids["vision_start_token_id"]] + [token] * (h * w // 4) + [ids["vision_end_token_id"]])
    return [block] * t, [t, h, w], torch.randn(t * h * w, cfg.patch_features, generator=rng)


def lognormal_sample(rng, cfg, *, text: int, images: int, videos: int, grids, video_grids) -> dict:
    """One Hugging-Face-style sample (unshifted labels, -100 on vision tokens) with media at random cuts."""
    text_ids = torch.randint(1, cfg.vocab_size - 8, (text,), generator=rng)
    kinds = [False] * images + [True] * videos
    cuts = sorted(torch.randint(0, text + 1, (len(kinds),), generator=rng).tolist())
    ids, labels, prev = [], [], 0
    media = {"image_grid_thw": [], "pixel_values": [], "video_grid_thw": [], "pixel_values_videos": []}
    for cut, video in zip(cuts, kinds):
        ids.append(text_ids[prev:cut])
        labels.append(text_ids[prev:cut])
        prev = cut
        blocks, grid, patches = _media(rng, cfg, video_grids if video else grids, video=video)
        ids += blocks
        labels += [torch.full_like(b, -100) for b in blocks]
        media["video_grid_thw" if video else "image_grid_thw"].append(grid)
        media["pixel_values_videos" if video else "pixel_values"].append(patches)
    sample = {"input_ids": torch.cat(ids + [text_ids[prev:]]), "labels": torch.cat(labels + [text_ids[prev:]])}
    for grid, pixels in (("image_grid_thw", "pixel_values"), ("video_grid_thw", "pixel_values_videos")):
        sample[grid] = torch.tensor(media[grid], dtype=torch.long).reshape(-1, 3)
        sample[pixels] = torch.cat(media[pixels]) if media[pixels] else torch.zeros(0, cfg.patch_features)
    return sample


def lognormal_batches(cfg, preset: dict, seed: int) -> list[list[dict]]:
    """`batches` micro-batches of `batch` samples: text ~ lognormal(median, sigma 0.8), 0-2 images, 0-1 video."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(preset["batches"]):
        samples = []
        for _ in range(preset["batch"]):
            text = math.exp(math.log(preset["median_text"]) + 0.8 * float(torch.randn(1, generator=rng)))
            samples.append(lognormal_sample(
                rng, cfg, text=int(min(max(text, 4), preset["max_text"])),
                images=int(torch.randint(0, 3, (1,), generator=rng)),
                videos=int(torch.rand(1, generator=rng) < 0.3), grids=preset["grids"],
                video_grids=preset["video_grids"]))
        out.append(samples)
    return out


# --- Bridge's data side (collate) ----------------------------------------------------------------

def bridge_rows(samples: list[dict]) -> list[dict]:
    """Per-sample rows as Bridge's Qwen collate writes them: labels and loss mask shifted per sample."""
    rows = []
    for s in samples:
        ids = s["input_ids"]
        supervised = (s["labels"] != -100).float()
        loss_mask = torch.cat([supervised[1:], supervised.new_zeros(1)])
        labels = torch.cat([ids[1:], ids.new_full((1,), -100)]).masked_fill(loss_mask == 0, -100)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                     "loss_mask": loss_mask, "position_ids": torch.arange(ids.numel())})
    return rows


def bridge_visual_inputs(samples: list[dict]):
    """Bridge's `GenericVisualInputs` with the batch's images and videos (sample order)."""
    from megatron_vlm_packing.bridge.imports import import_bridge_module

    visual = import_bridge_module("megatron.bridge.training.utils.visual_inputs").GenericVisualInputs
    fields = {}
    for grid, pixels in (("image_grid_thw", "pixel_values"), ("video_grid_thw", "pixel_values_videos")):
        grids = torch.cat([s[grid] for s in samples])
        if len(grids):
            fields[grid], fields[pixels] = grids, torch.cat([s[pixels] for s in samples])
    return visual(**fields)


def collate_for_qwen3_vl_step(samples: list[dict], pad_multiple: int = 128) -> dict:
    """Bridge's unpacked collate (packing deferred to the step): rows right-padded, then Bridge's
    `pad_or_truncate_sequence_batch` to the batch max rounded up to `pad_multiple`."""
    from megatron_vlm_packing.bridge.imports import import_bridge_module

    padding = import_bridge_module("megatron.bridge.data.collators.sequence_padding")
    rows, longest = bridge_rows(samples), max(len(s["input_ids"]) for s in samples)
    batch = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100), ("loss_mask", 0)):
        rows_t = [torch.nn.functional.pad(r[key], (0, longest - len(r[key])), value=fill) for r in rows]
        batch[key] = torch.stack(rows_t)
    batch["position_ids"] = torch.arange(longest).expand(len(rows), -1).clone()
    padding.pad_or_truncate_sequence_batch(batch, sequence_length=SEQ_LENGTH_CAP, pad_to_multiple_of=pad_multiple)
    batch["visual_inputs"] = bridge_visual_inputs(samples)
    return batch


def collate_for_vlm_step(samples: list[dict]) -> dict:
    """Bridge's Qwen collate with `enable_in_batch_packing=True`: Bridge's own THD packer at real lengths."""
    from megatron_vlm_packing.bridge.imports import import_bridge_module

    in_batch = import_bridge_module("megatron.bridge.data.packing.in_batch")
    packed = in_batch.build_mcore_thd_sequence_batch_from_rows(bridge_rows(samples), sequence_length=SEQ_LENGTH_CAP,
                                                               pad_token_id=0, ignore_index=-100, pad_to_multiple_of=1)
    packed["visual_inputs"] = bridge_visual_inputs(samples)
    return packed


# --- Bridge's two steps (argument plumbing rewritten; see the module docstring) -----------------

def _bridge(name: str):
    from megatron_vlm_packing.bridge.imports import import_bridge_module

    return import_bridge_module(name)


def _to(device, value):
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def _visual_kwargs(batch: dict, device, dtype) -> dict:
    kwargs = batch["visual_inputs"].normalized_for_model()
    return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in kwargs.items()}


def qwen3_vl_step_args(batch: dict, tp_size: int = 1):
    """`_pad_and_pack_qwen3_vl_step(use_fp8_padding=True)` + the in-batch-packing forward arguments:
    rows padded to a multiple of lcm(tp, 16), boundaries [0, S, 2S, ...], attention mask all ones."""
    from megatron.core.packed_seq_params import PackedSeqParams

    pad = _bridge("megatron.bridge.training.utils.padding_utils")
    tokens = batch["input_ids"]
    rows, length = tokens.shape
    target = math.ceil(length / math.lcm(tp_size, 16)) * math.lcm(tp_size, 16)
    tokens = pad.pad_or_truncate_2d_to_len(tokens, target_len=target, max_cap=target, pad_value=0)
    labels = pad.pad_or_truncate_2d_to_len(batch["labels"], target_len=target, max_cap=target, pad_value=-100)
    loss_mask = pad.pad_or_truncate_2d_to_len(batch["loss_mask"], target_len=target, max_cap=target, pad_value=0)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=tokens.device) * target
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=target, max_seqlen_kv=target)
    args = dict(input_ids=tokens, labels=labels.reshape(1, -1), loss_mask=loss_mask.reshape(1, -1),
                attention_mask=torch.ones(rows, target, dtype=torch.bool, device=tokens.device), position_ids=None,
                packed_seq_params=params)
    return args


def qwen3_vl_step(model, batch: dict, device, dtype) -> torch.Tensor:
    """Forward of Bridge's `qwen3_vl_step` (in-batch packing) + its loss; returns the loss sum."""
    batch = {k: _to(device, v) for k, v in batch.items()}
    args = qwen3_vl_step_args(batch, int(model.config.tensor_model_parallel_size))
    return _bridge_loss(model, args, batch, device, dtype)


def vlm_step(model, batch: dict, device, dtype) -> torch.Tensor:
    """Forward of Bridge's `vlm_step` on a collate-packed batch + its loss; returns the loss sum."""
    utils = _bridge("megatron.bridge.training.utils.packed_seq_utils")
    batch = {k: _to(device, v) for k, v in batch.items()}
    meta = {k: batch[k] for k in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                                  "max_seqlen_q", "max_seqlen_kv") if batch.get(k) is not None}
    args = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                labels=batch["labels"], loss_mask=batch["loss_mask"].contiguous(),
                packed_seq_params=utils.get_packed_seq_params(meta))
    return _bridge_loss(model, args, batch, device, dtype)


def _bridge_loss(model, args: dict, batch: dict, device, dtype) -> torch.Tensor:
    losses = _bridge("megatron.bridge.training.losses")
    output = model(**args, **_visual_kwargs(batch, device, dtype))
    loss_mask = args["loss_mask"]
    if isinstance(output, tuple):
        output, loss_mask = output
    loss_sum, _, _ = losses.create_masked_next_token_loss_function(loss_mask, False, False)(output)
    return loss_sum


def real_qwen3_vl_step_module():
    """Bridge's `qwen3_vl_step` module through its real package chain, or the reason it cannot load.

    Its `training/config.py` needs Hugging Face `datasets`, megatron-energon and names that Bridge's
    package `__init__` files define (so the bare-package import cannot serve it), and the chain needs
    Transformer Engine: it is only tried where TE is installed.
    """
    import importlib
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return None, "megatron.bridge's package chain needs Transformer Engine (not installed)"
    try:
        return importlib.import_module(QWEN3_VL_STEP), None
    except ImportError as err:
        return None, f"{type(err).__name__}: {err}"


def check_against_real_qwen3_vl_step(batch: dict) -> str:
    """'equal' / 'not importable here (...)': ours vs Bridge's `_pad_and_pack_qwen3_vl_step` on `batch`."""
    from types import SimpleNamespace

    module, reason = real_qwen3_vl_step_module()
    if module is None:
        return f"not importable here ({reason})"
    real = module._pad_and_pack_qwen3_vl_step
    one = SimpleNamespace(size=lambda: 1)
    tokens, labels, loss_mask, _, _, params = real(batch["input_ids"], batch["labels"], batch["loss_mask"],
                                                  batch["attention_mask"], batch["position_ids"],
                                                  SimpleNamespace(tp=one, cp=one), use_fp8_padding=True)
    ours = qwen3_vl_step_args(batch)
    same = (torch.equal(tokens, ours["input_ids"]) and torch.equal(labels.reshape(1, -1), ours["labels"])
            and torch.equal(loss_mask.reshape(1, -1), ours["loss_mask"])
            and torch.equal(params.cu_seqlens_q, ours["packed_seq_params"].cu_seqlens_q))
    if not same:
        raise AssertionError("our rewrite of _pad_and_pack_qwen3_vl_step differs from Bridge's")
    return "equal"
