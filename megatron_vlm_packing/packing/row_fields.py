"""The fields of a collated batch checked for type, shape and dtype before `rows.read_rows` reads them.

Every key must be understood (`check_keys`), every tensor dense (`check_dense_tensors`); ids, labels,
loss weights and declared per-token extras are [B, S] like the ids; the options pack_batch and
pad_batch share (`pad_token_id`, `label_style`, flags, `extra_keys`, `vocab_size`) are checked here too, and
`check_pack_arguments` checks those a collator or the step holds when it is built. Every
public name here is importable from `rows` as well.

Shape legend: B = rows, S = row length.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from megatron_vlm_packing.packing.bounds import INT64_MAX, is_int
from megatron_vlm_packing.packing.checks import (  # noqa: F401 (is_undense, refuse_undense re-exported)
    check_dense, is_integer_tensor, is_undense, refuse_undense,
)
from megatron_vlm_packing.packing.documents import DOCUMENT_KEY
from megatron_vlm_packing.packing.lengths import widened_unsigned
from megatron_vlm_packing.packing.media import VISION_KEYS
from megatron_vlm_packing.packing.media_audio import AUDIO_KEYS
from megatron_vlm_packing.packing.plan import check_fp8, checked_pad_to

SEQUENCE_KEYS = ("input_ids", "tokens", "labels", "loss_mask", "attention_mask", "position_ids", "seq_lens")
# Read only by an mRoPE index (`mrope=`): accepted only when one is given.
ROPE_ONLY_KEYS = ("mm_token_type_ids", "use_audio_in_video", "audio_seqlens")


_BUILTIN_KEYS = frozenset(SEQUENCE_KEYS) | set(VISION_KEYS) | set(AUDIO_KEYS) | {DOCUMENT_KEY} | set(ROPE_ONLY_KEYS)
_KNOWN_KEYS = _BUILTIN_KEYS - set(ROPE_ONLY_KEYS)  # keys read without mrope= or extra_keys=


def check_keys(batch, *, extra_keys, mrope) -> None:
    """The batch is a dict whose every key is understood; ValueError naming the first that is not."""
    if not isinstance(batch, dict) and not isinstance(batch, Mapping):
        raise ValueError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    if not extra_keys and batch.keys() <= _KNOWN_KEYS:  # the common batch: only keys every call takes
        return
    builtin = _BUILTIN_KEYS
    clash = sorted(set(extra_keys) & builtin)
    if clash:
        raise ValueError(f"extra_keys {clash} are batch keys pack_batch/pad_batch already read; declare only other "
                         f"per-token tensors")
    known = builtin - set(ROPE_ONLY_KEYS) | set(extra_keys)
    # Given [3, B, S] (or [B, 3, S]) positions were computed from these keys: they are taken as given
    # (audio_seqlens is still checked against feature_attention_mask and the placeholders).
    given = batch.get("position_ids")
    positions_given = isinstance(given, torch.Tensor) and given.dim() == 3
    for key in batch:
        if key in ROPE_ONLY_KEYS and key not in known:
            if mrope is None and not positions_given:
                raise ValueError(f"batch key {key!r} is read only by an mRoPE index, and no mrope= was given "
                                 f"(nor [3, B, S] position_ids computed from it)")
            continue
        if key not in known:
            raise ValueError(
                f"unknown batch key {key!r}: pack_batch/pad_batch take {sorted(SEQUENCE_KEYS)}, "
                f"{DOCUMENT_KEY!r}, vision {sorted(VISION_KEYS)}, audio {sorted(AUDIO_KEYS)}; declare per-token "
                f"tensors with extra_keys="
            )


def check_dense_tensors(batch: Mapping, reader: str = "pack_batch/pad_batch") -> None:
    """Every tensor of the batch holds dense values: a ValueError naming the first sparse or nested tensor (its
    layout) or meta tensor (no values), which numpy and most of torch's kernels cannot read. `reader`: who
    reads the batch, for the error (LLaVA's packers give theirs)."""
    if not isinstance(batch, Mapping):  # check_keys names what it is
        return
    for key, value in batch.items():
        check_dense(key, value, reader)


def input_ids_of(batch: Mapping) -> tuple[str, torch.Tensor]:
    """(name, [B, S] integer ids) from exactly one of `input_ids` / `tokens`."""
    keys = [k for k in ("input_ids", "tokens") if batch.get(k) is not None]
    if len(keys) != 1:
        raise ValueError(f"the batch needs exactly one of 'input_ids' or 'tokens', found {keys or 'neither'}")
    ids = batch[keys[0]]
    if not isinstance(ids, torch.Tensor):  # a numpy array's shape alone looked like the [B, S] asked for
        kind = type(ids)
        shape = f" of shape {tuple(ids.shape)}" if hasattr(ids, "shape") else ""
        raise ValueError(f"{keys[0]} must be a [B, S] torch.Tensor, got a {kind.__module__}.{kind.__qualname__}{shape}: "
                         f"convert it with torch.as_tensor")
    if ids.dim() != 2:
        raise ValueError(f"{keys[0]} must be a [B, S] tensor, got {tuple(ids.shape)}")
    if not is_integer_tensor(ids):
        raise ValueError(f"{keys[0]} must hold integer token ids, got dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{keys[0]} is empty: shape {tuple(ids.shape)}")
    return keys[0], ids if ids.dtype == torch.int64 else widened_unsigned(ids, keys[0]).long()


def row_tensor(batch: Mapping, name: str, shape: tuple[int, int]) -> torch.Tensor | None:
    """batch[name] when given, checked to be a [B, S] tensor."""
    value = batch.get(name)
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a [B, S] tensor like input_ids {shape}, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(value.shape)} but input_ids is {shape}")
    return value


