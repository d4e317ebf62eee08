"""The mRoPE index's input checks: types and shapes read no values; value checks ride the caller's one read.

`check_rope_types` is what `get_rope_index` / `queue_rope_index` check before anything is queued (types,
shapes, dtypes, inputs the family's index would drop unread); the grid and seconds rules (`check_grid`,
`check_seconds`) raise on the error path from the values queued as `any_bad_grid` / `seconds_and_bad`. The
packers and the Bridge adapters check the same fields with these same functions (one rule each), which is
why they live apart from the index itself (`rope/index.py`, Qwen3-Omni's `rope/omni_index.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_vlm_packing.packing.bounds import int_entries
from megatron_vlm_packing.packing.checks import check_dense, is_integer_tensor
from megatron_vlm_packing.packing.lengths import widened_unsigned
from megatron_vlm_packing.rope.config import SECONDS_FAMILIES, MRopeConfig


def check_grid_shape(grid, name: str) -> torch.Tensor | None:
    """`grid` when it is a [N, 3] integer tensor (None stays None; uint16 / uint32 as int64, which torch can
    compare: `<` on them was a NotImplementedError), else ValueError naming it (uint64 too). Reads no values."""
    if grid is None:
        return None
    if not isinstance(grid, torch.Tensor):
        raise ValueError(f"{name} must be a [N, 3] integer tensor, got {type(grid).__name__}")
    if grid.dim() != 2 or grid.shape[1] != 3 or not is_integer_tensor(grid):
        raise ValueError(f"{name} must be a [N, 3] integer tensor, got shape {tuple(grid.shape)} {grid.dtype}")
    return widened_unsigned(grid, name)


# t * h * w patches of one grid row at or above this (computed in float64, so that the product cannot wrap) is
# more than int64 holds: the index's int64 token count t * (h / merge) * (w / merge) wrapped ([1, 2**62 + 2, 16]
# counted 8 tokens) and an 8-token block got positions from a grid of 2**61 + 1 rows.
_PATCH_LIMIT = float(2 ** 63)


def _bad_grid_rows(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[N] bool: an entry < 1, h or w not a multiple of `merge`, or t * h * w patches beyond int64. Reads nothing."""
    patches = grid.double().prod(dim=1)
    return (grid < 1).any(dim=1) | (grid[:, 1:] % merge != 0).any(dim=1) | (patches >= _PATCH_LIMIT)


def check_grid(grid, name: str, merge: int) -> torch.Tensor | None:
    """A [N, 3] integer grid with every entry >= 1, h, w multiples of `merge` and t * h * w patches that int64
    holds, or ValueError naming it."""
    grid = check_grid_shape(grid, name)  # uint16 / uint32 as int64
    if grid is None:
        return None
    bad = _bad_grid_rows(grid, merge)
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0])
        t, h, w = grid[row].tolist()
        if min(t, h, w) >= 1 and h % merge == 0 and w % merge == 0:
            raise ValueError(f"{name} row {row} is {[t, h, w]}: t * h * w = {t * h * w} patches, more than int64 "
                             f"holds (at most {2 ** 63 - 1})")
        raise ValueError(f"{name} row {row} is {[t, h, w]}: t, h, w must be >= 1 and h, w multiples "
                         f"of spatial_merge_size={merge}")
    return grid


def any_bad_grid(grid, merge: int, device) -> torch.Tensor:
    """0-dim long on `device`: 1 when a row of the [N, 3] grid fails `check_grid` (`_bad_grid_rows`)."""
    if grid is None or not grid.numel():
        return torch.zeros((), dtype=torch.long, device=device)
    return _bad_grid_rows(grid, merge).any().to(device=device, dtype=torch.long)


def check_seconds_dtype(seconds, name: str = "second_per_grid_ts") -> None:
    """Seconds per grid step hold real numbers: a complex tensor lost its imaginary part without a word (a
    warning at most) and a bool one was read as 1 second. Reads no values; a list's tensors are checked too."""
    for value in seconds if isinstance(seconds, (list, tuple)) else (seconds,):
        if isinstance(value, torch.Tensor) and (value.is_complex() or value.dtype == torch.bool) \
                or isinstance(value, (bool, complex)):
            dtype = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} must hold real numbers of seconds, got dtype {dtype}")


