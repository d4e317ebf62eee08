"""Place vision embeddings at their placeholder tokens (pure function, autograd-friendly).

Shape legend: L = token positions (flattened), H = hidden, M = vision tokens.
"""

from __future__ import annotations

import torch


def merge_vision_embeddings(
    text_embeddings: torch.Tensor, input_ids: torch.Tensor, vision_embeddings: torch.Tensor, *, token_id: int,
    field: str = "image",
) -> torch.Tensor:
    """Replace the embeddings of every `token_id` placeholder with the vision embeddings, in order.

    Args:
        text_embeddings: [L, ..., H], token embeddings in the same order as `input_ids.reshape(-1)`
            along dim 0 (a leading [T, 1, H] for packed THD, or [S*B, H] flattened).
        input_ids: any shape with L elements, the full (not CP-sliced) token ids.
        vision_embeddings: [M, H], one row per placeholder, in token order.

    Returns:
        Embeddings of the same shape with vision rows in place.

    Raises:
        ValueError: M differs from the number of placeholders (naming both counts).
    """
    positions = torch.nonzero(input_ids.reshape(-1) == token_id).flatten()
    if positions.numel() != vision_embeddings.shape[0]:
        raise ValueError(f"{positions.numel()} {field} placeholder tokens (id {token_id}) in input_ids but "
                         f"{vision_embeddings.shape[0]} {field} embeddings from the vision tower")
    rows = vision_embeddings.to(text_embeddings.dtype).reshape(-1, *text_embeddings.shape[1:])
    return text_embeddings.index_copy(0, positions, rows)


def check_tower_output(embeddings, *, tower: str, field: str, token_id: int, rows: int, hidden: int,
                       device: torch.device) -> None:
    """What a tower returned for the `field` items of a micro-batch must be `[rows, hidden]` floating-point rows on
    the language model's device: one row per placeholder, in token order. Reads shapes only (no sync).

    Args:
        embeddings: the tower's output, any object.
        tower: "vision" or "audio", for the message; field: "image", "video" or "audio".
        rows: host int, the micro-batch's `token_id` placeholders (checked against its items).
        hidden: the language model's hidden size H; device: where its embeddings are.

    Raises:
        ValueError: naming the tower, what it returned and the rows / width expected. A row count that no one
            compared with the placeholders placed the tower's first rows and trained the rest of them (or the
            placeholders left over) silently.
    """
    if not isinstance(embeddings, torch.Tensor):
        raise ValueError(f"the {tower} tower returned a {type(embeddings).__name__}, not a tensor: PackedVLM places "
                         f"one [rows, hidden] tensor per kind; wrap a tower with several outputs (Qwen3-VL's deepstack "
                         f"features) in a module that returns the [rows, hidden] embeddings")
    if not embeddings.is_floating_point():
        raise ValueError(f"the {tower} tower returned a tensor of dtype {embeddings.dtype}: its {field} embeddings "
                         f"must be floating point")
    if embeddings.dim() != 2 or embeddings.shape[1] != hidden:
        raise ValueError(f"the {tower} tower returned a tensor of shape {list(embeddings.shape)}: it must return "
                         f"[rows, hidden] = [{rows}, {hidden}] (the language model's hidden size), one row per "
                         f"{field} placeholder token (id {token_id})")
    if embeddings.shape[0] != rows:
        raise ValueError(f"the {tower} tower returned {embeddings.shape[0]} rows {list(embeddings.shape)} for the "
                         f"{rows} {field} placeholder tokens (id {token_id}) of the micro-batch: it must return one "
                         f"row per placeholder, in token order")
    if embeddings.device != device:
        raise ValueError(f"the {tower} tower returned its {field} embeddings on {embeddings.device} but the language "
                         f"model's are on {device}: move the tower with the model")


def check_media_dtypes(*, pixel_values=None, pixel_values_videos=None, input_features=None,
                       feature_attention_mask=None) -> None:
    """The dtypes of the media a model hands its towers (PackedVLM, the Bridge adapters): floating-point pixel
    values and mel features, a bool or integer feature mask. The packers check them in the batch; a micro-batch
    built or edited by hand (a `transform=`, a `replace`) reached the tower, which cast it silently. Reads no
    values; tensors only (other inputs are named by the checks of their shapes).

    Raises:
        ValueError: naming the field and its dtype (`packing.media.check_floating_media`,
            `packing.media_audio.check_feature_mask_dtype`).
    """
    from megatron_vlm_packing.packing.media import check_floating_media
    from megatron_vlm_packing.packing.media_audio import check_feature_mask_dtype

    for name, values, what in (("pixel_values", pixel_values, "pixel values"),
                               ("pixel_values_videos", pixel_values_videos, "pixel values"),
                               ("input_features", input_features, "mel features")):
        if isinstance(values, torch.Tensor):
            check_floating_media(values, name, what)
    if isinstance(feature_attention_mask, torch.Tensor):
        check_feature_mask_dtype(feature_attention_mask)


