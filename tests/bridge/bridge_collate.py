"""Megatron-Bridge 0.6.2's Qwen-VL collate output for the tiny samples, built as its collate function builds it.

`qwen2_5_collate_fn` (`megatron.bridge.models.qwen_vl.data.collate_fn`, Qwen2.5-VL and Qwen3-VL) runs the Hugging
Face processor (tokenizer files we do not have offline) and then works on its output. The processor's output is
stood in for by `collate_qwen_vl` (right-padded ids, attention mask, flat patch rows, grids, Qwen2.5-VL's
seconds per grid step) plus the `mm_token_type_ids` transformers 5.x's Qwen processors add
(`return_mm_token_type_ids = True`: 1 at image, 2 at video placeholders); from there every line follows the
collate function: arange `position_ids`, the assistant loss mask (here: the samples' trained tokens) and labels
both shifted one left (the last slot -100), labels -100 where the shifted mask is 0, the vision tensors moved
into Bridge's own `GenericVisualInputs`, and Bridge's own `prepare_sequence_batch` (rows padded to a multiple of
`pad_to_multiple_of`, or Bridge's in-batch THD packing). Needs megatron-bridge.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.bridge.imports import import_bridge_module

IGNORE_INDEX = -100
QWEN_VISUAL_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")


def generic_visual_inputs(**fields):
    """Bridge's own `GenericVisualInputs(**fields)`."""
    module = import_bridge_module("megatron.bridge.training.utils.visual_inputs")
    return module.GenericVisualInputs(**fields)


def processor_output(samples: list[dict], cfg, *, pad_token_id: int = 0) -> dict:
    """What the Qwen processor returns for `samples` (right padding), and each row's trained tokens (HF labels)."""
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl

    batch = collate_qwen_vl(samples, pad_token_id=pad_token_id)
    ids = batch["input_ids"]
    batch["mm_token_type_ids"] = (torch.where(ids == cfg.token_ids["image_token_id"], 1, 0)
                                  + torch.where(ids == cfg.token_ids["video_token_id"], 2, 0))
    return batch


def bridge_collate(samples: list[dict], cfg, *, sequence_length: int | None = 4096, pad_to_multiple_of: int = 128,
                   enable_in_batch_packing: bool = False, in_batch_packing_pad_to_multiple_of: int = 1) -> dict:
    """The batch `qwen2_5_collate_fn(..., sequence_length, pad_to_multiple_of, enable_in_batch_packing,
    in_batch_packing_pad_to_multiple_of)` returns for `samples` (its dense path's processor call; with in-batch
    packing, `prepare_sequence_batch` packs those rows with Bridge's `build_mcore_thd_sequence_batch_from_rows`, as
    the collate function's own in-batch path packs the rows of one processor call per sample)."""
    batch = processor_output(samples, cfg)
    trained = batch.pop("labels") != IGNORE_INDEX  # build_assistant_loss_mask: the assistant's tokens
    ids = batch["input_ids"]
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1).clone()
    loss_mask = trained.to(torch.float32)
    labels = torch.cat([ids.clone()[:, 1:], IGNORE_INDEX * torch.ones_like(ids[:, :1])], dim=1)
    loss_mask = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)
    batch["labels"] = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
    batch["loss_mask"] = loss_mask
    visual_inputs = generic_visual_inputs(**{key: batch.get(key) for key in QWEN_VISUAL_KEYS})
    for key in QWEN_VISUAL_KEYS:
        batch.pop(key, None)
    batch["visual_inputs"] = visual_inputs
    prepare = import_bridge_module("megatron.bridge.data.collators.sequence").prepare_sequence_batch
    prepare(batch, sequence_length=sequence_length, pad_to_multiple_of=pad_to_multiple_of,
            enable_in_batch_packing=enable_in_batch_packing,
            in_batch_packing_pad_to_multiple_of=in_batch_packing_pad_to_multiple_of, ignore_index=IGNORE_INDEX,
            sequence_tensor_pad_values={"mm_token_type_ids": 0})
    return batch