def check_audio_seqlens_type(seqlens, name: str = "audio_seqlens") -> None:
    """Raw audio lengths (Qwen3-Omni), one per clip: an [A] integer tensor or a list of ints (numpy ints too,
    `bounds.int_entries`). An [A, 1] tensor was flattened, a 0-dim one read as one clip, float lengths truncated.
    Reads no values.

    Raises:
        ValueError: naming the shape, the dtype, the first entry of a list that is no int, or the type and value of
            anything else (a scalar was a TypeError, 'int' object is not iterable; bytes were read as their byte
            values, a set in hash order, a dict's keys as lengths).
    """
    if isinstance(seqlens, torch.Tensor):
        if seqlens.dim() != 1:
            raise ValueError(f"{name} must be [A], one raw length per audio clip, got shape {tuple(seqlens.shape)}")
        if not is_integer_tensor(seqlens):
            raise ValueError(f"{name} must hold integer raw audio lengths, got dtype {seqlens.dtype}")
    elif seqlens is not None and not isinstance(seqlens, (list, tuple, range)):
        shown = repr(seqlens) if len(repr(seqlens)) <= 40 else repr(seqlens)[:40] + "..."
        raise ValueError(f"{name} must be [A], one raw length per audio clip (an integer tensor, or a list or tuple "
                         f"of ints), got {type(seqlens).__name__} {shown}")
    elif seqlens is not None:
        int_entries(seqlens, name, "raw audio lengths")  # numpy ints as Python ints; bool, float, str refused


