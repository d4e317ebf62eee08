"""Megatron-LM's `examples/multimodal` LLaVA batches in this package's LLaVA batch format (`from_megatron_lm_batch`).

Read from Megatron-LM's source (d98e8a6): `dataset_helpers.TaskEncoder.batch` / `pack_selected_samples` make the
batch, `train.get_batch` / `forward_step` read it. What it holds, and how each part is read here:

- `tokens` [N, S] int64: collapsed ids (one `IMAGE_TOKEN` per image), right-padded with `tokenizer.pad`;
- `labels` [N, S + 1] int64: NOT next-token targets. `tokenize_conversation` returns `target = tokens.copy()`
  with the system / user turns set to -100 (aligned with the tokens); `batch` pads them with `tokenizer.pad`
  one column wider, and `get_batch` shifts them: `labels[:, 1:S + 1]`, its loss mask 0 where that target is
  -100 or `tokenizer.pad`. The same shift and mask are made here, once, so the packer takes the result as
  next-token targets (`label_style="megatron"`); read as Hugging Face labels they would be shifted again;
- `imgs` [tiles, C, H, W] float and `num_tiles` [I] int32, every sample's images in order; a text-only batch
  has the dummies `imgs = [[0.]]` and `num_tiles = [[0]]` (both [1, 1], as `get_batch` tests `imgs`). They
  become `images` and `num_image_tiles`, in the same order (the rows keep theirs, so no tile changes image);
- `cu_lengths` / `max_lengths`: the dummies [[0]] unless Energon packed (`packing_buffer_size`): then
  `cu_lengths` [N, P + 1] are each pack's cumulative sample lengths in LLaVA's EXPANDED space
  (`total_len = text + tiles * num_image_embeddings_per_tile - images`) and `max_lengths` [N] the longest.
  Each pack is cut back into its samples (`_documents_of_pack`: a boundary must fall after a whole collapsed
  slot of this model's expansion, `LlavaSpace.img_seq_len` per tile, else a ValueError), which the step then
  packs as any rows: aligned for the layout, one pad slot before each image-opening sample (bug class 13).
  Megatron-LM shifts the labels across its pack, so the last token of each sample learns the next sample's
  first label (bug class 8; `tokenize_conversation` always masks it: a conversation opens with a system or user
  turn); here each sample's last token has no target, as it has alone;
- `__key__`, `__restore_key__`, `__subflavor__`, `__subflavors__`: Energon's sample identity, which
  `get_batch` does not read either: left out here. Any other key is a ValueError naming it.

Real lengths: the batch records none, and its padding is `tokenizer.pad`, which may be a real id. A row's
trailing slots holding `pad` whose own label and next-token target are both masked are left out
(`_inert`): exact, since under causal attention no earlier token sees them and `get_batch` trains none of
them (nor the target of the token before). So `pad_id` (`tokenizer.pad`) is required: it also masks the targets
`get_batch` masks. Reads the batch on the host (Megatron-LM's loader yields it in host memory): run before
the move to the device, it costs no device sync. Pure: the batch given is not changed.

Shape legend: N = rows (packs), S = row length, R = samples (rows out), L = longest sample, I = images.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.checks import IGNORE_INDEX, is_integer_tensor

MEGATRON_LM_KEYS = ("tokens", "labels", "imgs", "num_tiles", "cu_lengths", "max_lengths")  # TaskEncoder.batch's
ENERGON_SAMPLE_KEYS = ("__key__", "__restore_key__", "__subflavor__", "__subflavors__")  # identity, not inputs
_MARKERS = ("imgs", "num_tiles", "cu_lengths", "max_lengths")  # names no other batch format here uses


def is_megatron_lm_batch(batch) -> bool:
    """`batch` carries a key only Megatron-LM's examples/multimodal collate output has."""
    return isinstance(batch, Mapping) and any(key in batch for key in _MARKERS)


