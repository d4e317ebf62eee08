"""The same samples as a usual LLaVA batch (`llava_reference.collated`, Hugging Face labels), in Megatron-LM's
examples/multimodal batch format, built by its rules (read in its dataset_helpers.TaskEncoder at d98e8a6, not
copied): each sample's `target` is its tokens with the prompt -100 (unshifted), `batch` pads tokens with the
tokenizer's pad and labels with it one column wider; `pack_selected_samples` concatenates samples and records
their EXPANDED cumulative lengths (text + tiles * embeddings per tile - images); FP8 appends pad tokens and -100
labels to the row and adds their number to the last sample's length."""

from __future__ import annotations

import torch

PAD = 0  # the tokenizer's pad id here: no sample's real token (their ids are 1..99 and the image token)
_ENERGON = {"__key__": ["a", "b"], "__restore_key__": [(), ()], "__subflavor__": None}


def samples(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """Each row of a usual batch as (tokens, target (unshifted, -100 at the prompt), its images' tiles)."""
    from megatron_vlm_packing.testing.llava_reference import IMG

    per_row = (batch["input_ids"] == IMG).sum(1).tolist()
    tiles = batch["num_image_tiles"].tolist()
    out, first = [], 0
    for row, n in enumerate(per_row):
        length = int(batch["attention_mask"][row].sum())
        out.append((batch["input_ids"][row, :length], batch["labels"][row, :length], tiles[first:first + n]))
        first += n
    return out


def _media(batch: dict) -> dict:
    if batch["num_image_tiles"].numel() == 0:  # TaskEncoder.batch's text-only dummies
        return {"imgs": torch.tensor([[0.0]]), "num_tiles": torch.tensor([[0]], dtype=torch.int32)}
    return {"imgs": batch["images"], "num_tiles": batch["num_image_tiles"].to(torch.int32)}


def mlm_rows(batch: dict, *, width: int | None = None) -> dict:
    """One right-padded row per sample (no packing: cu_lengths / max_lengths the dummies [[0]])."""
    rows = samples(batch)
    width = width or max(len(tokens) for tokens, _, _ in rows)
    tokens = torch.full((len(rows), width), PAD, dtype=torch.int64)
    labels = torch.full((len(rows), width + 1), PAD, dtype=torch.int64)  # +1: get_batch's shift
    for i, (ids, target, _) in enumerate(rows):
        tokens[i, :len(ids)], labels[i, :len(target)] = ids, target
    dummy = torch.tensor([[0]], dtype=torch.int32)
    return dict(_ENERGON, tokens=tokens, labels=labels, cu_lengths=dummy, max_lengths=dummy.clone(), **_media(batch))


def mlm_pack(batch: dict, img_seq_len: int, *, width: int, fp8_pad: int = 0) -> dict:
    """Every sample in one pack of `width` collapsed slots (+ `fp8_pad` FP8 pads counted in its last sample)."""
    rows = samples(batch)
    lengths = [len(ids) + sum(tiles) * img_seq_len - len(tiles) for ids, _, tiles in rows]  # expanded
    tokens = torch.cat([ids for ids, _, _ in rows])
    labels = torch.cat([target for _, target, _ in rows])
    assert len(tokens) <= width
    ids = torch.full((1, width + fp8_pad), PAD, dtype=torch.int64)
    target = torch.full((1, width + 1 + fp8_pad), PAD, dtype=torch.int64)
    ids[0, :len(tokens)], target[0, :len(labels)] = tokens, labels
    cu = torch.tensor([[0] + torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if fp8_pad:
        target[0, width + 1:] = -100
        cu[0, -1] += fp8_pad  # TaskEncoder.batch's rule: the last sample's length grows by the pads appended
    longest = torch.tensor([int((cu[0, 1:] - cu[0, :-1]).max())], dtype=torch.int32)
    return dict(_ENERGON, tokens=ids, labels=target, cu_lengths=cu, max_lengths=longest, **_media(batch))
