"""The keys a saved batch (`torch.save` of a dict, read by `megatron-vlm-packing check FILE`) may hold, and what
each means. Plain strings, imported by nothing heavy: `check --help` prints them without importing torch or
Megatron-Core (`validate/__init__` resolves its names lazily, `lazy.lazy_exports`)."""

# Keys a saved batch (`torch.save` of a dict) may hold; see `megatron-vlm-packing check --help`.
SAVED_KEYS = {
    "input_ids": "[1, T] or [T] token ids, full length ('tokens' also read)",
    "labels": "[1, T] next-token targets, -100 = none",
    "loss_mask": "[1, T] per-token loss weights",
    "position_ids": "[1, T] integer 1D positions or [3, 1, T] mRoPE positions (integers, or floats the rotary's "
                    "float32 reading leaves unchanged; bfloat16 / float16 above 256 / 2048 are judged only against "
                    "the model's index, which tells exact values from rounded ones)",
    "padding_mask": "[1, T] bool, True at pad slots",
    "packed_seq_params": "a PackedSeqParams, or a dict with its field names",
    "cu_seqlens": "[N+1] real boundaries (instead of packed_seq_params)",
    "cu_seqlens_padded": "[N+1] physical boundaries (instead of packed_seq_params)",
    "max_seqlen": "int, longest physical document",
    "image_grid_thw": "[I, 3] (t, h, w) per image", "image_token_id": "int placeholder id",
    "video_grid_thw": "[V, 3] per video", "video_token_id": "int placeholder id",
    "spatial_merge_size": "int, vision tokens per side merged into one placeholder (default 2)",
    "images_per_document": "N ints (optional)", "videos_per_document": "N ints (optional)",
    "second_per_grid_ts": "[V] seconds per video temporal grid step (Qwen2.5-VL, Qwen3-Omni; without them their "
                          "documents with videos are not compared with the index)",
    "audio_seqlens": "[A] raw audio feature lengths per clip in token order (Qwen3-Omni)",
    "audio_token_id": "int audio placeholder id", "audios_per_document": "N ints (optional)",
    "use_audio_in_video": "bool, passed to an mrope callable that takes it (default: told per document "
                          "by audio and video placeholders in one block)",
    "audio_n_window": "int, audio encoder window that sets each clip's tokens (default: the mrope config's, else 50)",
    "source_input_ids": "[B, S] the unpacked rows", "source_labels": "[B, S]",
    "source_attention_mask": "[B, S] 1 = real token", "source_loss_mask": "[B, S] (optional)",
    "label_style": "'hf' (the samples' labels unshifted) or 'megatron' (already next-token): the source rows' "
                   "style; without them 'hf' decides bug class 8 (an HF-style sample's last token has no target)",
    "tp_size": "int", "cp_size": "int", "sequence_parallel": "bool", "fp8": "bool",
    "cp_ranks": "{rank: {'cp_index': [T/cp], 'labels': [1, T/cp], ...}} what each CP rank received",
    "cp_index": "[T/cp] the partition index of a batch saved on one CP rank (its sequence fields hold T/cp slots; "
                "input_ids and position_ids may be full)",
    "cp_rank": "int, the CP rank cp_index belongs to (default: checked against every rank's)",
    "pad_token_id": "int (only used to name bug class 7 / suspect bug class 4)",
}


def saved_keys_help() -> str:
    """One line per key, for `check --help`."""
    return "\n".join(f"  {key}: {meaning}" for key, meaning in SAVED_KEYS.items())
