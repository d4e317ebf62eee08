"""Pack right-padded rows into one THD sequence and back, following a `PackIndices`.

Packing copies each document's contiguous slice of its row: one `torch.split` of the flattened
rows into views and one `torch.cat` (a single memcpy-speed pass, one kernel on a GPU), with pad
slots taken from one small filled buffer. No [T] index is built and nothing is read back to the
host: every size is a host int of the plan. Unpacking scatters with `unpack_target`. Everything
keeps autograd (packing embeddings or logits back-propagates to the rows).

Shape legend: B = rows, S = row length, T = physical packed tokens, N = documents, `...` = any
trailing feature dims.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from megatron_vlm_packing.packing.bounds import INT64_MAX, is_int
from megatron_vlm_packing.packing.indices import DocumentSlices, PackIndices
from megatron_vlm_packing.packing.plan import PackPlan


def pack_rows(rows: torch.Tensor, indices: PackIndices, *, pad_value=0) -> torch.Tensor:
    """Pack per-token row data.

    Args:
        rows: [B, S, ...] any dtype.
        indices: from `plan_indices` of the plan made for these rows.
        pad_value: what pad slots hold.

    Returns:
        packed: [1, T, ...], real tokens in document order, `pad_value` at pad slots.
    """
    plan = indices.plan
    if rows.dim() < 2 or tuple(rows.shape[:2]) != (len(plan.row_lengths), plan.row_capacity):
        raise ValueError(f"rows must be [B, S, ...] = [{len(plan.row_lengths)}, {plan.row_capacity}, ...] "
                         f"(the plan's), got shape {tuple(rows.shape)}")
    return _cat_documents(rows, indices.row_slices, pad_value)


def pack_next_token_labels(labels: torch.Tensor, indices: PackIndices, *, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face labels (unshifted) packed as next-token targets, shifted inside each sample.

    Args:
        labels: [B, S] long, HF convention (the target of position s is labels[s+1]).

    Returns:
        [1, T] long: slot t of a document holds its source token's labels[s+1] while s+1 is a real
        token of the same sample, else `ignore_index`; so the last token of a sample never learns
        the first token of the next (bug class 8). One copy of each document's labels[1:n].
    """
    return _cat_documents(labels, indices.next_token_slices, ignore_index)


def _cat_documents(rows: torch.Tensor, slices: DocumentSlices, pad_value) -> torch.Tensor:
    """[1, T, ...]: every document's slice of the flattened `rows` ([B, S, ...]), each followed by its
    pad slots.

    Split and concatenated along dim 1 of [1, B*S, ...], so the result needs no reshape."""
    if rows.shape[0] * rows.shape[1] != slices.flat_length:
        raise ValueError(f"rows hold {rows.shape[0] * rows.shape[1]} tokens but the plan's rows hold "
                         f"{slices.flat_length}")
    if on_host_without_grad(rows):
        return torch.from_numpy(cat_documents_host(rows.numpy().reshape(slices.flat_length, *rows.shape[2:]), slices,
                                                   pad_value)[None])
    flat = rows.reshape(1, slices.flat_length, *rows.shape[2:])  # [1, B*S, ...]
    pieces = flat.split_with_sizes(slices.split_sizes, dim=1)[1::2]  # views of every document's slice
    if not slices.longest_pad:
        return torch.cat(pieces, dim=1)
    pad = torch.full((1, slices.longest_pad, *flat.shape[2:]), pad_value, dtype=flat.dtype, device=flat.device)
    interleaved = []
    for piece, pad_length in zip(pieces, slices.pad_lengths):
        interleaved.append(piece)
        if pad_length:
            interleaved.append(pad[:, :pad_length])
    return torch.cat(interleaved, dim=1)


def on_host_without_grad(tensor: torch.Tensor) -> bool:
    """A CPU tensor numpy can view (no autograd, a dtype numpy has): numpy then does the small ops,
    at about a tenth of a torch call's fixed cost (1 us against 8 to 15 us on one core)."""
    return tensor.is_cpu and not tensor.requires_grad and tensor.dtype in _NUMPY_DTYPES \
        and tensor.layout == torch.strided and not tensor.is_nested  # (sparse and nested tensors have no view)


_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.float16, torch.float32, torch.float64})