def checked_labels(batch: Mapping, shape: tuple[int, int], label_style: str) -> torch.Tensor:
    """[B, S] long labels as given (Megatron next-token targets or HF unshifted labels), type-checked."""
    labels = row_tensor(batch, "labels", shape)
    if labels is None:
        raise ValueError("the batch has no 'labels': pack_batch/pad_batch build training micro-batches")
    if not is_integer_tensor(labels):
        raise ValueError(f"labels must hold integer token ids (-100 = ignore), got dtype {labels.dtype}")
    check_label_style(label_style)
    return labels if labels.dtype == torch.int64 else widened_unsigned(labels, "labels").long()


def checked_loss_values(batch: Mapping, shape: tuple[int, int]) -> torch.Tensor | None:
    """`loss_mask` as given (uint16/uint32 read as int64), checked [B, S] and real, or None."""
    loss_mask = row_tensor(batch, "loss_mask", shape)
    if loss_mask is not None and loss_mask.is_complex():
        raise ValueError(f"loss_mask must be real weights, got dtype {loss_mask.dtype}")
    return None if loss_mask is None else widened_unsigned(loss_mask, "loss_mask")


def check_pad_token_id(pad_token_id, vocab_size=None) -> int:
    """`pad_token_id` as a Python int: a ValueError unless it is an int in [0, 2**63 - 1] (`bounds.is_int`) and,
    when `vocab_size` is given (checked first, `check_vocab_size`), below it: the model embeds every pad slot,
    and an id outside its table is an index error at TP=1 (a device-side assert on a GPU)."""
    if not is_int(pad_token_id) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int (the id written at pad slots), got {pad_token_id!r}")
    if pad_token_id > INT64_MAX:
        raise ValueError(f"pad_token_id must be at most 2**63 - 1 (ids are int64), got {pad_token_id}")
    check_vocab_size(vocab_size)
    if vocab_size is not None and pad_token_id >= vocab_size:
        raise ValueError(f"pad_token_id={pad_token_id} is no token id of the model (vocab_size={vocab_size}): every "
                         f"pad slot is embedded, and an id outside [0, {vocab_size}) is an index error at TP=1 (a "
                         f"device-side assert on a GPU); pad with an id in [0, {vocab_size})")
    return int(pad_token_id)


def check_label_style(label_style) -> None:
    """`label_style` is "megatron" (labels already aligned) or "hf" (unshifted, shifted inside each sample),
    else a ValueError naming it."""
    if label_style not in ("hf", "megatron"):
        raise ValueError(f"label_style must be 'megatron' or 'hf', got {label_style!r}")


def check_pack_arguments(*, fp8=False, label_style="megatron", pad_to=None, pad_token_id=0, mrope=None) -> int | None:
    """The `pack_batch` options a collator or the step holds, checked as the packers check them, when the
    collator or step is built (not in a DataLoader worker, or at the first step). An option an owner does
    not hold is left at its default.

    Returns:
        `pad_to` as a Python int (`plan.checked_pad_to`: a numpy int read as its int, a tensor refused), or None.

    Raises:
        ValueError: naming the first bad option, in the order fp8, label_style, pad_to, pad_token_id, mrope.
    """
    check_fp8(fp8)
    check_label_style(label_style)
    pad_to = checked_pad_to(pad_to)
    check_pad_token_id(pad_token_id)
    check_mrope(mrope)
    return pad_to


def check_mrope(mrope) -> None:
    """`mrope` is None, an `MRopeConfig` or a callable (the model's index), else a ValueError naming its type."""
    from megatron_vlm_packing.rope.config import MRopeConfig  # imported only when used (the rope package)

    if mrope is not None and not callable(mrope) and not isinstance(mrope, MRopeConfig):
        raise ValueError(f"mrope must be an MRopeConfig, a callable or None, got {type(mrope).__name__}")


def check_flags(**flags) -> None:
    """Each of `flags` is a bool: a truthy string ("no", "False") or None must not switch an option on or off.

    Raises:
        ValueError: naming the first flag that is not a bool, and its value.
    """
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


def checked_extra_keys(extra_keys) -> tuple:
    """`extra_keys` (a tuple, list, set or other iterable of batch key names) as a tuple.

    Raises:
        ValueError: `extra_keys` is not an iterable (None, 0) or is one string (read as its characters).
    """
    if type(extra_keys) is tuple:
        return extra_keys
    if isinstance(extra_keys, (str, bytes)) or not isinstance(extra_keys, Iterable):
        raise ValueError(f"extra_keys must be a tuple of batch key names (the per-token tensors to pack), "
                         f"got {extra_keys!r}")
    try:
        return tuple(extra_keys)
    except TypeError:  # an iterable type that cannot iterate this value (a 0-d tensor, a 0-d numpy array)
        raise ValueError(f"extra_keys must be a tuple of batch key names (the per-token tensors to pack), "
                         f"got {extra_keys!r}") from None


def per_token_extras(batch: Mapping, extra_keys, shape) -> dict:
    """The declared per-token tensors given (`extra_keys`), each checked to be [B, S, ...] with [B, S] = `shape`."""
    extras = {}
    for key in extra_keys:
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[:2]) != shape:
            raise ValueError(f"extra key {key!r} must be a per-token [B, S, ...] tensor with [B, S] = {shape}, "
                             f"got {tuple(getattr(value, 'shape', ())) or type(value).__name__}")
        extras[key] = value
    return extras


def check_vocab_size(vocab_size) -> None:
    """`vocab_size` is None or a positive int at most 2**63 - 1 (ids are compared with it as int64), else a
    ValueError naming it."""
    if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if vocab_size is not None and vocab_size > INT64_MAX:  # ids are compared with it as int64
        raise ValueError(f"vocab_size must be at most 2**63 - 1 (ids are int64), got {vocab_size}")
