"""Megatron-Core `LLaVAModel`, packed vs batched, with variable tiles per image (the original report).

`run_llava_parity(rank, world_size)` is a `run_distributed` target: a tiny LLaVA (CLIP-style ViT,
MLP projector, GPT with the reference attention) runs the same multi-image samples batched
(right-padded rows) and packed in THD, without and with `patches.llava_boundaries`, and reports
token_mult_prob_error = exp(mean |logp_packed - logp_batched|) over the tokens with a loss.
"""

from __future__ import annotations

import copy

import torch

from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.testing.distributed import initialize_parallel
from megatron_vlm_packing.testing.parity import token_mult_prob_error

IMAGE_TOKEN = 127
TILE_CYCLE = (1, 2, 1, 3, 1)


def build_tiny_llava(seed: int):
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_vlm_packing.attention import layer_spec
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, transformer_config

    vision = transformer_config(TinyGPTConfig(num_query_groups=4))
    vision.vision_model_type = "clip"
    vision_spec = copy.deepcopy(get_vit_layer_with_local_spec())
    vision_spec.submodules.input_layernorm = WrappedTorchNorm  # the local ViT spec's norm needs TE or apex
    vision_spec.submodules.pre_mlp_layernorm = WrappedTorchNorm
    torch.manual_seed(seed)
    return LLaVAModel(
        language_transformer_config=transformer_config(TinyGPTConfig()),
        language_transformer_layer_spec=layer_spec("reference"), language_vocab_size=128,
        language_max_sequence_length=1024, vision_transformer_config=vision,
        vision_transformer_layer_spec=vision_spec, drop_vision_class_token=True,
        vision_projection_config=transformer_config(TinyGPTConfig(num_query_groups=4)),
        vision_projection_layer_spec=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        language_position_embedding_type="rope", img_h=28, img_w=28, patch_dim=14, image_token_index=IMAGE_TOKEN,
    )


def samples(seed: int):
    """Rows with 0-3 images each (multi-image samples), tiles cycling through TILE_CYCLE."""
    g = torch.Generator().manual_seed(seed)
    rows, images_per_row = [], [2, 0, 3, 1, 2]
    for n_images in images_per_row:
        tokens = []
        for _ in range(n_images):
            tokens += torch.randint(1, 100, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
            tokens.append(IMAGE_TOKEN)
        tokens += torch.randint(1, 100, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        rows.append(tokens)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    keep = torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]
    labels = torch.where(keep, torch.randint(1, 100, ids.shape, generator=g), 0)
    n_images = int((ids == IMAGE_TOKEN).sum())
    tiles = torch.tensor([TILE_CYCLE[i % len(TILE_CYCLE)] for i in range(n_images)], dtype=torch.int)
    images = torch.randn(int(tiles.sum()), 3, 28, 28, generator=g)
    return ids, keep, labels, tiles, images


def logprobs(model, images, ids, labels, loss_mask, tiles, params=None):
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    loss, mask = model(images, ids, positions, None, labels=labels, loss_mask=loss_mask,
                       num_image_tiles=tiles, packed_seq_params=params)
    return -loss[mask.bool()]


def run_llava_parity(rank: int, world_size: int, seed: int = 11) -> dict:
    from megatron_vlm_packing.patches import llava_boundaries

    initialize_parallel(seed=seed)
    model = build_tiny_llava(seed).eval()
    ids, keep, labels, tiles, images = samples(seed)
    loss_mask = keep.float()
    packed = pack_batch({"input_ids": ids, "labels": labels, "loss_mask": loss_mask, "attention_mask": keep.long()})
    result = {"images": int(tiles.numel()), "tiles": tiles.tolist(), "img_seq_len": int(model.img_seq_len)}
    with torch.no_grad():
        batched = logprobs(model, images, ids, labels, loss_mask, tiles)
        for name, patched in (("unpatched", False), ("patched", True)):
            if patched:
                result["patch_active"] = llava_boundaries.apply_llava_packed_boundaries()
            try:
                got = logprobs(model, images, packed.input_ids, packed.labels.clamp_min(0), packed.loss_mask, tiles,
                               packed.packed_seq_params)
                result[name] = token_mult_prob_error(got, batched) if got.shape == batched.shape else float("inf")
            except RuntimeError as err:  # collapsed boundaries on the expanded sequence may also crash
                if patched:
                    raise
                result[name] = float("inf")
                result["unpatched_error"] = str(err)[:160]
            finally:
                if patched:
                    llava_boundaries.undo_llava_packed_boundaries()
    return result
