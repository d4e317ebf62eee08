"""LLaVA's collapsed -> expanded space: how many embeddings each image token becomes, and what that does to a pack.

`LLaVAModel` expands every image token into `tiles * img_seq_len` embeddings inside its forward, so a THD
pack made over the collapsed ids must be read in the expanded space before attention runs:
`image_expansion` counts the extra embeddings per token (on the device, no sync), `remap_packed_seq_params`
moves both boundary sets there (bug class 2; `patches.llava_boundaries` calls it on every pipeline stage for a
pack without a plan), and `leaking_documents` finds the documents whose opening image would make LLaVA zero the
loss of the previous document's last real token (bug class 13). The packer plans around both
(`models.llava_plan`, `models.llava_pack`); the adapter (`models.llava`) and the patch refuse what it did not plan.

Shape legend: B = rows, S = row length, T = collapsed packed slots, N = documents, I = images.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_vlm_packing.models.llava_plan import check_expanded_total


def image_expansion(input_ids: torch.Tensor, num_image_tiles, *, img_seq_len: int, image_token_index: int,
                    check: bool = True) -> torch.Tensor:
    """Extra embeddings each token position turns into: [same shape as input_ids] long.

    An image token becomes `tiles * img_seq_len` embeddings (adds that minus one); text adds 0.
    Images take their tiles in row-major token order, gathered on the device (no host sync).

    Args:
        check: count the image tokens against `num_image_tiles` (one host sync). With False the
            caller checks the count itself (a mismatch then gives meaningless values, not an error).

    Raises:
        ValueError: image tokens and `num_image_tiles` entries disagree (with `check`).
    """
    is_image = input_ids == image_token_index
    tiles = torch.as_tensor(num_image_tiles, device=input_ids.device).reshape(-1).long()
    if check:
        count = int(is_image.sum())
        if count != tiles.numel():
            raise ValueError(f"{count} image tokens in input_ids but {tiles.numel()} entries in num_image_tiles")
    if tiles.numel() == 0:
        return torch.zeros_like(input_ids, dtype=torch.long)
    ordinal = is_image.reshape(-1).long().cumsum(0).sub(1).clamp(0, tiles.numel() - 1).reshape(input_ids.shape)
    return torch.where(is_image, tiles[ordinal] * img_seq_len - 1, 0)


def llava_expanded_lengths(input_ids: torch.Tensor, seq_lens: list[int], num_image_tiles, *, img_seq_len: int,
                           image_token_index: int) -> list[int]:
    """Each right-padded row's real length after image expansion.

    Args:
        input_ids: [B, S] collapsed ids; seq_lens: B real lengths; num_image_tiles: [I] tiles per image.
    """
    extra = image_expansion(input_ids, num_image_tiles, img_seq_len=img_seq_len, image_token_index=image_token_index)
    device = input_ids.device
    keep = torch.arange(input_ids.shape[1], device=device)[None] < torch.tensor(seq_lens, device=device)[:, None]
    return [n + int(e) for n, e in zip(seq_lens, (extra * keep).sum(1).tolist())]


def remap_packed_seq_params(params, input_ids: torch.Tensor, num_image_tiles, *, img_seq_len: int,
                            image_token_index: int, segment_multiple: int = 1, total_multiple: int = 1,
                            pad_to: int | None = None, max_length: int | None = None):
    """Both boundary sets of a collapsed THD pack, moved into LLaVA's expanded space.

    Pad slots hold no images, so every document grows by exactly its own images.

    Args:
        params: PackedSeqParams of the collapsed pack (`cu_seqlens_q` real, `cu_seqlens_q_padded` physical).
        input_ids: [1, T] the collapsed packed ids.
        segment_multiple: every expanded physical document must divide by it (2*cp under CP).
        total_multiple: the expanded total must divide by it (LLaVA's CP/SP shard factor).
        pad_to: the expanded length LLaVA pads the row to (pipeline parallelism); the last
            document takes that padding, as in our plans.
        max_length: LLaVA truncates beyond it: refused.

    Returns:
        PackedSeqParams with expanded `cu_seqlens_*`, `cu_seqlens_*_padded` and `max_seqlen_*`.

    Raises:
        ValueError: a multiple that does not hold (plan in expanded space with `pack_llava_batch`),
        a pack longer than LLaVA keeps, or image counts that disagree.
    """
    extra = image_expansion(input_ids, num_image_tiles, img_seq_len=img_seq_len,
                            image_token_index=image_token_index)[0]
    cu_real = params.cu_seqlens_q.long().to(extra.device)
    cu_padded = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q)
    cu_padded = cu_padded.long().to(extra.device)
    if int(cu_padded[-1]) != extra.numel():
        raise ValueError(f"cu_seqlens_q_padded ends at {int(cu_padded[-1])} but input_ids has {extra.numel()} slots")
    before = torch.cat([extra.new_zeros(1), torch.cumsum(extra, 0)])  # [T+1] expansion before each slot
    grown = before[cu_padded[1:]] - before[cu_padded[:-1]]  # [N] each document's own images
    real = (cu_real[1:] - cu_real[:-1]) + grown
    physical = ((cu_padded[1:] - cu_padded[:-1]) + grown).tolist()
    target = check_expanded_total(physical, segment=segment_multiple, total_multiple=total_multiple, pad_to=pad_to,
                                  max_length=max_length)
    physical[-1] += target - sum(physical)
    zero = cu_real.new_zeros(1)
    physical_t = torch.tensor(physical, dtype=torch.long, device=cu_real.device)
    dtype, device = params.cu_seqlens_q.dtype, params.cu_seqlens_q.device
    new_real = torch.cat([zero, torch.cumsum(real, 0)]).to(dtype).to(device)
    new_padded = torch.cat([zero, torch.cumsum(physical_t, 0)]).to(dtype).to(device)
    longest = max(physical)
    return replace(params, cu_seqlens_q=new_real, cu_seqlens_kv=new_real, cu_seqlens_q_padded=new_padded,
                   cu_seqlens_kv_padded=new_padded, max_seqlen_q=longest, max_seqlen_kv=longest)


def leaking_documents(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                      loss_mask: torch.Tensor | None, *, image_token_index: int) -> list[int]:
    """Documents whose opening image would make LLaVA drop the previous document's last token.

    Args:
        input_ids: [1, T] collapsed packed ids; cu_seqlens / cu_seqlens_padded: [N+1] collapsed boundaries.
        loss_mask: [1, T] (None: every real token counts).

    Returns:
        Indices i >= 1 of documents that open with an image token while document i-1 has no pad slot
        and a nonzero loss weight on its last real token (the slot `_preprocess_data` zeroes).
    """
    cu, cu_padded = cu_seqlens.long().cpu(), cu_seqlens_padded.long().cpu()
    starts = cu_padded[1:-1]  # [N-1] first slot of documents 1..N-1
    if starts.numel() == 0:
        return []
    opens = (input_ids[0].index_select(0, starts.to(input_ids.device)) == image_token_index).cpu()
    no_pad = (cu[1:-1] - cu[:-2]) == (cu_padded[1:-1] - cu_padded[:-2])
    weighted = torch.ones_like(opens)
    if loss_mask is not None:
        weighted = (loss_mask[0].index_select(0, (starts - 1).to(loss_mask.device)) != 0).cpu()
    return (torch.nonzero(opens & no_pad & weighted).flatten() + 1).tolist()




def leak_message(documents: list[int]) -> str:
    return (f"documents {documents[:8]} open with an image right after the previous document's last real "
            f"token: LLaVAModel zeroes the loss of the slot before each image, so that token's loss would be "
            f"lost; pack with models.llava_pack.pack_llava_batch (one pad slot before such documents)")
