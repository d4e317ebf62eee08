"""The tiny Megatron-Core `LLaVAModel`, its micro-batches and the batched reference for
`testing.llava_parity` (which re-exports these names).

The reference is the single-process model on right-padded rows (LLaVA's own path). Samples cover
images at sample starts, back-to-back images, an image as a sample's last token, text-only samples
and the tile cycle [1, 2, 1, 3, 1]; `hostile_batches` adds short, empty, image-only and repeated samples
(`HOSTILE_MICRO_BATCHES`, run under TP=2 + SP by tests/llava/llava_workers.py). `llava_cp_without_te` lets LLaVA run CP on a CPU without
Transformer Engine.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from megatron_vlm_packing.testing.distributed import initialize_parallel

IMAGE_TOKEN = 127
TILE_CYCLE = (1, 2, 1, 3, 1)
MAX_LENGTH = 160  # language_max_sequence_length: LLaVA pads every row to it under PP
IMG, T = IMAGE_TOKEN, None  # T: a random text token
MICRO_BATCHES = (
    ((IMG, T, T, T), (T, T, IMG, IMG, T, T), (IMG, T, T, IMG), (T, T, T, T, T), (IMG, T, T)),
    ((T, T, T), (IMG, IMG, T, T), (T, IMG, T, T, IMG)),
)


def build_tiny_llava(seed: int, *, cp: int = 1, pp: int = 1, stage: int = 0, tp: int = 1, sp: bool = False,
                     params_dtype: torch.dtype = torch.float32):
    """A tiny LLaVA (CLIP-style ViT, MLP projector, rope GPT with the reference attention) for a PP
    stage; `tp` shards every part, `sp` is the language model's sequence parallelism; `params_dtype`
    torch.bfloat16 also sets the configs' bf16 (for Megatron's `Float16Module`; `transformer_config`)."""
    from megatron.core.enums import ModelType
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_vlm_packing.attention import layer_spec
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, transformer_config

    vision = transformer_config(TinyGPTConfig(num_query_groups=4, tensor_parallel=tp, params_dtype=params_dtype))
    vision.vision_model_type = "clip"
    vision_spec = copy.deepcopy(get_vit_layer_with_local_spec())
    vision_spec.submodules.input_layernorm = WrappedTorchNorm  # the local ViT spec's norm needs TE or apex
    vision_spec.submodules.pre_mlp_layernorm = WrappedTorchNorm
    first, last = stage == 0, stage == pp - 1
    torch.manual_seed(seed)
    model = LLaVAModel(
        language_transformer_config=transformer_config(TinyGPTConfig(context_parallel=cp, pipeline_parallel=pp,
                                                                     tensor_parallel=tp, sequence_parallel=sp,
                                                                     params_dtype=params_dtype)),
        language_transformer_layer_spec=layer_spec("reference"), language_vocab_size=128,
        language_max_sequence_length=MAX_LENGTH, vision_transformer_config=vision,
        vision_transformer_layer_spec=vision_spec, drop_vision_class_token=True,
        vision_projection_config=transformer_config(TinyGPTConfig(num_query_groups=4, tensor_parallel=tp,
                                                                  params_dtype=params_dtype)),
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        language_position_embedding_type="rope", img_h=28, img_w=28, patch_dim=14, image_token_index=IMAGE_TOKEN,
        pre_process=first, post_process=last, add_encoder=first,
    )
    model.model_type = ModelType.encoder_or_decoder  # what megatron.training's get_model sets
    return model


def collated(rows, *, label_style: str, seed: int) -> dict:
    """A right-padded batch of `rows` (IMG or T per token), labels in `label_style`, tiles cycling."""
    g = torch.Generator().manual_seed(seed)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor([IMG if t == IMG else int(torch.randint(1, 100, (1,), generator=g)) for t in row])
    keep = torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]
    if label_style == "hf":  # unshifted, -100 at image tokens (Hugging Face processors do so)
        labels = torch.where(keep & (ids != IMG), ids, -100)
    else:
        labels = torch.where(keep, torch.randint(1, 100, ids.shape, generator=g), -100)
    n_images = int((ids == IMG).sum())
    tiles = torch.tensor([TILE_CYCLE[i % len(TILE_CYCLE)] for i in range(n_images)], dtype=torch.int)
    images = torch.randn(int(tiles.sum()), 3, 28, 28, generator=g)
    return {"input_ids": ids, "labels": labels, "attention_mask": keep.long(), "images": images,
            "num_image_tiles": tiles}


def batches(label_style: str, seed: int) -> list[dict]:
    return [collated(rows, label_style=label_style, seed=seed + i) for i, rows in enumerate(MICRO_BATCHES)]


# Hostile micro-batches, each expanding to an odd total (at TP=2 + SP the shard factor's pad slot is its last
# document's): documents of 1 to 4 tokens, an empty row between a document and an image-only one (whose pad slot
# LLaVA zeroes), image-only documents and ones ending on an image (the last too); no image;
# the first sample repeated (`REPEATED_ROWS` of micro-batch `REPEATED`); one document of 1 token (at TP=2 + SP
# the second rank holds only its pad slot); image-only documents alone (no token with a loss in either style).
HOSTILE_MICRO_BATCHES = (
    ((T,), (), (IMG,), (T, T), (IMG, IMG), (T, T, T, T), (T, T, IMG)),
    ((T,), (T, T, T), (T, T, T, T, T)),
    ((IMG, T, T), (T, T)),
    ((T,),),
    ((IMG,), (IMG,)),
)
REPEATED, REPEATED_ROWS = 2, (0, 0, 1)


def repeated_rows(batch: dict, order: tuple[int, ...]) -> dict:
    """`batch`'s rows in `order` (a row may repeat), each with its own images and tiles."""
    per_row = (batch["input_ids"] == IMG).sum(1).tolist()
    tiles = batch["num_image_tiles"].split(per_row)
    images = batch["images"].split([int(t.sum()) for t in tiles])
    index = torch.tensor(order)
    return dict({k: batch[k][index] for k in ("input_ids", "labels", "attention_mask")},
                images=torch.cat([images[i] for i in order]), num_image_tiles=torch.cat([tiles[i] for i in order]))