def cat_documents_host(rows: np.ndarray, slices: DocumentSlices, pad_value) -> np.ndarray:
    """`_cat_documents` in numpy: [T, ...] every document's slice of the flattened rows ([B*S, ...]),
    each followed by its pad slots (the same values; a slice costs numpy a fraction of a
    microsecond, torch several)."""
    if not slices.longest_pad:
        return np.concatenate([rows[start:stop] for start, stop in slices.spans])
    pad = np.full((slices.longest_pad, *rows.shape[1:]), pad_value, dtype=rows.dtype)
    pieces = []
    for (start, stop), pad_length in zip(slices.spans, slices.pad_lengths):
        pieces.append(rows[start:stop])
        if pad_length:
            pieces.append(pad[:pad_length])
    return np.concatenate(pieces)


def cat_row_prefixes(rows: np.ndarray, plan) -> np.ndarray:
    """[sum of real lengths] every document's real tokens in order: the first `real_lengths[i]` values of
    row `segment_rows[i]` of `rows` ([B, S] of the plan's B and S; any layout numpy can reshape so).

    What `cat_documents_host` packs for a plan without pad slots, with no `DocumentSlices`: in a
    DataLoader worker, building the spans costs more than the copies at a few rows."""
    rows = rows.reshape(len(plan.row_lengths), plan.row_capacity)
    return np.concatenate([rows[row, :n] for row, n in zip(plan.segment_rows, plan.real_lengths)])


def cat_row_next_tokens(rows: np.ndarray, plan, fill) -> np.ndarray:
    """[sum of real lengths] every document's values 1..n-1 of its row, each document's followed by one
    `fill`: Hugging Face labels packed as next-token targets for a plan without pad slots (`rows` [B, S]
    as in `cat_row_prefixes`). What `cat_documents_host` packs with `next_token_slices`, with no
    `DocumentSlices`."""
    rows = rows.reshape(len(plan.row_lengths), plan.row_capacity)
    end = np.full(1, fill, dtype=rows.dtype)
    pieces = []
    for row, n in zip(plan.segment_rows, plan.real_lengths):
        pieces += (rows[row, 1:n], end)
    return np.concatenate(pieces)


def _checked_row_geometry(indices: PackIndices, batch_size: int, row_length: int, plan) -> tuple[int, int]:
    """(B, S) as Python ints (a numpy int's B*S would wrap), which must be the plan's: a wrong row length would
    scatter tokens into the wrong rows."""
    for name, value in (("batch_size", batch_size), ("row_length", row_length)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    batch_size, row_length = int(batch_size), int(row_length)
    if batch_size * row_length > INT64_MAX:  # else a TypeError from allocating the rows (no pad slot to compare)
        raise ValueError(f"unpack_rows got (batch_size, row_length) = {(batch_size, row_length)}, B*S = "
                         f"{batch_size * row_length}, more than torch can index (int64)")
    if plan is not None:
        expected = (len(plan.row_lengths), plan.row_capacity)
        if (batch_size, row_length) != expected:
            raise ValueError(f"unpack_rows got (batch_size, row_length) = {(batch_size, row_length)} but the plan "
                             f"was made for {expected}")
        return batch_size, row_length
    # Pad slots point at the scratch slot B*S of the plan's rows; real slots at b*S + s < B*S.
    top, has_pad = torch.stack([indices.unpack_target.max(), (~indices.is_real).any().long()]).tolist()  # one sync
    limit = batch_size * row_length
    if (has_pad and top != limit) or (not has_pad and top >= limit):
        raise ValueError(f"unpack_rows got (batch_size, row_length) = {(batch_size, row_length)}, B*S = {limit}, "
                         f"but the plan's indices {'put pads at slot' if has_pad else 'reach slot'} {top}: pass the "
                         f"B and S the plan was made for (or plan=)")
    return batch_size, row_length


def _check_unpack_arguments(packed, indices, pad_value, plan) -> None:
    """`unpack_rows`' arguments are what it reads: else an AttributeError, a TypeError or RuntimeError from
    torch, or a pad_value the rows' dtype cannot hold silently cast (1.5 written as 1 into integer rows).

    Raises:
        ValueError: naming the argument and what it got.
    """
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"unpack_rows' packed must be a [1, T, ...] tensor, got {type(packed).__name__}")
    if not isinstance(indices, PackIndices):
        raise ValueError(f"unpack_rows' indices must be the PackIndices of the pack (micro_batch.indices), "
                         f"got {type(indices).__name__}")
    if plan is not None and not isinstance(plan, PackPlan):
        raise ValueError(f"unpack_rows' plan must be the PackPlan of the pack (micro_batch.plan) or None, "
                         f"got {type(plan).__name__}")
    if packed.device != indices.device:
        raise ValueError(f"unpack_rows' packed is on {packed.device} but the indices are on {indices.device}")
    if not isinstance(pad_value, numbers.Complex if packed.is_complex() else numbers.Real):  # a bool is Real
        raise ValueError(f"unpack_rows' pad_value must be a real number (the value of the rows' pad slots), "
                         f"got {pad_value!r}")
    if packed.is_floating_point() or packed.is_complex():
        return
    low, high = (0, 1) if packed.dtype == torch.bool else (torch.iinfo(packed.dtype).min, torch.iinfo(packed.dtype).max)
    if not (float(pad_value).is_integer() and low <= pad_value <= high):
        kind = "booleans" if packed.dtype == torch.bool else "integers"
        raise ValueError(f"pad_value={pad_value!r} cannot be held by the packed {packed.dtype} values "
                         f"({kind} in [{low}, {high}])")


