"""Tiny Hugging Face configs of every family and a binding of each model's own get_rope_index."""

import functools
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653


def hf_config(family: str):
    vision = dict(depth=1, hidden_size=16, num_heads=2, spatial_merge_size=2, out_hidden_size=16)
    text = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=32, vocab_size=151936)
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=16),
                             text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}))
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(vision_config=dict(vision, tokens_per_second=2),
                                text_config=dict(text, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}))
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(vision_config=dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=16),
                         text_config=dict(text, head_dim=8, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                                             "mrope_interleaved": True}))


def hf_get_rope_index(family: str, config):
    """The model's own get_rope_index, bound to an object holding only its config."""
    module = {"qwen2_vl": "transformers.models.qwen2_vl.modeling_qwen2_vl",
              "qwen2_5_vl": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
              "qwen3_vl": "transformers.models.qwen3_vl.modeling_qwen3_vl"}[family]
    cls_name = {"qwen2_vl": "Qwen2VLModel", "qwen2_5_vl": "Qwen2_5_VLModel", "qwen3_vl": "Qwen3VLModel"}[family]
    cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
    owner = types.SimpleNamespace(config=config)
    owner.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, owner)
    return functools.partial(cls.get_rope_index, owner)


@functools.cache
def hf_reads_fractional_seconds() -> bool:
    """Whether this transformers' Qwen2.5-VL `get_rope_index` scales a video's temporal positions by its fractional
    `second_per_grid_ts`, as the model was trained and as ours does. transformers 5.8 to 5.17 (Megatron-Bridge
    0.6.2's whole range, 5.8 to 5.12.1, among them) truncate each entry to an int first
    (`int(next(second_per_grid_ts))`): 0.5 s per grid is 0 and every frame of the video gets one temporal position.
    transformers PR #48669 ended that (5.23.0 and 5.24.0 read the fraction). Asked of the model, not its version."""
    hf = hf_config("qwen2_5_vl")  # 2 tokens per second
    ids = torch.tensor([[START, VIDEO, VIDEO, END]])  # one video of 2 frames of 1 merged token each
    positions, _ = hf_get_rope_index("qwen2_5_vl", hf)(ids, mm_token_type_ids=(ids == VIDEO).int() * 2,
                                                       video_grid_thw=torch.tensor([[2, 2, 2]]),
                                                       second_per_grid_ts=torch.tensor([0.5]))
    return bool(positions[0, 0, 2] != positions[0, 0, 1])  # temporal step 2 * 0.5 = 1, or 0 when truncated


def seconds_as_hf_reads(seconds):
    """`second_per_grid_ts` as this transformers' Qwen2.5-VL reads it: unchanged, or each entry truncated toward
    zero where it truncates (`hf_reads_fractional_seconds`). The parity tests give ours and the HF index these same
    seconds; `test_get_rope_index.test_truncating_transformers_differs_only_by_the_truncation` shows the rest."""
    if seconds is None or hf_reads_fractional_seconds():
        return seconds
    if isinstance(seconds, torch.Tensor):
        return seconds.trunc()
    return [float(int(s)) for s in seconds]


def random_rows(family: str, batch: int, seed: int, *, pad: bool = True):
    """Rows of text runs and vision blocks (some rows start or end with a block), right-padded."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    rows, images, videos, seconds = [], [], [], []
    for _ in range(batch):
        tokens = [] if rand(0, 1) else [rand(1, 1000) for _ in range(rand(1, 4))]
        for _ in range(rand(0, 3)):
            h, w = 2 * rand(1, 4), 2 * rand(1, 4)
            if rand(0, 1):
                images.append([1, h, w])
                tokens += [START] + [IMAGE] * (h * w // 4) + [END]
            else:
                t = rand(1, 3)
                videos.append([t, h, w])
                seconds.append(rand(1, 8) / 4)
                if family == "qwen3_vl":  # one block per frame, timestamp text in between
                    for _ in range(t):
                        tokens += [rand(1, 1000), START] + [VIDEO] * (h * w // 4) + [END]
                else:
                    tokens += [START] + [VIDEO] * (t * h * w // 4) + [END]
            tokens += [rand(1, 1000) for _ in range(rand(0, 4))]
        if not tokens:
            tokens = [rand(1, 1000)]
        rows.append(tokens)
    width = max(len(r) for r in rows) + (3 if pad else 0)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    grid = lambda x: torch.tensor(x, dtype=torch.long).reshape(-1, 3) if x else None  # noqa: E731
    return ids, mask, grid(images), grid(videos), torch.tensor(seconds) if seconds else None
