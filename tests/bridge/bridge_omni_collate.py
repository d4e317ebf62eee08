"""Megatron-Bridge 0.6.2's Qwen3-Omni collate output for the tiny Omni samples: its own `qwen3_omni_collate_fn` run.

`qwen3_omni_collate_fn` (`megatron.bridge.models.qwen_omni.data.collate_fn`) calls the Hugging Face processor's
`apply_chat_template` (tokenizer files we do not have offline) and builds each row's assistant mask from the
tokenizer's chat markers; everything else is its own code, run here as it is: `audio_feature_lengths` from the
processor's `feature_attention_mask`, labels and loss mask shifted one left (the last slot -100), arange
`position_ids`, and `prepare_sequence_batch` (rows padded to a multiple of `pad_to_multiple_of`). Stood in for:
- the processor (`OmniProcessorStandIn`): `apply_chat_template` returns, for the examples' samples, the keys the
  Qwen3-Omni processor returns (transformers' `Qwen3OmniMoeProcessor`: `video_second_per_grid` = temporal patch
  size / fps per video, the feature extractor's int32 `feature_attention_mask`, no `audio_feature_lengths`), the
  rows right-padded with id 0 (`bridge.build_omni.collate_omni`'s layout, its keys renamed);
- the two marker readers the collate module imports (`assistant_mask_boundary_config_from_markers`,
  `build_assistant_loss_mask`), swapped in that module for the run only: each row's mask is its sample's trained
  tokens (its Hugging Face labels), unshifted, as Bridge's is.
Needs megatron-bridge.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from megatron_vlm_packing.bridge.imports import import_bridge_module

OMNI_COLLATE = "megatron.bridge.models.qwen_omni.data.collate_fn"
IGNORE_INDEX = -100


def processor_output(samples: list[dict]) -> dict:
    """What the Qwen3-Omni processor returns for `samples` (right padding, id 0), without labels."""
    from megatron_vlm_packing.bridge.build_omni import collate_omni

    batch = collate_omni(samples)
    batch.pop("labels")
    batch.pop("audio_seqlens", None)  # the processor has no per-clip length key: Bridge's collate adds its own
    if "second_per_grid_ts" in batch:
        batch["video_second_per_grid"] = batch.pop("second_per_grid_ts")
    if "feature_attention_mask" in batch:
        batch["feature_attention_mask"] = batch["feature_attention_mask"].to(torch.int32)  # Whisper's extractor
    return batch


class OmniProcessorStandIn:
    """The processor as `qwen3_omni_collate_fn` uses it: a tokenizer (right padding, pad id 0, no added pad
    tokens) and `apply_chat_template` over the examples' conversations (here each one sample)."""

    def __init__(self):
        self.tokenizer = SimpleNamespace(padding_side="left", pad_token_id=0, added_tokens_decoder={})

    def apply_chat_template(self, conversations, **kwargs):
        assert self.tokenizer.padding_side == "right", "Bridge asks for right padding"
        return processor_output(list(conversations))


def _trained_tokens(example, row, processor, skipped_tokens, *, boundary_config=None) -> torch.Tensor:
    """The sample's unshifted assistant mask over its padded row (1 at the tokens its HF labels train)."""
    labels = example["conversation"]["labels"]
    mask = torch.zeros(len(row), dtype=torch.float32)
    mask[:len(labels)] = (labels != IGNORE_INDEX).float()
    return mask


@contextmanager
def _marker_readers_stood_in():
    module = import_bridge_module(OMNI_COLLATE)
    saved = module.assistant_mask_boundary_config_from_markers, module.build_assistant_loss_mask
    module.assistant_mask_boundary_config_from_markers = lambda processor, **kwargs: None
    module.build_assistant_loss_mask = _trained_tokens
    try:
        yield module
    finally:
        module.assistant_mask_boundary_config_from_markers, module.build_assistant_loss_mask = saved


def bridge_omni_collate(samples: list[dict], *, sequence_length: int | None = 4096,
                        pad_to_multiple_of: int = 128) -> dict:
    """The batch Bridge's `qwen3_omni_collate_fn(examples, processor, sequence_length=..., pad_to_multiple_of=...)`
    returns for `samples` (its own code, the processor and marker readers stood in)."""
    with _marker_readers_stood_in() as module:
        return module.qwen3_omni_collate_fn([{"conversation": sample} for sample in samples], OmniProcessorStandIn(),
                                            sequence_length=sequence_length, pad_to_multiple_of=pad_to_multiple_of)