def seconds_and_bad(seconds) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(seconds as float64 [V], [V] bool: NaN, infinite or negative), or None without seconds. Reads nothing."""
    if seconds is None:
        return None
    values = torch.as_tensor(seconds if not isinstance(seconds, (list, tuple)) or not seconds
                             or not torch.is_tensor(seconds[0]) else torch.stack([torch.as_tensor(x) for x in seconds]))
    values = values.reshape(-1).double()
    return values, ~torch.isfinite(values) | (values < 0)


def check_seconds(seconds, name: str = "second_per_grid_ts") -> None:
    """Seconds per temporal grid step must be finite and >= 0 (NaN would give garbage positions)."""
    if seconds is None:
        return
    values, bad = seconds_and_bad(seconds)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"{name} entry {i} is {float(values[i])}: seconds per grid step must be finite and >= 0")


def checked_audio_in_video(flag) -> bool | None:
    """`use_audio_in_video` as True, False or None (a numpy bool or a one-element bool tensor, as a batch may
    carry it, read as its bool); anything else ("no" was read as True) is a ValueError."""
    if flag is None or isinstance(flag, bool):
        return flag
    if isinstance(flag, np.bool_) or isinstance(flag, torch.Tensor) and flag.dtype == torch.bool \
            and flag.numel() == 1 and not flag.is_meta:
        return bool(flag)
    raise ValueError(f"use_audio_in_video must be True, False or None, got {flag!r}")


def check_rope_types(input_ids, config: MRopeConfig, image_grid_thw, video_grid_thw, attention_mask,
                     mm_token_type_ids=None, second_per_grid_ts=None, audio_seqlens=None,
                     use_audio_in_video=None) -> None:
    """The index's checks that read no tensor values (types and shapes); the value checks ride its one read."""
    if not isinstance(config, MRopeConfig):
        raise ValueError(f"config must be an MRopeConfig, got {type(config).__name__}")
    checked_audio_in_video(use_audio_in_video)
    for name, value in (("input_ids", input_ids), ("attention_mask", attention_mask),
                        ("image_grid_thw", image_grid_thw), ("video_grid_thw", video_grid_thw),
                        ("second_per_grid_ts", second_per_grid_ts), ("mm_token_type_ids", mm_token_type_ids),
                        ("audio_seqlens", audio_seqlens)):
        check_dense(name, value, "get_rope_index and queue_rope_index")  # else an error from deep inside
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not is_integer_tensor(input_ids):
        raise ValueError(f"input_ids must be a [B, S] integer tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
                         f"{' ' + str(input_ids.dtype) if isinstance(input_ids, torch.Tensor) else ''}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != tuple(input_ids.shape)):
        raise ValueError(f"attention_mask must be [B, S] = {tuple(input_ids.shape)} like input_ids, got "
                         f"{tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask).__name__}")
    if mm_token_type_ids is not None and (not isinstance(mm_token_type_ids, torch.Tensor)
                                          or tuple(mm_token_type_ids.shape) != tuple(input_ids.shape)
                                          or mm_token_type_ids.is_complex()):
        # Indexed like input_ids: another shape was an IndexError in `token_runs`, a list an AttributeError.
        raise ValueError(f"mm_token_type_ids must be a [B, S] = {tuple(input_ids.shape)} tensor like input_ids, got "
                         f"{tuple(getattr(mm_token_type_ids, 'shape', ())) or type(mm_token_type_ids).__name__}")
    check_grid_shape(image_grid_thw, "image_grid_thw")
    check_grid_shape(video_grid_thw, "video_grid_thw")
    if second_per_grid_ts is not None:
        check_seconds_dtype(second_per_grid_ts)
        if isinstance(second_per_grid_ts, torch.Tensor) and second_per_grid_ts.dim() != 1:  # was flattened
            raise ValueError(f"second_per_grid_ts must be [V], one entry per video, got shape "
                             f"{tuple(second_per_grid_ts.shape)}")
        refuse_seconds_unread_by(config.family, second_per_grid_ts)
    check_audio_seqlens_type(audio_seqlens)
    refuse_inputs_unread_by(config.family, mm_token_type_ids=mm_token_type_ids, audio_seqlens=audio_seqlens,
                            use_audio_in_video=use_audio_in_video)


def entry_count(value) -> int:
    """Entries of a per-item rope input (`second_per_grid_ts`, `audio_seqlens`): a tensor's elements, a list's or
    tuple's length, 1 for one number, 0 for None. Reads no values."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.numel()
    return len(value) if isinstance(value, (list, tuple)) else 1


def refuse_inputs_unread_by(family: str, *, mm_token_type_ids=None, audio_seqlens=None,
                            use_audio_in_video=None) -> None:
    """Inputs the index of `family` reads nothing of were taken and dropped: `audio_seqlens` (with entries) and
    `use_audio_in_video=True` are read by Qwen3-Omni's index only, `mm_token_type_ids` by all but Qwen3-Omni's (which
    tells blocks by their tokens), as in transformers. Reads no values.

    Raises:
        ValueError: naming each such input and the family.
    """
    if family == "qwen3_omni":
        unread = ["mm_token_type_ids"] if mm_token_type_ids is not None else []
    else:
        # use_audio_in_video=False says what holds of every video of these families: nothing is dropped
        unread = (["audio_seqlens"] * bool(entry_count(audio_seqlens))
                  + ["use_audio_in_video"] * (use_audio_in_video is True))
    if unread:
        raise ValueError(f"{unread} given to the {family} mRoPE index, which reads none of them (audio_seqlens and "
                         f"use_audio_in_video are Qwen3-Omni's; mm_token_type_ids the Qwen-VL families'): drop them "
                         f"from the batch")


def refuse_seconds_unread_by(family: str | None, seconds, model_name: str | None = None) -> None:
    """The one rule for seconds per grid step that nothing reads: with entries, they are read only by an mRoPE index
    of `config.SECONDS_FAMILIES` (Qwen2-VL's places frames by their index, Qwen3-VL's by timestamp text, a 1D rotary
    places none), so given to any other reader they would be taken and dropped. Reads no values.

    Args:
        family: the family of the index that reads the video positions, or None for a 1D rotary.
        seconds: `second_per_grid_ts` as given (a tensor, a list, a number, or None).
        model_name: the model whose positions these are, named before its index or rotary; None for the index alone.

    Raises:
        ValueError: naming the field, its entries, the reader and the families that read seconds.
    """
    entries = entry_count(seconds)
    if not entries or family in SECONDS_FAMILIES:
        return
    index = f"the {family} mRoPE index" if family is not None else "a 1D rotary"
    reader = index if model_name is None else f"{model_name} ({index})"
    raise ValueError(f"second_per_grid_ts has {entries} entries but {reader} reads none: only the "
                     f"{' and '.join(sorted(SECONDS_FAMILIES))} mRoPE indexes place video frames by seconds per grid "
                     f"step; drop them from the batch")