def from_megatron_lm_batch(batch, *, img_seq_len: int, image_token_index: int, label_style: str,
                           pad_id: int | None):
    """`batch` (Megatron-LM examples/multimodal's collate output) as right-padded sample rows; any other batch as it is.

    Args:
        batch: `TaskEncoder.encode_batch`'s dict (see the module docstring).
        img_seq_len, image_token_index: the model's (`LlavaSpace`): how a pack's expanded `cu_lengths` map
            onto its collapsed tokens.
        label_style: the step's; must be "megatron" (the targets built here are next-token targets).
        pad_id: the Megatron-LM tokenizer's `pad` (`get_tokenizer().pad`), what `TaskEncoder.batch` pads with.

    Returns:
        {"input_ids": [R, L], "labels": [R, L] next-token targets (-100: none), "attention_mask": [R, L],
        "images", "num_image_tiles" (absent without images)}: one row per sample.

    Raises:
        ValueError: naming the field and the numbers: label_style "hf", no `pad_id`, a key the format does not
            have, a field of another shape, image tokens that do not match `num_tiles`, or pack boundaries that
            do not fall on this model's expanded slots or disagree with `max_lengths`.
    """
    if not is_megatron_lm_batch(batch):
        return batch
    _check_options(label_style, pad_id, image_token_index)
    tokens, labels, images, tiles = _fields(batch)
    if int((tokens == image_token_index).sum()) != len(tiles):
        raise ValueError(f"tokens hold {int((tokens == image_token_index).sum())} image tokens (id "
                         f"{image_token_index}, LLaVAModel.image_token_index) but num_tiles lists {len(tiles)} images")
    masked_labels = (labels == pad_id) | (labels == IGNORE_INDEX)  # [N, S + 1], get_batch's loss mask, unshifted
    targets = torch.where(masked_labels[:, 1:], IGNORE_INDEX, labels[:, 1:])  # [N, S]: get_batch's shift, once
    inert = (tokens == pad_id) & masked_labels[:, :-1] & masked_labels[:, 1:]  # [N, S]
    packs = _pack_boundaries(batch, tokens.shape[0])
    if packs is None:
        documents = [(row, 0, _trimmed_end(inert[row], 0, tokens.shape[1])) for row in range(tokens.shape[0])]
    else:
        widths = torch.ones_like(tokens)
        widths[tokens == image_token_index] = torch.tensor(tiles, dtype=widths.dtype) * img_seq_len
        documents = [doc for row, (cu, longest) in enumerate(packs)
                     for doc in _documents_of_pack(row, cu, longest, widths[row], targets[row], inert[row],
                                                   tokens[row] == image_token_index, img_seq_len)]
    rows = _rows(tokens, targets, documents, pad_id)
    if images is not None:
        rows["images"], rows["num_image_tiles"] = images, torch.tensor(tiles, dtype=torch.int32)
    return rows


def _check_options(label_style: str, pad_id, image_token_index: int) -> None:
    if label_style != "megatron":
        raise ValueError(
            f"this batch is Megatron-LM examples/multimodal's collate output (imgs / num_tiles / cu_lengths): its "
            f"labels [N, S + 1] are shifted here as its get_batch shifts them (labels[:, 1:S + 1]), into next-token "
            f"targets; label_style={label_style!r} would shift them again: use make_forward_step("
            f"label_style='megatron', megatron_lm_pad_id=get_tokenizer().pad)")
    if pad_id is None:
        raise ValueError("this batch is Megatron-LM examples/multimodal's collate output, padded with the tokenizer's "
                         "pad id, which its get_batch also masks as a target: pass make_forward_step("
                         "megatron_lm_pad_id=get_tokenizer().pad)")
    if not is_int(pad_id) or pad_id == image_token_index:
        raise ValueError(f"megatron_lm_pad_id must be the tokenizer's pad id (an int, not LLaVA's image token "
                         f"{image_token_index}), got {pad_id!r}")