def unpack_rows(
    packed: torch.Tensor, indices: PackIndices, *, batch_size: int, row_length: int, pad_value=0, plan=None
) -> torch.Tensor:
    """Inverse of `pack_rows` on real tokens.

    Args:
        packed: [1, T, ...].
        batch_size, row_length: B and S of the rows the plan was made for (checked: against
            `plan` when given, which is exact; else from the indices, one host sync).

    Returns:
        rows: [B, S, ...], real tokens back in place, `pad_value` everywhere else (empty rows are
        all `pad_value`).
    """
    _check_unpack_arguments(packed, indices, pad_value, plan)
    total = indices.source.numel()
    if packed.dim() < 2 or packed.shape[0] != 1 or packed.shape[1] != total:
        raise ValueError(f"packed must be [1, {total}, ...] (the plan's T), got shape {tuple(packed.shape)}")
    batch_size, row_length = _checked_row_geometry(indices, batch_size, row_length, plan)
    values = packed[0]  # [T, ...]
    out = torch.full(
        (batch_size * row_length + 1, *values.shape[1:]), pad_value, dtype=values.dtype, device=values.device
    )  # one scratch row receives every pad slot
    out = out.index_copy(0, indices.unpack_target, values)
    return out[:-1].reshape(batch_size, row_length, *values.shape[1:])


def segment_positions(indices: PackIndices) -> torch.Tensor:
    """1D positions restarting at 0 in every document.

    Returns:
        position_ids: [1, T] long; pad slots keep counting after their document's real tokens,
        so no pad slot ever looks like the start of a document.
    """
    if indices.device.type == "cpu":  # one crossing from numpy, not a tensor viewed back and forth
        return torch.from_numpy(indices.offset_in_segment_host[None])
    return indices.offset_in_segment.unsqueeze(0)


def pack_positions(positions: torch.Tensor, indices: PackIndices) -> torch.Tensor:
    """Pack precomputed positions ([B, S] or mRoPE [C, B, S]) on the token dim.

    Pad slots continue after the largest real position of their document (+1, +2, ...) on every
    channel, so they never restart at 0 and never look like the start of a new sample.

    Args:
        positions: [B, S] or [C, B, S] long (C = 3 for mRoPE), or float (Qwen3-Omni's fractional
            temporal positions).

    Returns:
        [1, T] or [C, 1, T], same dtype.
    """
    channels = positions.unsqueeze(0) if positions.dim() == 2 else positions  # [C, B, S]
    num_channels = channels.shape[0]
    packed = torch.stack(
        [pack_rows(channels[c], indices, pad_value=0)[0] for c in range(num_channels)]
    )  # [C, T]
    num_segments = indices.cu_seqlens.numel() - 1
    floor = -float("inf") if packed.is_floating_point() else torch.iinfo(packed.dtype).min
    real_max = torch.where(indices.is_real, packed.amax(0), floor)  # [T]
    segment_max = torch.full((num_segments,), floor, dtype=packed.dtype, device=packed.device)
    segment_max = segment_max.scatter_reduce(0, indices.segment_of_slot, real_max, "amax")
    real_lengths = (indices.cu_seqlens[1:] - indices.cu_seqlens[:-1]).long()
    pad_rank = indices.offset_in_segment - real_lengths[indices.segment_of_slot]  # [T], >= 0 at pads
    pad_values = segment_max[indices.segment_of_slot] + 1 + pad_rank
    packed = torch.where(indices.is_real, packed, pad_values)
    return packed.unsqueeze(1) if positions.dim() == 3 else packed  # [C,1,T] or [1,T]
