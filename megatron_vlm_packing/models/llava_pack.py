"""`pack_llava_batch`: a LLaVA micro-batch packed so that its expansion is exact and aligned.

The labels, loss mask and ids are packed by `pack_batch` (same lengths / label-shift code as every
other model), tightly, then laid out on `llava_pack_plan`'s slots: pad slots where the expanded
documents need them for CP / the shard factor, and one before every document that opens with an
image (the slot LLaVA zeroes). See models/llava.py for the rules.

Shape legend: B = rows, S = row length, T0 = tight collapsed slots, T = planned collapsed slots.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.models.llava import LlavaSpace, default_image_tiles, image_expansion, llava_pack_plan
from megatron_vlm_packing.packing.micro_batch import BatchStats, MicroBatch, VisionInputs

_TEXT_KEYS = ("input_ids", "tokens", "labels", "loss_mask", "attention_mask", "seq_lens")
_IMAGE_KEYS = ("images", "pixel_values")
IGNORE_INDEX = -100


def _images(batch: dict) -> torch.Tensor | None:
    given = [k for k in _IMAGE_KEYS if batch.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"the batch has both {given}: pass LLaVA's image tiles under one key")
    return batch[given[0]] if given else None


def _tiles(batch: dict, ids: torch.Tensor, keep: torch.Tensor, space: LlavaSpace, images) -> torch.Tensor:
    """[I] tiles per image, checked against the image tokens of real slots and the image tiles given."""
    is_image = ids == space.image_token_index
    stray = int((is_image & ~keep).sum())
    if stray:
        raise ValueError(f"{stray} image tokens lie in the padding of the rows (outside the real lengths)")
    n_images = int(is_image.sum())
    tiles = default_image_tiles(batch.get("num_image_tiles"), n_images, ids.device)
    if tiles.numel() != n_images:
        raise ValueError(f"{n_images} image tokens in input_ids but {tiles.numel()} entries in num_image_tiles")
    given = 0 if images is None else images.shape[0]
    if given != int(tiles.sum()):
        raise ValueError(f"num_image_tiles sums to {int(tiles.sum())} tiles but the images hold {given}")
    return tiles


def _relayout(indices, tight_lengths: tuple[int, ...]):
    """Gather function moving tight [.., T0] (or [1, T0, ...]) tensors onto the planned [.., T] slots."""
    starts = torch.tensor((0,) + tight_lengths, device=indices.is_real.device).cumsum(0)[:-1]
    source = torch.where(indices.is_real, starts[indices.segment_of_slot] + indices.offset_in_segment, 0)

    def move(x: torch.Tensor, pad_value, dim: int = -1) -> torch.Tensor:
        moved = x.index_select(dim, source)
        mask = indices.is_real.reshape([-1 if d == (dim % x.dim()) else 1 for d in range(x.dim())])
        return torch.where(mask, moved, torch.as_tensor(pad_value, dtype=x.dtype, device=x.device))

    return move


def pack_llava_batch(batch: dict, space: LlavaSpace, *, label_style: str = "megatron", pad_to: int | None = None,
                     pad_token_id: int = 0) -> MicroBatch:
    """Pack a right-padded LLaVA micro-batch for `LLaVAModel` with `space` (`LlavaSpace.of(model)`).

    Args:
        batch: `input_ids` (or `tokens`) [B, S] with one `space.image_token_index` per image, `labels`
            (Megatron style, or Hugging Face style with label_style="hf"), optional `loss_mask`,
            `attention_mask` / `seq_lens` for the real lengths, `images` (or `pixel_values`)
            [tiles, C, H, W] and `num_image_tiles` [I] (absent: one tile per image).
        pad_to: the expanded length wanted (default: LLaVA's pipeline length under PP, else the
            next multiple of its shard factor).

    Returns:
        MicroBatch in collapsed space ([1, T] ids, labels, loss mask, 1D positions restarting per
        document, padding mask) whose `packed_seq_params` are the collapsed boundaries (the patch
        expands them inside the model); `stats` count expanded tokens (what attention computes).
    """
    from megatron_vlm_packing.packing import make_packed_seq_params, pack_batch, plan_indices, segment_positions

    if pad_token_id == space.image_token_index:
        raise ValueError(f"pad_token_id={pad_token_id} is LLaVA's image token: pad slots would become images")
    tight = pack_batch({k: batch[k] for k in _TEXT_KEYS if batch.get(k) is not None},
                       label_style=label_style, pad_token_id=pad_token_id)
    ids = batch["input_ids"] if batch.get("input_ids") is not None else batch["tokens"]
    row_lengths = list(tight.plan.row_lengths)
    keep = torch.arange(ids.shape[1], device=ids.device)[None] < torch.tensor(row_lengths, device=ids.device)[:, None]
    images = _images(batch)
    tiles = _tiles(batch, ids, keep, space, images)
    extra = image_expansion(ids, tiles, img_seq_len=space.img_seq_len, image_token_index=space.image_token_index)
    row_expansion = extra.sum(1).tolist()
    opens = (ids[:, 0] == space.image_token_index).tolist()
    plan = llava_pack_plan(row_lengths, row_capacity=ids.shape[1], row_expansion=row_expansion,
                           opens_with_image=opens, space=space, pad_to=pad_to)
    indices = plan_indices(plan, ids.device)
    move = _relayout(indices, tight.plan.physical_lengths)
    images_per_sample = (ids == space.image_token_index).sum(1).tolist()
    vision = None
    if images is not None and images.shape[0] > 0:
        vision = VisionInputs(pixel_values=images, images_per_sample=tuple(images_per_sample), num_image_tiles=tiles)
    expanded_rows = [n + e for n, e in zip(row_lengths, row_expansion)]
    stats = BatchStats(real_tokens=sum(expanded_rows), physical_tokens=plan.total + sum(row_expansion),
                       row_tokens=len(row_lengths) * max(expanded_rows))
    return MicroBatch(
        input_ids=move(tight.input_ids, pad_token_id), labels=move(tight.labels, IGNORE_INDEX),
        loss_mask=move(tight.loss_mask, 0), position_ids=segment_positions(indices),
        padding_mask=~indices.is_real[None], packed_seq_params=make_packed_seq_params(plan, indices),
        rope_cu_seqlens=indices.cu_seqlens, stats=stats, vision=vision,
        extras={k: move(v, 0, dim=1) for k, v in tight.extras.items()}, plan=plan, indices=indices,
    )