def tokens_per_grid(grid_thw: torch.Tensor, merge: int) -> list[int]:
    """grid_thw: [I, 3] -> I host ints, the language-model tokens of each image or video (t*h*w / merge**2)."""
    return (grid_thw.prod(dim=1) // (merge * merge)).tolist()


def refuse_orphan_placeholders(input_ids: torch.Tensor, field: str, token_id: int) -> None:
    """`field` ("image", "video", "audio") has no inputs: any `token_id` placeholder in `input_ids` would train
    as text. One host read.

    Raises:
        ValueError: naming the kind and its placeholder id.
    """
    if bool((input_ids == token_id).any()):
        raise ValueError(f"input_ids hold {field} placeholder tokens (id {token_id}) but no {field} inputs were given")


def placeholder_positions(input_ids: torch.Tensor, token_id: int, count: int) -> torch.Tensor:
    """[count] long flat positions of the `token_id` placeholders, in order, with no host sync.

    The count comes from the host (packing's one read checked it against each sample's items), so
    the positions are built on the device: a running count numbers the placeholders, and a scatter
    of size `count + 1` writes each position to its number (slot `count` takes every other token).

    Args:
        input_ids: any shape with L elements, the full token ids.
        count: placeholders in `input_ids` (host int, already checked).
    """
    flat = input_ids.reshape(-1)
    is_placeholder = flat == token_id
    number = torch.cumsum(is_placeholder, dim=0) - 1  # [L]: k for the k-th placeholder
    slot = torch.where(is_placeholder & (number < count), number, torch.full_like(number, count))
    out = torch.zeros(count + 1, dtype=torch.long, device=flat.device)
    return out.scatter_(0, slot, torch.arange(flat.numel(), device=flat.device))[:count]


def place_checked_embeddings(text_embeddings: torch.Tensor, input_ids: torch.Tensor,
                             vision_embeddings: torch.Tensor, *, token_id: int) -> torch.Tensor:
    """`merge_vision_embeddings` for counts already checked on the host (packing's one read): same
    result, no host sync. Shapes as in `merge_vision_embeddings`."""
    positions = placeholder_positions(input_ids, token_id, vision_embeddings.shape[0])
    rows = vision_embeddings.to(text_embeddings.dtype).reshape(-1, *text_embeddings.shape[1:])
    return text_embeddings.index_copy(0, positions, rows)


def sample_boundaries(input_ids: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
    """[N+1] long flat offsets where samples start: packed documents ([1, T] with THD boundaries)
    or dense rows ([B, S]: 0, S, 2S, ...)."""
    if packed_seq_params is not None and input_ids.shape[0] == 1:
        return packed_seq_params.cu_seqlens_q_padded.to(device=input_ids.device, dtype=torch.long)
    rows, length = input_ids.shape[0], input_ids.shape[-1]
    return torch.arange(0, (rows + 1) * length, length, device=input_ids.device)


def check_placeholders_per_sample(
    input_ids: torch.Tensor, boundaries: torch.Tensor, tokens_per_item: list[int], *, token_id: int, field: str,
    items_per_sample: tuple[int, ...] | None = None,
) -> None:
    """Each sample's placeholders must be exactly the tokens of a whole number of its own items.

    Checking only the total would accept a pack where one image's placeholders sit in another
    sample (its embedding would then train the wrong sample). Items are taken in token order: the
    k-th sample owns the items whose tokens follow the previous samples' placeholders.

    Args:
        input_ids: [B, S] / [1, T] full token ids.
        boundaries: [N+1] long flat sample offsets (`sample_boundaries`).
        tokens_per_item: placeholder tokens of each item (image, video, clip) in order.
        items_per_sample: N ints, when the batch says how many items each sample has.

    Raises:
        ValueError: naming the sample, its placeholder count and the items' token counts. One host sync.
    """
    flat = input_ids.reshape(-1)
    positions = torch.nonzero(flat == token_id).flatten()
    owner = torch.bucketize(positions, boundaries[1:], right=True)
    counts = torch.bincount(owner, minlength=boundaries.numel() - 1).tolist()
    item_ends = [0]
    for n in tokens_per_item:
        item_ends.append(item_ends[-1] + n)
    if sum(counts) != item_ends[-1]:
        raise ValueError(f"{sum(counts)} {field} placeholder tokens (id {token_id}) in input_ids but the "
                         f"{len(tokens_per_item)} {field} inputs give {item_ends[-1]} tokens ({tokens_per_item})")
    given = list(items_per_sample) if items_per_sample is not None else None
    if given is not None and len(given) != len(counts):
        raise ValueError(f"{field}s_per_sample has {len(given)} entries but the micro-batch has {len(counts)} samples")
    done_tokens, done_items = 0, 0
    for sample, count in enumerate(counts):
        done_tokens += count
        if done_tokens not in item_ends:
            raise ValueError(f"sample {sample} has {count} {field} placeholder tokens (id {token_id}), which do not "
                             f"cover whole {field}s in order (tokens per {field}: {tokens_per_item}): a placeholder "
                             f"run belongs to another sample or does not match its grid")
        items = item_ends.index(done_tokens) - done_items
        if given is not None and items != given[sample]:
            raise ValueError(f"sample {sample} has {count} {field} placeholder tokens = {items} {field}s, but "
                             f"{field}s_per_sample says {given[sample]}")
        done_items += items
