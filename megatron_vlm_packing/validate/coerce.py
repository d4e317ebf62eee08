"""Loose values from a saved batch, a micro-batch or keywords as the validator's types, or a ValueError
naming the field (never torch's TypeError / RuntimeError deep in a check, nor a silent int(2.5)).

Shape legend: T = physical packed slots, N = documents.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.lengths import widened_unsigned
from megatron_vlm_packing.packing.row_fields import is_undense


def _cpu(x):
    """A tensor detached and on the CPU; anything else as is."""
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def dense_tensor(x, name: str) -> torch.Tensor:
    """`x` as a dense CPU tensor; ValueError naming `name` when it cannot be one (a string, a ragged
    list, a sparse, nested or meta tensor: the packers' rule, `row_fields.is_undense`), instead of torch's
    TypeError / RuntimeError deep in a check."""
    if isinstance(x, torch.Tensor) and is_undense(x):
        # a nested tensor may have the strided layout: name what it is
        got = f"nested tensor (layout {x.layout})" if x.is_nested else f"{x.layout} tensor"
        raise ValueError(f"{name} must be a dense tensor with data, got a {got} on {x.device}")
    try:
        return _cpu(torch.as_tensor(x))
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__} ({err})") from None


def int_field(x, name: str, minimum: int | None = None) -> int:
    """An int field (a python or numpy int, `bounds.is_int`, or a one-element integer tensor) as a Python int;
    ValueError naming `name` otherwise."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not (x.is_floating_point() or x.dtype == torch.bool):
        x = x.item()
    if not is_int(x):
        raise ValueError(f"{name} must be an int, got {x!r} ({type(x).__name__})")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x}")
    return int(x)


def bool_field(x, name: str) -> bool:
    """A bool field (a python bool, or 0 / 1); ValueError naming `name` otherwise (bool("no") is True)."""
    if isinstance(x, bool) or (type(x) is int and x in (0, 1)):
        return bool(x)
    raise ValueError(f"{name} must be a bool, got {x!r} ({type(x).__name__})")


def flat_tokens(x: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """[1, T] / [T] -> [T]; [3, 1, T] / [3, T] positions -> [3, T] (positions only: [1, 1, T] token ids were
    taken for positions, a 2-D row, and the checks indexing it raised IndexError). uint16 / uint32 are read as
    int64, uint64 is a ValueError (`lengths.widened_unsigned`, the packers' rule)."""
    if x is None:
        return None
    x = widened_unsigned(dense_tensor(x, name), name)  # uint16 / uint32: torch cannot compare them with int64
    if x.dim() == 3 and x.shape[1] == 1 and name == "position_ids":  # [C, 1, T]
        return x[:, 0]
    if x.dim() == 2 and x.shape[0] == 1:
        return x[0]
    if x.dim() == 1 or (x.dim() == 2 and name == "position_ids"):
        return x
    raise ValueError(f"{name} must be [1, T] (or [3, 1, T] for position_ids), got shape {tuple(x.shape)}")


def count_field(x, name: str) -> tuple[int, ...]:
    """Per-document counts ([N] ints >= 0, a sequence or a tensor) as N ints; ValueError naming `name` otherwise
    (another rank, a float, a negative count)."""
    counts = dense_tensor(x, name)
    if counts.dim() != 1 or counts.is_floating_point() or bool((counts < 0).any()):
        raise ValueError(f"{name} must be N counts >= 0, got {x!r}")
    return tuple(counts.tolist())
