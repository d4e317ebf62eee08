"""Packed boundaries for Megatron-Core's `LLaVAModel`, whose forward expands every image token into
`num_tiles * img_seq_len` embeddings (bug class 2: the boundaries stayed in collapsed space).

Two ways to get them right:
- the planner path (preferred): `llava_expanded_lengths` gives each sample's length after
  expansion, so plans, alignment and token budgets are decided in the space attention sees;
- the remap path: `remap_packed_seq_params` moves both boundary sets of a collapsed pack into the
  expanded space (pad slots hold no images, so every document grows by its own images only), and
  `patches.llava_boundaries` applies it inside `LLaVAModel.forward`.

Shape legend: T = collapsed packed tokens, N = documents, I = images (in token order).
"""

from __future__ import annotations

from dataclasses import replace

import torch


def image_expansion(input_ids: torch.Tensor, num_image_tiles: torch.Tensor, *, img_seq_len: int,
                    image_token_index: int) -> torch.Tensor:
    """Extra embeddings each token position turns into: [same shape as input_ids] long.

    An image token becomes `tiles * img_seq_len` embeddings (adds that minus one); text adds 0.

    Raises:
        ValueError: image tokens and `num_image_tiles` entries disagree.
    """
    is_image = input_ids == image_token_index
    tiles = torch.as_tensor(num_image_tiles, device=input_ids.device).reshape(-1).long()
    count = int(is_image.sum())
    if count != tiles.numel():
        raise ValueError(f"{count} image tokens in input_ids but {tiles.numel()} entries in num_image_tiles")
    extra = torch.zeros_like(input_ids, dtype=torch.long)
    extra[is_image] = tiles * img_seq_len - 1  # row-major: images in token order
    return extra


def llava_expanded_lengths(input_ids: torch.Tensor, seq_lens: list[int], num_image_tiles, *, img_seq_len: int,
                           image_token_index: int) -> list[int]:
    """Each right-padded row's real length after image expansion (the planner path).

    Args:
        input_ids: [B, S] collapsed ids; seq_lens: B real lengths; num_image_tiles: [I] tiles per image.
    """
    extra = image_expansion(input_ids, num_image_tiles, img_seq_len=img_seq_len, image_token_index=image_token_index)
    keep = torch.arange(input_ids.shape[1], device=input_ids.device)[None] < torch.tensor(seq_lens, device=input_ids.device)[:, None]
    return [n + int(e) for n, e in zip(seq_lens, (extra * keep).sum(1).tolist())]


def remap_packed_seq_params(params, input_ids: torch.Tensor, num_image_tiles, *, img_seq_len: int,
                            image_token_index: int, segment_multiple: int = 1, total_multiple: int = 1):
    """Both boundary sets of a collapsed THD pack, moved into LLaVA's expanded space.

    Args:
        params: PackedSeqParams of the collapsed pack (`cu_seqlens_q` real, `cu_seqlens_q_padded` physical).
        input_ids: [1, T] the collapsed packed ids.
        segment_multiple: every expanded physical document must divide by it (2*cp under CP).
        total_multiple: LLaVA pads the expanded total to this (its CP/SP shard factor); the last
            document takes that padding, as in our plans.

    Returns:
        PackedSeqParams with expanded `cu_seqlens_*`, `cu_seqlens_*_padded` and `max_seqlen_*`.

    Raises:
        ValueError: an expanded document that breaks `segment_multiple` (plan in expanded space
        with `llava_expanded_lengths` instead), or image counts that disagree.
    """
    extra = image_expansion(input_ids, num_image_tiles, img_seq_len=img_seq_len,
                            image_token_index=image_token_index)[0]
    cu_real = params.cu_seqlens_q.long().to(extra.device)
    cu_padded = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q)
    cu_padded = cu_padded.long().to(extra.device)
    before = torch.cat([extra.new_zeros(1), torch.cumsum(extra, 0)])  # [T+1] expansion before each slot
    grown = before[cu_padded[1:]] - before[cu_padded[:-1]]  # [N] each document's own images
    real = (cu_real[1:] - cu_real[:-1]) + grown
    physical = (cu_padded[1:] - cu_padded[:-1]) + grown
    total = int(physical.sum())
    physical[-1] += -(-total // total_multiple) * total_multiple - total
    bad = torch.nonzero(physical % segment_multiple).flatten().tolist()
    if bad:
        raise ValueError(f"expanded documents {bad[:8]} have physical lengths {physical[bad[:8]].tolist()} that do not "
                         f"divide by {segment_multiple}: plan the pack in expanded space (llava_expanded_lengths)")
    zero = cu_real.new_zeros(1)
    new_real = torch.cat([zero, torch.cumsum(real, 0)]).to(params.cu_seqlens_q.dtype).to(params.cu_seqlens_q.device)
    new_padded = torch.cat([zero, torch.cumsum(physical, 0)]).to(params.cu_seqlens_q.dtype).to(params.cu_seqlens_q.device)
    longest = int(physical.max())
    return replace(params, cu_seqlens_q=new_real, cu_seqlens_kv=new_real, cu_seqlens_q_padded=new_padded,
                   cu_seqlens_kv_padded=new_padded, max_seqlen_q=longest, max_seqlen_kv=longest)
