"""`pack_llava_batch`: a LLaVA micro-batch packed so that its expansion is exact and aligned.

The rows are read and checked by `pack_batch`'s own functions (same lengths / label-shift / value
checks as every other model, `packing.rows`), then packed onto `llava_pack_plan`'s slots: pad slots
where the expanded documents need them for CP / the shard factor, and one before every document that
opens with an image (the slot LLaVA zeroes). See models/llava.py for the rules. One host sync: the
lengths, every check and each row's images / expansion / tiles are read back together.
`LlavaPackingCollator` does the same in the DataLoader's workers (no sync left in the step).

Shape legend: B = rows, S = row length, T = planned collapsed slots, I = images.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from megatron_vlm_packing.models.llava import LlavaPackPlan, LlavaSpace, llava_pack_plan
from megatron_vlm_packing.models.llava_expansion import image_expansion
from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.packing.bounds import INT64_MAX, int_entries, is_int
from megatron_vlm_packing.packing.media import check_floating_media
from megatron_vlm_packing.packing.micro_batch import BatchStats, IdsMark, MicroBatch, VisionInputs, boundaries_mark

_IMAGE_KEYS = ("images", "pixel_values")
# Every key the LLaVA packers read (position_ids: checked to count 0..n-1, then made per sample).
LLAVA_BATCH_KEYS = frozenset({"input_ids", "tokens", "labels", "loss_mask", "attention_mask", "seq_lens",
                              "position_ids", "num_image_tiles", *_IMAGE_KEYS})
IGNORE_INDEX = -100
READER = "pack_llava_batch/pad_llava_batch"  # who reads a LLaVA batch, in `rows.check_dense_tensors`' errors


def _images(batch: dict) -> torch.Tensor | None:
    given = [k for k in _IMAGE_KEYS if batch.get(k) is not None]
    if len(given) > 1:
        raise ValueError(f"the batch has both {given}: pass LLaVA's image tiles under one key")
    if not given:
        return None
    images = batch[given[0]]
    # A list of tiles was an AttributeError (.shape) here, a 1D tensor one deep in the vision tower.
    if not isinstance(images, torch.Tensor) or (images.dim() != 4 and images.numel() > 0):
        raise ValueError(f"{given[0]} must be one [tiles, C, H, W] tensor, got "
                         f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}")
    check_floating_media(images, given[0])
    return images


def _llava_row_values(batch: dict, ids: torch.Tensor, keep: torch.Tensor, space: LlavaSpace):
    """What the expanded-space plan needs from the device, as one [3B + 1 (+ I)] long tensor to read
    with the lengths: per row the images, the extra embeddings and whether it opens with an image;
    the image tokens in padding; and the tiles of every image when `num_image_tiles` is given.

    Returns:
        (values, tiles [I] int tensor or None when omitted).
    """
    is_image = ids == space.image_token_index  # [B, S]
    given = batch.get("num_image_tiles")
    if given is None:  # LLaVA's default: one tile per image
        extra, tiles = is_image.long() * (space.img_seq_len - 1), None
    else:
        if isinstance(given, (list, tuple, range)):  # [True, 2] was an int64 tensor to torch: True read as 1 tile
            given = int_entries(given, "num_image_tiles", "tile counts")
            big = next((i for i, t in enumerate(given) if t > INT64_MAX), None)
            if big is not None:  # torch's "Overflow when unpacking long long" named neither field nor entry
                raise ValueError(f"num_image_tiles entry {big} is {given[big]}: tile counts must be at most 2**63 - 1")
        tiles = torch.as_tensor(given, device=ids.device).reshape(-1)
        # .int() would truncate 1.5 tiles to 1 and read True as 1 tile, silently. An empty list is
        # float32 to torch (no images): not refused.
        if tiles.numel() and not is_integer_tensor(tiles):
            raise ValueError(f"num_image_tiles must hold integer tile counts, got dtype {tiles.dtype}")
        # Read as given (int64): cast to int32 first, 2**32 + 2 tiles were read back as 2, silently. Counts that
        # pass the read's checks sum to the images' tiles, so the int32 ones handed on are exact.
        tiles = tiles.long()
        extra = image_expansion(ids, tiles, img_seq_len=space.img_seq_len, image_token_index=space.image_token_index,
                                check=False)  # meaningful once the counts agree (checked after the read)
    parts = [is_image.sum(1), extra.sum(1), is_image[:, 0].long(), (is_image & ~keep).sum().reshape(1)]
    if tiles is None:
        return torch.cat([p.long() for p in parts]), None
    return torch.cat([p.long() for p in parts] + [tiles]), tiles.int()


def _llava_rows(values: list[int], rows: int, tiles, images, device):
    """`_llava_row_values` read back, checked against the image tiles given.

    Returns:
        (tiles [I] int tensor, tiles as host ints, images per row, expansion per row, opens per row).
    """
    per_row, expansion = values[:rows], values[rows:2 * rows]
    opens, stray = [bool(v) for v in values[2 * rows:3 * rows]], values[3 * rows]
    if stray:
        raise ValueError(f"{stray} image tokens lie in the padding of the rows (outside the real lengths)")
    n_images, tiles_given = sum(per_row), tiles is not None
    host_tiles = values[3 * rows + 1:] if tiles is not None else [1] * n_images
    if tiles is None:
        tiles = torch.ones(n_images, dtype=torch.int, device=device)
    if len(host_tiles) != n_images:
        raise ValueError(f"{n_images} image tokens in input_ids but {len(host_tiles)} entries in num_image_tiles")
    bad = [(i, t) for i, t in enumerate(host_tiles) if t < 1]
    if bad:  # 0 tiles made an image token expand to -1 embeddings: every expanded length shrank, silently
        raise ValueError(f"num_image_tiles must be >= 1 per image: images {[i for i, _ in bad][:8]} have "
                         f"{[t for _, t in bad][:8]} tiles")
    count = 0 if images is None else images.shape[0]
    if count != sum(host_tiles):
        if tiles_given:
            raise ValueError(f"num_image_tiles sums to {sum(host_tiles)} tiles but the images hold {count}")
        # Without num_image_tiles, naming it would name a field the batch does not have.
        raise ValueError(f"{n_images} image tokens in input_ids (one tile each: no num_image_tiles given) but "
                         f"the images hold {count} tiles")
    return tiles, tuple(host_tiles), per_row, expansion, opens


def _read_rows(batch: dict, space: LlavaSpace, label_style: str):
    """The rows, their labels and loss weights, checked, and the expanded-space facts: ONE host sync.

    `pack_batch`'s own reading (`packing.rows`: the deferred mask, the value checks of ids, labels
    and loss weights) queues its numbers on one `DeferredChecks`; `_llava_row_values` joins them and
    everything is read back together.

    Returns:
        (ids [B, S] long, labels [B, S] next-token targets, weights [B, S] float, row lengths,
        `_llava_rows`'s tuple).
    """
    from megatron_vlm_packing.packing.rows import (
        Rows, check_1d_positions, check_dense_tensors, input_ids_of, queue_row_reads, row_tensor,
    )

    check_dense_tensors(batch, READER)  # first, as pack_batch: a sparse or meta image packed, unread
    unread = sorted((k for k in batch if k not in LLAVA_BATCH_KEYS and batch[k] is not None), key=str)
    if unread:  # were dropped silently: document_lengths too (a pre-packed row trained as one document)
        raise ValueError(f"LLaVA's packers do not read {unread}: it would be dropped silently; they take "
                         f"{sorted(LLAVA_BATCH_KEYS)}, one row per sample (Megatron-LM examples/multimodal batches: "
                         f"through make_forward_step(megatron_lm_pad_id=...), models.llava_mlm_batch)")
    images = _images(batch)  # refused (shape, dtype) before the read
    name, ids = input_ids_of(batch)
    shape = tuple(ids.shape)
    # LLaVAModel never embeds its image token (the default, DEFAULT_IMAGE_TOKEN_INDEX = -200, is negative):
    # the id screen (ids in [0, space.vocab_size)) refused every batch of such a model. It screens the
    # text ids only; the image tokens are counted and placed from `ids` itself below.
    image, vocab = space.image_token_index, space.vocab_size
    outside = image < 0 or (vocab is not None and image >= vocab)
    screened = ids.masked_fill(ids == space.image_token_index, 0) if outside else ids
    queued = queue_row_reads(batch, screened, name, label_style, space.vocab_size)
    llava, tiles = _llava_row_values(batch, ids, queued.mask.keep, space)
    llava_entry = queued.checks.add(llava, lambda v: False, None)
    host = queued.checks.read()  # the one host sync
    rows = Rows(input_ids=ids, mask=queued.mask, lengths=queued.lengths(host), raw_labels=queued.raw_labels,
                label_style=label_style, loss_values=queued.loss_values, positions=None, vision=None, audio=None)
    if batch.get("position_ids") is not None:  # a read of its own, only when given
        check_1d_positions(row_tensor(batch, "position_ids", shape), rows.keep)
    return ids, rows.labels, rows.loss_weights, rows.lengths, _llava_rows(host[llava_entry], shape[0], tiles,
                                                                            images, ids.device)


def llava_pad_to(pad_to, space: LlavaSpace) -> int | None:
    """The expanded length a pack must have: `pad_to` (a Python int), else LLaVA's pipeline length under
    PP, else None (the next multiple of the shard factor). The one check of `pad_to` against PP, for
    `pack_llava_batch` and for a micro-batch packed in the DataLoader (`check_loader_micro_batch`).

    Raises:
        ValueError: `pad_to` not an int (`checked_pad_to`: a float was a TypeError deep in the plan), or
            under PP another length than `space.pipeline_length`: LLaVAModel pads every row to it whatever
            we plan, so a pack planned to another length would get boundaries that do not end where the
            sequence does.
    """
    from megatron_vlm_packing.packing.plan import checked_pad_to

    pad_to = checked_pad_to(pad_to)
    if pad_to is not None and space.pipeline_length is not None and pad_to != space.pipeline_length:
        raise ValueError(f"pad_to={pad_to} but under pipeline parallelism LLaVAModel pads every row to "
                         f"language_max_sequence_length={space.pipeline_length}: leave pad_to None or set it to that")
    return pad_to if pad_to is not None else space.pipeline_length


def checked_llava_pad_token_id(pad_token_id, space: LlavaSpace) -> int:
    """`pad_token_id` as a Python int (`rows.check_pad_token_id`, below `space.vocab_size` when known), and not
    `space`'s image token.

    Raises:
        ValueError: a bad id, one outside the vocabulary, or LLaVA's image token: LLaVAModel would expand every
            pad slot into an image.
    """
    from megatron_vlm_packing.packing.rows import check_pad_token_id

    pad_token_id = check_pad_token_id(pad_token_id, space.vocab_size)
    if pad_token_id == space.image_token_index:
        raise ValueError(f"pad_token_id={pad_token_id} is LLaVA's image token: pad slots would become images")
    return pad_token_id


def _vision_inputs(batch: Mapping, images_per_row, tiles) -> VisionInputs | None:
    """The batch's images (`images` or `pixel_values`) with their counts per row and tiles, or None without any."""
    images = _images(batch)
    if images is None or images.shape[0] == 0:
        return None
    return VisionInputs(pixel_values=images, images_per_sample=tuple(images_per_row), num_image_tiles=tiles)


def check_loader_micro_batch(micro_batch: MicroBatch, space: LlavaSpace, options) -> None:
    """A micro-batch packed in the DataLoader (`LlavaPackingCollator`) is what the step's options ask
    for in LLaVA's expanded space, as `models.adapter.check_loader_shape` checks other models' (their
    `pad_to` is a collapsed length, LLaVA's an expanded one); host ints of its plan only (no sync).

    Args:
        micro_batch: planned by `pack_llava_batch` (a `LlavaPackPlan`) for `space`, the model's (the
            caller compares the spaces). options: the step's `StepOptions`.

    Raises:
        ValueError: the step is dense (`pack=False`), its `pad_to` disagrees with PP (`llava_pad_to`),
            or the pack expands to another length than `pad_to` / the pipeline length.
    """
    from megatron_vlm_packing.models.adapter import check_loader_kind

    check_loader_kind(micro_batch, options)
    wanted = llava_pad_to(options.pad_to, space)
    expanded = sum(micro_batch.plan.expanded_physical)
    if wanted is not None and expanded != wanted:
        name = f"pad_to={options.pad_to}" if options.pad_to is not None else \
            f"pipeline parallelism (language_max_sequence_length={space.pipeline_length})"
        raise ValueError(f"the packed micro-batch from the data iterator expands to {expanded} tokens but the step "
                         f"needs {wanted} ({name}): build the LlavaPackingCollator with pad_to={wanted}")


def pack_llava_batch(batch: dict, space: LlavaSpace, *, label_style: str = "megatron", pad_to: int | None = None,
                     pad_token_id: int = 0) -> MicroBatch:
    """Pack a right-padded LLaVA micro-batch for `LLaVAModel` with `space` (`LlavaSpace.of(model)`).

    Args:
        batch: `input_ids` (or `tokens`) [B, S] with one `space.image_token_index` per image, `labels`
            (Megatron style, or Hugging Face style with label_style="hf"), optional `loss_mask`,
            `attention_mask` / `seq_lens` for the real lengths, `images` (or `pixel_values`)
            [tiles, C, H, W], `num_image_tiles` [I] (absent: one tile per image), [B, S] `position_ids`
            (0..n-1 on real tokens, else a ValueError; made per document); any other key is a ValueError.
        pad_to: the expanded length wanted (default: LLaVA's pipeline length under PP, else the
            next multiple of its shard factor).

    Returns:
        MicroBatch in collapsed space ([1, T] ids, labels, loss mask, 1D positions restarting per
        document, padding mask) whose `packed_seq_params` are the collapsed boundaries and whose
        `plan` is a `LlavaPackPlan` (the patch expands the boundaries from it); `stats` count
        expanded tokens (what attention computes). One host sync.
    """
    from megatron_vlm_packing.packing import make_packed_seq_params, pack_rows, plan_indices, segment_positions

    pad_token_id = checked_llava_pad_token_id(pad_token_id, space)
    pad_to = llava_pad_to(pad_to, space)
    ids, labels, weights, row_lengths, llava = _read_rows(batch, space, label_style)
    tiles, host_tiles, images_per_row, row_expansion, opens = llava
    plan = llava_pack_plan(row_lengths, row_capacity=ids.shape[1], row_expansion=row_expansion,
                           opens_with_image=opens, space=space, pad_to=pad_to)
    docs = plan.segment_rows
    plan = LlavaPackPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}, space=space,
                         tiles=host_tiles, images_per_document=tuple(images_per_row[b] for b in docs),
                         expansion=tuple(row_expansion[b] for b in docs),
                         opens_with_image=tuple(opens[b] for b in docs))
    indices = plan_indices(plan, ids.device)
    vision = _vision_inputs(batch, images_per_row, tiles)
    expanded_rows = [n + e for n, e in zip(row_lengths, row_expansion)]
    stats = BatchStats(real_tokens=sum(expanded_rows), physical_tokens=plan.total + sum(row_expansion),
                       row_tokens=len(row_lengths) * max(expanded_rows))
    loss_mask = pack_rows(weights, indices)  # its weights were checked in the rows' read
    packed_labels = pack_rows(labels, indices, pad_value=IGNORE_INDEX)  # checked in the rows' read too
    positions = segment_positions(indices)  # restarting per document of the plan
    params = make_packed_seq_params(plan, indices)  # the plan's (collapsed; the patch expands them)
    packed_ids = pack_rows(ids, indices, pad_value=pad_token_id)  # its text ids were checked in the rows' read
    return MicroBatch(
        input_ids=packed_ids, checked_ids=IdsMark(packed_ids, space.vocab_size, space.image_token_index),
        labels=packed_labels, checked_labels=packed_labels, loss_mask=loss_mask, checked_loss_mask=loss_mask,
        checked_vocab_size=space.vocab_size,
        position_ids=positions, checked_positions=positions, padding_mask=~indices.is_real[None],
        packed_seq_params=params, checked_boundaries=boundaries_mark(params), rope_cu_seqlens=indices.cu_seqlens,
        stats=stats,
        vision=vision, plan=plan, indices=indices,
    )