def _fields(batch: Mapping):
    """(tokens [N, S] long, labels [N, S + 1] long, images or None, tiles per image as host ints), checked."""
    unknown = sorted(set(batch) - set(MEGATRON_LM_KEYS) - set(ENERGON_SAMPLE_KEYS), key=str)
    missing = [key for key in MEGATRON_LM_KEYS if batch.get(key) is None]
    if unknown or missing:
        raise ValueError(f"a Megatron-LM examples/multimodal batch has exactly {list(MEGATRON_LM_KEYS)} (and Energon's "
                         f"{list(ENERGON_SAMPLE_KEYS)}), as TaskEncoder.batch makes it: unknown {unknown}, missing "
                         f"{missing} (give such a batch as it is, or one in this package's format, not a mix)")
    tokens, labels = batch["tokens"], batch["labels"]
    for name, value in (("tokens", tokens), ("labels", labels)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or not is_integer_tensor(value):
            raise ValueError(f"{name} must be a [N, S] integer tensor, got {_described(value)}")
    if labels.shape != (tokens.shape[0], tokens.shape[1] + 1):
        raise ValueError(f"labels must be [N, S + 1] = [{tokens.shape[0]}, {tokens.shape[1] + 1}] beside tokens "
                         f"{list(tokens.shape)} (TaskEncoder.batch's extra column for get_batch's shift), got "
                         f"{list(labels.shape)}")
    images, tiles = _media(batch["imgs"], batch["num_tiles"])
    return tokens.cpu().long(), labels.cpu().long(), images, tiles


def _media(imgs, num_tiles):
    """(images [tiles, C, H, W] or None for the text-only dummies, tiles per image as host ints), checked."""
    for name, value in (("imgs", imgs), ("num_tiles", num_tiles)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {_described(value)}")
    if tuple(imgs.shape) == (1, 1):  # get_batch's test for a text-only batch
        if tuple(num_tiles.shape) != (1, 1):
            raise ValueError(f"imgs is the text-only dummy [[0]] but num_tiles is {list(num_tiles.shape)}, not [[0]]")
        return None, []
    if imgs.dim() != 4 or num_tiles.dim() != 1 or not is_integer_tensor(num_tiles):
        raise ValueError(f"imgs must be [tiles, C, H, W] and num_tiles [images] integers, got {_described(imgs)} and "
                         f"{_described(num_tiles)}")
    tiles = num_tiles.tolist()
    if sum(tiles) != imgs.shape[0] or min(tiles, default=1) < 1:
        raise ValueError(f"num_tiles {tiles} (each >= 1) must sum to the {imgs.shape[0]} tiles of imgs")
    return imgs, tiles


def _pack_boundaries(batch: Mapping, rows: int) -> list[tuple[list[int], int]] | None:
    """Each pack's `cu_lengths` and `max_lengths` as host ints, or None for the dummies (no packing)."""
    cu, longest = batch["cu_lengths"], batch["max_lengths"]
    if isinstance(cu, torch.Tensor) and tuple(cu.shape) == (1, 1):  # get_batch's test for "not packed"
        return None
    if not isinstance(cu, torch.Tensor) or cu.dim() != 2 or cu.shape[0] != rows or not is_integer_tensor(cu):
        raise ValueError(f"cu_lengths must be the dummy [[0]] or [N, P + 1] = [{rows}, P + 1] integers, got "
                         f"{_described(cu)}")
    if not isinstance(longest, torch.Tensor) or tuple(longest.shape) != (rows,):
        raise ValueError(f"max_lengths must be [N] = [{rows}] beside cu_lengths {list(cu.shape)}, got "
                         f"{_described(longest)}")
    return list(zip(cu.tolist(), longest.tolist()))


def _documents_of_pack(row: int, cu: list[int], longest: int, widths, targets, inert, is_image,
                       img_seq_len: int) -> list[tuple[int, int, int]]:
    """(row, start, end) in collapsed slots of each sample of one pack; the last slot's target of each is dropped
    (in `targets`, in place: it is the next sample's first label) and trailing inert slots (FP8 padding) left out.

    Args:
        cu: the pack's expanded cumulative lengths. widths: [S] expanded width of each collapsed slot.
        targets: [S] next-token targets. inert, is_image: [S] bool.
    """
    ends = torch.cumsum(widths, 0)  # [S] expanded end of each collapsed slot
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > int(ends[-1]):
        raise ValueError(f"cu_lengths[{row}] {cu} must rise from 0 to at most the pack's {int(ends[-1])} expanded "
                         f"tokens (img_seq_len={img_seq_len} per tile)")
    if longest != max(b - a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"max_lengths[{row}] is {longest} but the longest sample of cu_lengths[{row}] {cu} has "
                         f"{max(b - a for a, b in zip(cu, cu[1:]))} tokens")
    bounds = torch.searchsorted(ends, torch.tensor(cu, dtype=ends.dtype), right=True).tolist()  # slots ending <= cu
    off = [k for k, (b, c) in enumerate(zip(bounds, cu)) if c and int(ends[b - 1]) != c]
    if off:
        k = off[0]
        raise ValueError(f"cu_lengths[{row}][{k}] = {cu[k]} falls inside collapsed slot {bounds[k]} (an image of "
                         f"{int(widths[bounds[k]])} embeddings): the pack's lengths were counted with another number "
                         f"of embeddings per tile than this LLaVAModel's img_seq_len={img_seq_len} (the TaskEncoder's "
                         f"num_image_embeddings_per_tile must equal it)")
    rest = slice(bounds[-1], None)  # after the last sample: get_batch trains and expands whatever is there
    if bool(is_image[rest].any()) or bool((targets[rest] != IGNORE_INDEX).any()):
        raise ValueError(f"pack {row}: the slots after its last sample (cu_lengths[{row}][-1] = {cu[-1]}) hold "
                         f"{int(is_image[rest].sum())} image tokens and {int((targets[rest] != IGNORE_INDEX).sum())} "
                         f"targets: they belong to no sample")
    documents = []
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            targets[end - 1] = IGNORE_INDEX  # never the next sample's first label (bug class 8)
        documents.append((row, start, _trimmed_end(inert, start, end)))
    return documents


def _trimmed_end(inert, start: int, end: int) -> int:
    """`end` less the trailing run of inert slots in [start, end): pads no kept token sees and nothing trains."""
    kept = torch.nonzero(~inert[start:end])
    return start + (int(kept[-1]) + 1 if kept.numel() else 0)


def _rows(tokens, targets, documents: list[tuple[int, int, int]], pad_id: int) -> dict:
    """The documents as right-padded rows: ids (`pad_id` after each), targets (-100 after), attention mask."""
    lengths = torch.tensor([end - start for _, start, end in documents])  # [R]
    width = max(int(lengths.max()), 1)
    offsets = torch.arange(width)
    keep = offsets[None, :] < lengths[:, None]  # [R, L]
    rows = torch.tensor([row for row, _, _ in documents])[:, None].expand(-1, width)
    slots = (torch.tensor([start for _, start, _ in documents])[:, None] + offsets).clamp(max=tokens.shape[1] - 1)
    return {"input_ids": torch.where(keep, tokens[rows, slots], pad_id),
            "labels": torch.where(keep, targets[rows, slots], IGNORE_INDEX), "attention_mask": keep.long()}


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__
