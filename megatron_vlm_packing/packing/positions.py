"""Positions of a collated batch: `position_ids` given in it (checked, [B, 3, S] transposed) or mRoPE
positions of each row alone, from an `MRopeConfig` (its index's reads queued on the rows' one read)
or a user callable. `rows.read_rows` calls these around its one host read.

Shape legend: B = rows, S = row length.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Mapping

import numpy as np
import torch

from megatron_vlm_packing.packing.checks import DeferredChecks, _first_bad, check_dense, token_place
from megatron_vlm_packing.packing.lengths import DeferredKeep, any_true, widened_unsigned
from megatron_vlm_packing.packing.pack import cat_row_prefixes
from megatron_vlm_packing.packing.indices import host_ramp

_ROPE_INPUT_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                    "audio_seqlens", "feature_attention_mask", "use_audio_in_video")


def refuse_unread_rope_inputs(batch: Mapping, accepted: set, audio, *, name: str) -> None:
    """A position callable must read every rope input the batch carries: else grid tokens get text
    positions, and `mm_token_type_ids` / `use_audio_in_video` (what the processor says each token is,
    whether a video's audio is interleaved) are dropped unread while the callable guesses them from the
    ids, which may disagree.

    Raises:
        ValueError: naming the callable and each input it does not take.
    """
    unread = [k for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                          "use_audio_in_video")
              if batch.get(k) is not None and k not in accepted]
    if audio is not None and not {"audio_seqlens", "feature_attention_mask"} & accepted:
        unread.append("audio_seqlens / feature_attention_mask")
    if unread:
        raise ValueError(f"the batch carries {unread} but the mrope callable {name} takes none of them by name: "
                         f"its positions would be made without them; accept them (or **kwargs), or leave them out "
                         f"of the batch")


def rope_positions(batch: Mapping, input_ids: torch.Tensor, keep: torch.Tensor, mrope, audio,
                   where: Callable[[int, int], str] = token_place, *, media=None) -> torch.Tensor:
    """[3, B, S] positions of each row alone, from an `MRopeConfig` or a callable (its output checked: dense,
    integer or real, finite at real tokens; `where` names a token in that error). A callable that names
    `mm_token_type_ids` (transformers 5's get_rope_index requires them) is given the batch's, else ones derived
    from the placeholder ids of `media` (`MediaTokens`, `derived_token_types`)."""
    if callable(mrope):
        fn: Callable = mrope
        params = inspect.signature(mrope).parameters
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepted = set(_ROPE_INPUT_KEYS) | {"attention_mask"} if accepts_any else set(params)
    else:
        from megatron_vlm_packing.rope import MRopeConfig, get_rope_index  # imported only when used

        if not isinstance(mrope, MRopeConfig):
            raise ValueError(f"mrope must be an MRopeConfig or a callable, got {type(mrope).__name__}")
        fn = lambda ids, **kw: get_rope_index(ids, mrope, **kw)  # noqa: E731
        accepted = set(inspect.signature(get_rope_index).parameters)
    seconds = seconds_parameter(params) if callable(mrope) and not accepts_any else "second_per_grid_ts"
    if seconds != "second_per_grid_ts":
        accepted.add("second_per_grid_ts")  # given under the callable's own name below
    kwargs = {k: batch[k] for k in _ROPE_INPUT_KEYS if batch.get(k) is not None and k in accepted}
    if "second_per_grid_ts" in kwargs:
        kwargs[seconds] = kwargs.pop("second_per_grid_ts")
    for key in ("image_grid_thw", "video_grid_thw"):  # uint16 / uint32 as int64, as everywhere else
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = widened_unsigned(kwargs[key], key)
    name = callable_name(mrope)  # a callable's, for its errors
    if callable(mrope):
        refuse_unread_rope_inputs(batch, accepted, audio, name=name)
    if audio is not None and "audio_seqlens" in accepted and "audio_seqlens" not in kwargs:
        kwargs["audio_seqlens"] = torch.tensor(audio.audio_lengths)
    if callable(mrope) and "mm_token_type_ids" in params and "mm_token_type_ids" not in kwargs:
        kwargs["mm_token_type_ids"] = derived_token_types(batch, input_ids, media, name)
    result = fn(input_ids, attention_mask=keep.long(), **kwargs)
    positions = result[0] if isinstance(result, tuple) else result
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3 or positions.shape[0] != 3 \
            or tuple(positions.shape[1:]) != tuple(input_ids.shape):
        raise ValueError(f"mrope positions must be [3, B, S] = [3, {input_ids.shape[0]}, {input_ids.shape[1]}], "
                         f"got {tuple(getattr(positions, 'shape', ()))}")
    if callable(mrope):
        return _checked_callable_positions(positions, input_ids, keep, name, where)
    return positions


def seconds_parameter(params: Mapping) -> str:
    """The name under which a position callable with parameters `params` takes the seconds per temporal grid
    step: "second_per_grids" for transformers' Qwen3-Omni get_rope_index (its name), else the batch's
    "second_per_grid_ts" (Qwen2.5-VL's)."""
    return "second_per_grids" if "second_per_grid_ts" not in params and "second_per_grids" in params \
        else "second_per_grid_ts"


def callable_name(fn) -> str:
    """A position callable's name for its errors: a `functools.partial`'s function's (a bound HF
    `get_rope_index` made with partial was named "partial")."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def derived_token_types(batch: Mapping, input_ids: torch.Tensor, media, name: str) -> torch.Tensor:
    """input_ids: [B, S] -> [B, S] int32 `mm_token_type_ids` for a position callable that takes them and a batch
    without them: 1 at `media.image_token_id`, 2 at `media.video_token_id`, 0 elsewhere
    (`rope.index.placeholder_types`, as the validator derives them).

    Raises:
        ValueError: no placeholder id known, or a grid in the batch whose kind's id is not known (its tokens
            would be typed as text: text positions, or the callable's own error); naming both remedies.
    """
    from megatron_vlm_packing.packing.media_counts import position_input
    from megatron_vlm_packing.rope.index import placeholder_types

    image_id = None if media is None else media.image_token_id
    video_id = None if media is None else media.video_token_id
    remedy = ("pass mm_token_type_ids in the batch, or the placeholder ids (image_token_id= / video_token_id=; "
              "a step gets them from the model adapter's media_token_ids) to derive them from input_ids")
    if image_id is None and video_id is None:
        raise ValueError(f"the mrope callable {name} takes mm_token_type_ids and the batch has none, and no "
                         f"placeholder id is known: {remedy}")
    for key, id_name, token_id in (("image_grid_thw", "image_token_id", image_id),
                                   ("video_grid_thw", "video_token_id", video_id)):
        if token_id is None and position_input(batch.get(key)):
            raise ValueError(f"the batch carries {key} but no {id_name} is known to find its placeholders in the "
                             f"mm_token_type_ids the mrope callable {name} takes (they would be typed as text): "
                             f"{remedy}")
    return placeholder_types(input_ids, image_id, video_id)


def _checked_callable_positions(positions: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor, name: str,
                                where: Callable[[int, int], str]) -> torch.Tensor:
    """A position callable's [3, B, S] output checked as `position_ids` given in the batch are (`normalize_positions`,
    `queue_position_checks`), on the ids' device: dense with values, integer (uint16 / uint32 as int64) or real,
    finite at real tokens (pad slots are rebuilt). NaN and inf reached the rotary; bool, complex, meta and sparse
    outputs crashed in the pack.

    One read, only for floating positions (the callable itself, e.g. a model's `get_rope_index`, reads the host
    many times already); integer positions cost none."""
    field = f"the mrope callable {name}"
    check_dense(f"the output of {field}", positions, "pack_batch/pad_batch",
                fix=f"return dense positions from {name}")
    positions = widened_unsigned(positions, f"positions from {field}")
    check_mrope_position_dtype(positions.dtype, f"{field} returned")
    positions = positions.to(input_ids.device)
    if positions.is_floating_point():
        not_finite = keep[None] & ~torch.isfinite(positions)
        if bool(not_finite.any()):  # the one read of a floating callable output (see above)
            channel, b, t = torch.nonzero(not_finite)[0].tolist()
            raise ValueError(f"{field} gave channel {channel} {where(b, t)} the position "
                             f"{positions[channel, b, t].item()}: mRoPE positions must be finite")
    return positions


# Whole numbers a half dtype holds exactly (2 ** (mantissa bits + 1)); fractional positions (Qwen3-Omni's) fewer.
# The packers refuse these dtypes for mRoPE positions (by dtype: judging values would need a read); the validator
# compares saved ones with the model's index, which tells exact values above the limit from rounded ones, and
# names those beyond it that no index compared.
HALF_EXACT_WHOLE_NUMBERS = {torch.bfloat16: 256, torch.float16: 2048}


def check_mrope_position_dtype(dtype: torch.dtype, owner: str) -> None:
    """[3, B, S] positions (given, or a callable's) hold integer or real positions in a dtype that keeps them:
    bool and complex have no order (pad slots continue after each document's largest position, where
    torch.iinfo raised a TypeError), and bf16 / fp16 round whole positions above 256 / 2048 (the rotary
    reads the rounded ones, silently). By dtype, not by value: no read. `owner` begins the message."""
    if dtype == torch.bool or dtype.is_complex:
        raise ValueError(f"{owner} dtype {dtype}: mRoPE positions must hold integer or real positions")
    if dtype in HALF_EXACT_WHOLE_NUMBERS:
        raise ValueError(f"{owner} dtype {dtype}, which holds whole numbers exactly only up to "
                         f"{HALF_EXACT_WHOLE_NUMBERS[dtype]} (fractional positions fewer): larger positions would "
                         f"reach the rotary rounded, and the dtype is refused whatever the values (they are not "
                         f"read); give mRoPE positions as int64 or float32")


def positions_config(mrope):
    """What a micro-batch records as the config of its positions (`MicroBatch.mrope_config`): `mrope` when it
    is an `MRopeConfig` (it made the positions), else None (1D positions, positions given in the batch, or a
    callable's, which cannot be compared with a model's config)."""
    if mrope is None:
        return None
    from megatron_vlm_packing.rope import MRopeConfig

    return mrope if isinstance(mrope, MRopeConfig) else None


def check_position_layout(position_layout) -> None:
    """`position_layout` is None, "3BS" or "B3S" (checked with or without position_ids in the batch)."""
    if position_layout is not None and position_layout not in POSITION_LAYOUTS:
        raise ValueError(f"position_layout must be '3BS' or 'B3S' (or None), got {position_layout!r}")


POSITION_LAYOUTS = ("3BS", "B3S")


def normalize_positions(batch: Mapping, shape: tuple[int, int], position_layout: str | None) -> dict:
    """The batch with `position_ids` as [B, S] or [3, B, S] (a [B, 3, S] tensor is transposed).

    A 3D tensor is read as [3, B, S] or [B, 3, S] from its shape; when B == 3 both read the same
    shape and `position_layout` ("3BS" or "B3S") must say which.
    """
    given = batch.get("position_ids")
    if given is None:
        return dict(batch)
    if not isinstance(given, torch.Tensor):
        raise ValueError(f"position_ids must be a tensor, got {type(given).__name__}")
    check_position_layout(position_layout)
    batch_size, row_length = shape
    widened = widened_unsigned(given, "position_ids")  # uint16 / uint32 as int64; uint64 refused
    if widened is not given:
        return normalize_positions({**batch, "position_ids": widened}, shape, position_layout)
    if given.dim() == 2:
        if tuple(given.shape) != shape:
            raise ValueError(f"position_ids has shape {tuple(given.shape)} but input_ids is {shape}")
        return dict(batch)
    if given.dim() != 3:
        raise ValueError(f"position_ids must be [B, S] or mRoPE [3, B, S], got shape {tuple(given.shape)}")
    check_mrope_position_dtype(given.dtype, "position_ids has")
    as_3bs, as_b3s = (3, batch_size, row_length), (batch_size, 3, row_length)
    layout = position_layout
    if layout is None:
        if tuple(given.shape) == as_3bs == as_b3s:
            raise ValueError(f"position_ids {tuple(given.shape)} is ambiguous with B = 3 rows: [3, B, S] or [B, 3, S]? "
                             f"pass position_layout='3BS' or 'B3S'")
        layout = "B3S" if tuple(given.shape) == as_b3s else "3BS"
    expected = as_3bs if layout == "3BS" else as_b3s
    if tuple(given.shape) != expected:
        raise ValueError(f"position_ids has shape {tuple(given.shape)}; mRoPE positions must be "
                         f"[3, {batch_size}, {row_length}] (or [{batch_size}, 3, {row_length}])")
    return {**batch, "position_ids": given if layout == "3BS" else given.transpose(0, 1)}


def check_1d_positions(given: torch.Tensor, keep: torch.Tensor, where: Callable[[int, int], str] = token_place) -> None:
    """[B, S] position_ids are recomputed from the lengths: they must be 0..n-1 on each row's real tokens.

    Positions that restart inside a row mean the row holds several documents: that is declared with
    `document_lengths`, never guessed (and never silently replaced by one arange per row).
    """
    expected = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    bad = keep & (given != expected)
    if bool(bad.any()):
        b, t = _first_bad(bad)
        value = given[b, t].item()  # as given: 0.5 is not shown as 0
        hint = " (it restarts: a row with several documents? give document_lengths)" if value == 0 else ""
        raise ValueError(f"position_ids {where(b, t)} is {value}, expected {t}{hint}; 1D positions "
                         f"are computed from the real lengths (restarting per document)")


def check_1d_positions_on_host(given: torch.Tensor, indices, keep: Callable[[], torch.Tensor],
                               where: Callable[[int, int], str] = token_place) -> None:
    """`check_1d_positions` for [B, S] position_ids on the CPU (`pack_batch(host_reads=True)`): the
    documents' real tokens concatenated in numpy and compared with 0..n-1 in one op (the packed
    offsets themselves when the pack has no pad slots); a mismatch raises `check_1d_positions`'
    detailed error.

    Args:
        given: [B, S] position_ids numpy can view. indices: `PackIndices` of the plan of these rows.
        keep: returns the [B, S] keep-mask (built only for the error).
        where: names a bad token in the batch as given (`checks.ValueInputs.where`).
    """
    if host_positions_differ(given.numpy(), indices):
        check_1d_positions(given, keep(), where)
        raise AssertionError("positions failing the host test passed check_1d_positions")  # a bug here


def host_positions_differ(given: np.ndarray, indices) -> bool:
    """`check_1d_positions_on_host`'s test alone, nothing raised: True when some real token's position in
    `given` ([B, S], a numpy view of the tensor) is not its offset in its document."""
    plan = indices.plan
    real = cat_row_prefixes(given, plan)
    if indices.has_pad_slots:
        ramp = host_ramp(max(plan.real_lengths))
        expected = np.concatenate([ramp[:n] for n in plan.real_lengths])
    else:
        expected = indices.offset_in_segment_host  # every slot real: 0..n-1 per document
    # (count_nonzero of !=, what the value checks run too: cheaper than np.array_equal's Python layers)
    return np.count_nonzero(real != expected) != 0


def queue_position_checks(batch: Mapping, keep: Callable[[], torch.Tensor], mrope, checks: DeferredChecks,
                          where: Callable[[int, int], str] = token_place) -> None:
    """Refuse [3, B, S] positions beside mrope= now; queue the check of [B, S] positions."""
    given = batch.get("position_ids")
    if given is None:
        return
    if mrope is not None and given.dim() == 3:
        raise ValueError("the batch has [3, B, S] position_ids and mrope= was given: pass one of them")
    if given.dim() == 2:
        real = keep()
        expected = torch.arange(real.shape[1], device=real.device).expand_as(real)
        checks.add(any_true(real & (given != expected)), lambda v: v[0] != 0,
                   lambda: check_1d_positions(given, real, where))
    else:
        if given.is_floating_point():  # fractional mRoPE positions (Qwen3-Omni): NaN / inf would reach the rotary
            not_finite = keep()[None] & ~torch.isfinite(given)  # [3, B, S], real tokens only (pads are rebuilt)
            checks.add(any_true(not_finite), lambda v: v[0] != 0, lambda: _refuse_not_finite(given, not_finite, where))
        restarts = position_restarts(given, keep())
        checks.add(any_true(restarts), lambda v: v[0] != 0, lambda: _refuse_mrope_restart(restarts, keep(), where))


def position_restarts(positions: torch.Tensor, real: torch.Tensor, *,
                      real_before: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] bool: real tokens at position 0 (on every channel of mRoPE positions) after a real token of their row
    (of their document, with `real_before` from `real_before_in_segment` for a pack).

    Only a document's first token sits at 0 on every channel (text and the first item start there; a later item
    follows its vision / audio start token, so at least one channel is above 0): such a token inside a row opens
    another document, which packing would merge with the ones before it (bug class 11). Reads no value.

    Args:
        positions: [B, S] or [3, B, S]. real: [B, S] bool, True at real tokens.
        real_before: [B, S] long, real tokens before each slot that count (default: those of its row).
    """
    at_zero = positions == 0 if positions.dim() == 2 else (positions == 0).all(dim=0)
    if real_before is None:
        real_before = real.long().cumsum(dim=1) - real.long()
    return real & at_zero & (real_before > 0)


def real_before_in_segment(real: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """[1, T] long: real tokens before each slot of a pack within its own segment. Reads no value.

    Args:
        real: [1, T] bool, True at real tokens. cu_seqlens_padded: [N+1] int, physical segment boundaries (slots
            past the last one count as its last segment's).
    """
    before = real.long().cumsum(dim=1) - real.long()  # [1, T] in the whole pack
    slots = torch.arange(real.shape[1], device=real.device)
    bounds = cu_seqlens_padded.to(device=real.device, dtype=torch.long)
    segment = torch.searchsorted(bounds[1:], slots, right=True).clamp(max=max(bounds.numel() - 2, 0))  # [T]
    start = bounds[segment].clamp(0, max(real.shape[1] - 1, 0))  # [T] each slot's segment's first slot
    return before - before[0, start][None]


def _refuse_mrope_restart(restarts: torch.Tensor, real: torch.Tensor, where: Callable[[int, int], str]) -> None:
    b, t = _first_bad(restarts)
    before = int(real[b, :t].sum())
    raise ValueError(f"position_ids {where(b, t)} is 0 on every channel after {before} real tokens of its row: the "
                     f"mRoPE positions restart, so the row holds several documents, which would train as one; give "
                     f"document_lengths (each document a segment of its own, positions per document)")


def _refuse_not_finite(given: torch.Tensor, not_finite: torch.Tensor, where: Callable[[int, int], str]) -> None:
    channel, b, t = torch.nonzero(not_finite)[0].tolist()
    raise ValueError(f"position_ids channel {channel} {where(b, t)} is {given[channel, b, t].item()}: "
                     f"mRoPE positions must be finite")


def queue_rope_positions(batch: Mapping, input_ids: torch.Tensor, keep: Callable[[], torch.Tensor], mrope,
                         checks: DeferredChecks, where: Callable[[int, int], str] = token_place):
    """With an `MRopeConfig` (not a callable), queue the index's reads on `checks`
    (`rope.index.queue_rope_index`), so the positions need no read of their own; else None. `where`
    names a token in the index's errors (a document of a pre-packed row: `DocumentPlaces.where`).
    Inputs whose types the index refuses queue nothing: `rope_positions` raises their error after
    the read, where it always has."""
    if mrope is None:
        return None
    from megatron_vlm_packing.rope import MRopeConfig

    if not isinstance(mrope, MRopeConfig):
        return None
    from megatron_vlm_packing.rope.index import queue_rope_index
    from megatron_vlm_packing.rope.index_checks import check_rope_types

    kwargs = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                                    "audio_seqlens", "use_audio_in_video") if batch.get(k) is not None}
    types = kwargs.get("mm_token_type_ids")
    if types is not None and (not isinstance(types, torch.Tensor) or types.shape != input_ids.shape):
        return None
    try:
        check_rope_types(input_ids, mrope, kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"), keep(),
                         mm_token_type_ids=types, second_per_grid_ts=kwargs.get("second_per_grid_ts"),
                         audio_seqlens=kwargs.get("audio_seqlens"), use_audio_in_video=kwargs.get("use_audio_in_video"))
    except ValueError:
        return None
    return queue_rope_index(input_ids, mrope, checks, attention_mask=keep(), where=where, **kwargs)


def batch_positions(batch: Mapping, input_ids: torch.Tensor, mask: DeferredKeep, mrope, audio,
                    rope=None, host: list | None = None,
                    where: Callable[[int, int], str] = token_place, *, media=None) -> torch.Tensor | None:
    """[3, B, S] mRoPE positions (computed, or given in the batch), or None for 1D positions.

    Run after `queue_position_checks` and the checks' read (`host`, which carries the values of
    `rope`, `queue_rope_positions`' result, when not None). `where` names a token in a callable's errors;
    `media` (`MediaTokens`) gives a callable's derived `mm_token_type_ids` (`rope_positions`)."""
    given = batch.get("position_ids")
    if rope is not None:
        from megatron_vlm_packing.rope.index import finish_rope_index

        lengths = audio.audio_lengths if audio is not None and batch.get("audio_seqlens") is None else None
        return finish_rope_index(rope, host, audio_seqlens=lengths).position_ids
    if mrope is not None:
        return rope_positions(batch, input_ids, mask.keep, mrope, audio, where, media=media)
    if given is not None and given.dim() == 3:
        return given
    return None  # 1D positions: each document restarts at 0