def _dense_length(width: int, longest_real: int, most_expansion: int, shard: int, seq_length) -> int:
    """L, the collapsed row length: `seq_length` (checked), else the batch's width grown so that the
    expanded rows (L + most_expansion) divide by LLaVA's shard factor (megatron-core 0.16.1's batched
    SP / CP path asserts it; 0.19 pads them itself, to the same effect)."""
    if seq_length is None:
        return width + (-(width + most_expansion)) % shard
    if not is_int(seq_length) or seq_length < longest_real:
        raise ValueError(f"seq_length={seq_length!r} must be an int >= the longest row's {longest_real} real tokens")
    if (seq_length + most_expansion) % shard:
        raise ValueError(f"seq_length={seq_length} expands to {seq_length + most_expansion} tokens per row, not a "
                         f"multiple of LLaVA's shard factor {shard}: use a seq_length with (seq_length + "
                         f"{most_expansion}) % {shard} == 0, or leave it None")
    return int(seq_length)


def pad_llava_batch(batch: dict, space: LlavaSpace, *, label_style: str = "megatron", seq_length: int | None = None,
                    pad_token_id: int = 0) -> MicroBatch:
    """A dense (right-padded rows) LLaVA micro-batch: LLaVA's own batched path, through the step
    (`make_forward_step(pack=False)`), to compare with packing. Same reading and checks as
    `pack_llava_batch` (one host sync); LLaVA expands each row and pads the rows itself.

    Args:
        batch: as for `pack_llava_batch`.
        seq_length: collapsed row length (default: the batch's); shorter than a real row is refused.

    Returns:
        MicroBatch with [B, L] ids (pad slots `pad_token_id`), next-token labels (-100 at pads), loss
        weights, positions arange(L) per row, padding mask, no `packed_seq_params`, `plan` a
        `LlavaRows`; `stats` count expanded tokens (real, and the rows LLaVA computes).

    Raises:
        ValueError: as `pack_llava_batch`, `seq_length` shorter than a row, or a row longer after
            expansion than LLaVA keeps (it would truncate it silently).
    """
    from megatron_vlm_packing.models.llava import LlavaRows
    from megatron_vlm_packing.packing.indices import _to_device

    pad_token_id = checked_llava_pad_token_id(pad_token_id, space)
    ids, labels, weights, row_lengths, llava = _read_rows(batch, space, label_style)
    tiles, host_tiles, images_per_row, row_expansion, _ = llava
    rows, width = ids.shape
    length = _dense_length(width, max(row_lengths), max(row_expansion), space.total_multiple, seq_length)
    expanded = [n + e for n, e in zip(row_lengths, row_expansion)]
    longest = length + max(row_expansion)  # what LLaVA pads its expanded rows to
    if space.max_length is not None and longest > space.max_length:
        raise ValueError(f"rows expand to {longest} tokens, more than language_max_sequence_length={space.max_length}: "
                         f"LLaVAModel would truncate them silently; shorten seq_length or split the micro-batch")
    keep = torch.arange(length, device=ids.device)[None] < _to_device(torch.tensor(row_lengths), ids.device)[:, None]

    def rows_of(x, pad):  # [B, S] -> [B, L], pad slots `pad`
        x = torch.nn.functional.pad(x, (0, length - width), value=pad) if length > width else x
        return torch.where(keep, x, torch.as_tensor(pad, dtype=x.dtype, device=x.device))

    vision = _vision_inputs(batch, images_per_row, tiles)
    rows_expanded = rows * (space.pipeline_length or longest)
    loss_mask = rows_of(weights, 0.0)  # its weights were checked in the rows' read
    padded_labels = rows_of(labels, IGNORE_INDEX)  # checked in the rows' read too
    positions = torch.arange(length, device=ids.device)[None].expand(rows, length)  # one document per row
    row_ids = rows_of(ids, pad_token_id)  # its text ids were checked in the rows' read
    return MicroBatch(
        input_ids=row_ids, checked_ids=IdsMark(row_ids, space.vocab_size, space.image_token_index),
        labels=padded_labels, loss_mask=loss_mask,
        checked_loss_mask=loss_mask, checked_labels=padded_labels, checked_vocab_size=space.vocab_size,
        position_ids=positions, checked_positions=positions, padding_mask=~keep,
        packed_seq_params=None, rope_cu_seqlens=None, vision=vision,
        stats=BatchStats(real_tokens=sum(expanded), physical_tokens=rows_expanded, row_tokens=rows_expanded),
        plan=LlavaRows(tiles=host_tiles, expanded_lengths=tuple(expanded)),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlavaPackingCollator:
    """`collate_fn` packing LLaVA micro-batches in the DataLoader's workers (`pack_llava_batch` on the CPU).

    The step then only moves the micro-batch (non-blocking): its `LlavaPackPlan` carries, as host
    ints, everything the adapter checks and the expanded boundaries are built from, so nothing on
    the step's path is read back to the host (LLaVAModel's own expansion aside).

        space = LlavaSpace.of(model)  # the model's (or any stage's) img_seq_len, image token, CP/SP/PP
        loader = DataLoader(dataset, batch_size=8, num_workers=4, pin_memory=True,
                            collate_fn=LlavaPackingCollator(space=space, collate=my_collate))

    Attributes:
        space: `LlavaSpace.of(model)`; fp8 joins FP8's total multiple, as `make_forward_step(fp8=True)`.
        collate: samples -> a collated, right-padded batch dict (what `pack_llava_batch` takes);
            None when the dataset already yields batch dicts.
        label_style, pad_to, pad_token_id: passed to `pack_llava_batch` (`pad_to`: expanded length).
    """

    space: LlavaSpace
    collate: Callable[[list], dict] | None = None
    fp8: bool = False
    label_style: str = "hf"
    pad_to: int | None = None
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        from megatron_vlm_packing.packing.collate import check_collate
        from megatron_vlm_packing.packing.rows import check_pack_arguments

        # Else an AttributeError ('total_multiple') / TypeError (not callable) in a worker at the first batch.
        if not isinstance(self.space, LlavaSpace):
            raise ValueError(f"LlavaPackingCollator's space must be a LlavaSpace (LlavaSpace.of(model)), "
                             f"got {type(self.space).__name__}")
        check_collate(self.collate, "LlavaPackingCollator")
        check_pack_arguments(fp8=self.fp8, label_style=self.label_style, pad_to=self.pad_to,
                             pad_token_id=self.pad_token_id)
        checked_llava_pad_token_id(self.pad_token_id, self.space)  # else at the first batch, in a worker

    def __call__(self, samples):
        from megatron_vlm_packing.models.llava import aligned_space
        from megatron_vlm_packing.packing.collate import for_the_loader
        from megatron_vlm_packing.packing.rows import check_dense_tensors

        batch = self.collate(samples) if self.collate is not None else samples
        # Any mapping, as pack_llava_batch takes: a Hugging Face processor's BatchFeature is a UserDict.
        if not isinstance(batch, Mapping):
            raise ValueError(f"LlavaPackingCollator got {type(batch).__name__}: give collate= (samples -> batch "
                             f"dict), or let the dataset yield batch dicts")
        check_dense_tensors(batch, READER)  # before .cpu(): of a meta tensor a NotImplementedError
        on_host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        packed = pack_llava_batch(on_host, aligned_space(self.space, fp8=self.fp8), label_style=self.label_style,
                                  pad_to=self.pad_to, pad_token_id=self.pad_token_id)
        return for_the_loader(packed, 1)  # LLaVA selects its CP tokens itself, in expanded space