def hostile_batches(label_style: str, seed: int) -> list[dict]:
    """`HOSTILE_MICRO_BATCHES` (`REPEATED` with its rows repeated), then the first micro-batch again (the same dict)."""
    data = [collated(rows, label_style=label_style, seed=seed + i) for i, rows in enumerate(HOSTILE_MICRO_BATCHES)]
    data[REPEATED] = repeated_rows(data[REPEATED], REPEATED_ROWS)
    return data + [data[0]]


def batched_targets(batch: dict, label_style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-style [B, S] labels and loss mask of the batched reference."""
    from megatron_vlm_packing.packing import shift_labels_within_rows

    keep = batch["attention_mask"].bool()
    labels = shift_labels_within_rows(batch["labels"], keep) if label_style == "hf" else batch["labels"]
    return labels, (keep & (labels != -100)).float()


def reference(model, data: list[dict], label_style: str):
    """Batched LLaVA: per micro-batch logprobs of the tokens with a loss, and the summed-loss grads."""
    model.zero_grad()
    logps = []
    for batch in data:
        labels, loss_mask = batched_targets(batch, label_style)
        ids = batch["input_ids"]
        positions = torch.arange(ids.shape[1])[None].expand_as(ids)
        losses, mask = model(batch["images"], ids, positions, None, labels=labels, loss_mask=loss_mask,
                             num_image_tiles=batch["num_image_tiles"])
        (losses * mask).sum().backward()
        logps.append(-losses.detach()[mask.bool()])
    return logps, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def llava_cp_without_te():
    """Let LLaVAModel run CP on a CPU without Transformer Engine; restored on exit.

    LLaVA refuses CP/SP unless its core attention is TE's `TEDotProductAttention` (constructor) and
    partitions THD packs with TE's `thd_get_partitioned_indices` (forward). Here our reference
    attention (THD + CP, the same contract) stands in for the first, and our `cp_partition_index`,
    which implements TE's rule (chunks r and 2*cp-1-r of every document), for the second. Only
    attributes of LLaVA's module change. With TE installed nothing is changed.
    """
    from megatron.core.models.multimodal import llava_model

    from megatron_vlm_packing.attention.reference import ReferenceCoreAttention
    from megatron_vlm_packing.parallel.cp import cp_partition_index

    if llava_model.HAVE_TE and llava_model.HAVE_TEX:
        yield
        return
    names = ("HAVE_TE", "TEDotProductAttention", "HAVE_TEX", "tex", "is_te_min_version")
    missing = object()  # megatron-core 0.16.1 defines no TEDotProductAttention without TE
    saved = {k: getattr(llava_model, k, missing) for k in names}

    class _Tex:
        @staticmethod
        def thd_get_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank):
            return cp_partition_index(cu_seqlens_padded, cp_size, cp_rank)

    values = (True, ReferenceCoreAttention, True, _Tex, lambda *a, **k: True)
    for k, v in zip(names, values):
        setattr(llava_model, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                delattr(llava_model, k)
            else:
                setattr(llava_model, k, v)


def reference_setup(seed: int):
    """One process: (the tiny LLaVA, its parameters cloned by name, {label style: (batches, *reference)})."""
    initialize_parallel(seed=seed)
    ref_model = build_tiny_llava(seed)
    state = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    refs = {style: (batches(style, seed), *reference(ref_model, batches(style, seed), style))
            for style in ("megatron", "hf")}
    return ref_model, state, refs
