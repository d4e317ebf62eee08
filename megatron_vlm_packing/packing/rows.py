"""A collated batch read and checked once, as right-padded rows: what `pack_batch` and `pad_batch` share.

`read_rows` turns a batch dict into a `Rows` value: ids, real-token mask, next-token labels, float
loss weights, positions (mRoPE per row alone, or None for 1D positions restarting per document),
typed vision/audio inputs with per-row counts and declared per-token extras. Every key of the
batch is accounted for: an unknown key is a ValueError naming it, never sorted into a side dict.

Shape legend: B = rows, S = row length.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from megatron_vlm_packing.packing.documents import DOCUMENT_KEY, split_documents
from megatron_vlm_packing.packing.lengths import keep_mask_deferred, real_lengths
from megatron_vlm_packing.packing.media import AUDIO_KEYS, VISION_KEYS, MediaTokens, audio_inputs, vision_inputs
from megatron_vlm_packing.packing.micro_batch import AudioInputs, VisionInputs

IGNORE_INDEX = -100
SEQUENCE_KEYS = ("input_ids", "tokens", "labels", "loss_mask", "attention_mask", "position_ids", "seq_lens")
# Read only by an mRoPE index (`mrope=`): accepted only when one is given.
ROPE_ONLY_KEYS = ("mm_token_type_ids", "use_audio_in_video", "audio_seqlens")
_ROPE_INPUT_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids",
                    "audio_seqlens", "feature_attention_mask", "use_audio_in_video")


@dataclass(frozen=True)
class Rows:
    """One checked, right-padded batch.

    Attributes:
        input_ids: [B, S] long.
        keep: [B, S] bool, True at real tokens.
        lengths: B real lengths (host ints).
        labels: [B, S] long next-token targets (HF labels already shifted inside each row), -100
            where there is none (pads included).
        loss_weights: [B, S] float, the loss weight of each target (0 where there is none).
        positions: [3, B, S] mRoPE positions of each row alone, or None (1D, restarting per document).
        vision, audio: typed media inputs with per-row counts, or None.
        extras: declared per-token tensors, [B, S, ...].
        row_tokens: slots of the collated rows (B*S of the batch as given).
        document_rows: with `document_lengths`, the source row of each row here (one per document).
    """

    input_ids: torch.Tensor
    keep: torch.Tensor
    lengths: list[int]
    labels: torch.Tensor
    loss_weights: torch.Tensor
    positions: torch.Tensor | None
    vision: VisionInputs | None
    audio: AudioInputs | None
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    row_tokens: int = 0
    document_rows: list[int] | None = None


def check_keys(batch, *, extra_keys, mrope) -> None:
    """The batch is a dict whose every key is understood; ValueError naming the first that is not."""
    if not isinstance(batch, Mapping):
        raise ValueError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    builtin = set(SEQUENCE_KEYS) | set(VISION_KEYS) | set(AUDIO_KEYS) | {DOCUMENT_KEY} | set(ROPE_ONLY_KEYS)
    clash = sorted(set(extra_keys) & builtin)
    if clash:
        raise ValueError(f"extra_keys {clash} are batch keys pack_batch/pad_batch already read; declare only other "
                         f"per-token tensors")
    known = builtin - set(ROPE_ONLY_KEYS) | set(extra_keys)
    for key in batch:
        if key in ROPE_ONLY_KEYS and key not in known:
            if mrope is None:
                raise ValueError(f"batch key {key!r} is read only by an mRoPE index, and no mrope= was given")
            continue
        if key not in known:
            raise ValueError(
                f"unknown batch key {key!r}: pack_batch/pad_batch take {sorted(SEQUENCE_KEYS)}, {DOCUMENT_KEY!r}, vision "
                f"{sorted(VISION_KEYS)}, audio {sorted(AUDIO_KEYS)}; declare per-token tensors with extra_keys="
            )


def input_ids_of(batch: Mapping) -> tuple[str, torch.Tensor]:
    """(name, [B, S] integer ids) from exactly one of `input_ids` / `tokens`."""
    keys = [k for k in ("input_ids", "tokens") if batch.get(k) is not None]
    if len(keys) != 1:
        raise ValueError(f"the batch needs exactly one of 'input_ids' or 'tokens', found {keys or 'neither'}")
    ids = batch[keys[0]]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"{keys[0]} must be a [B, S] tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{keys[0]} must hold integer token ids, got dtype {ids.dtype}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{keys[0]} is empty: shape {tuple(ids.shape)}")
    return keys[0], ids.long()


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


def shift_labels_within_rows(labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels (unshifted) to next-token targets, shifted inside each row.

    Args:
        labels: [B, S] long, HF convention (target of position s is labels[s+1]; -100 = ignore).
        keep: [B, S] bool, True at real tokens (right-padded).

    Returns:
        [B, S] long: out[b, s] = labels[b, s+1] while s+1 is a real token of row b, else -100;
        so the last token of a sample never learns the first token of the next (bug class 8).
    """
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    next_is_real = torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    return torch.where(next_is_real, shifted, IGNORE_INDEX)


def _first_bad(bad: torch.Tensor) -> tuple[int, int]:
    """(row, position) of the first True of a [B, S] bool (error path only)."""
    b, t = torch.nonzero(bad)[0].tolist()
    return b, t


def check_label_values(labels: torch.Tensor, keep: torch.Tensor, vocab_size: int | None) -> None:
    """Real tokens' labels are -100 or a token id in [0, vocab_size); ValueError naming row and position."""
    bad = keep & (labels != IGNORE_INDEX) & (labels < 0)
    if vocab_size is not None:
        bad = bad | (keep & (labels >= vocab_size))
    if bool(bad.any()):
        b, t = _first_bad(bad)
        allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"labels row {b} position {t} is {int(labels[b, t])}: a label must be -100 (ignored) or a "
                         f"token id {allowed}; {int(bad.sum())} such label(s)")


def refuse_hf_labels_as_megatron(labels: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor) -> None:
    """Megatron labels are the next token: labels equal to input_ids on every real target are HF labels."""
    target = keep & (labels != IGNORE_INDEX)
    count = int(target.sum())
    if count >= 2 and bool(((labels == input_ids) | ~target).all()):
        raise ValueError(f"labels equal input_ids on all {count} real targets: these are Hugging Face (unshifted) "
                         f"labels; pass label_style=\"hf\" (label_style=\"megatron\" would train the model to copy "
                         f"the current token)")


def check_loss_weights(values: torch.Tensor, keep: torch.Tensor) -> None:
    """Loss weights of real tokens are finite and >= 0; ValueError naming row and position."""
    bad = keep & ~(torch.isfinite(values) & (values >= 0))
    if bool(bad.any()):
        b, t = _first_bad(bad)
        raise ValueError(f"loss_mask row {b} position {t} is {float(values[b, t])}: loss weights must be finite "
                         f"and >= 0")


def labels_and_weights(batch: Mapping, input_ids: torch.Tensor, keep: torch.Tensor, label_style: str,
                       vocab_size: int | None, checks: "DeferredChecks") -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] next-token labels and float loss weights (a float `loss_mask` keeps its values).

    Value checks (label range, HF labels given as Megatron labels, loss weights) are queued on
    `checks`: computed on the device, read back with the lengths in one host sync.
    """
    shape = tuple(keep.shape)
    labels = row_tensor(batch, "labels", shape)
    if labels is None:
        raise ValueError("the batch has no 'labels': pack_batch/pad_batch build training micro-batches")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must hold integer token ids (-100 = ignore), got dtype {labels.dtype}")
    if label_style not in ("hf", "megatron"):
        raise ValueError(f"label_style must be 'megatron' or 'hf', got {label_style!r}")
    raw = labels.long()
    out_of_range = (raw != IGNORE_INDEX) & (raw < 0)
    if vocab_size is not None:
        out_of_range = out_of_range | (raw >= vocab_size)
    checks.add((keep & out_of_range).any(), lambda: check_label_values(raw, keep, vocab_size))
    if label_style == "hf":
        labels = shift_labels_within_rows(raw, keep)
    else:
        labels = torch.where(keep, raw, IGNORE_INDEX)
        target = keep & (labels != IGNORE_INDEX)
        copies = (target.sum() >= 2) & ((labels == input_ids) | ~target).all()
        checks.add(copies, lambda: refuse_hf_labels_as_megatron(labels, input_ids, keep))
    weights = (labels != IGNORE_INDEX).float()
    loss_mask = row_tensor(batch, "loss_mask", shape)
    if loss_mask is not None:
        if loss_mask.is_complex():
            raise ValueError(f"loss_mask must be real weights, got dtype {loss_mask.dtype}")
        values = loss_mask.float()
        checks.add((keep & ~(torch.isfinite(values) & (values >= 0))).any(), lambda: check_loss_weights(values, keep))
        weights = weights * values
    return labels, weights


class DeferredChecks:
    """Validity flags computed on the device and read back in one host sync (with the lengths).

    Each flag comes with a function that, when the flag reads True, recomputes the details on the
    host and raises the ValueError naming the field and numbers. The clean path costs one sync.
    """

    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []
        self.raisers: list = []

    def add(self, flag: torch.Tensor, raiser) -> None:
        self.flags.append(flag.reshape(1).long())
        self.raisers.append(raiser)

    def read(self, lengths: torch.Tensor | None) -> list[int] | None:
        """Raise the first failed check's error; return `lengths` ([B] device ints) as host ints."""
        parts = ([lengths.long()] if lengths is not None else []) + self.flags
        if not parts:
            return None
        device = parts[0].device
        values = torch.cat([p.to(device) for p in parts]).tolist()  # the one host sync
        count = 0 if lengths is None else lengths.numel()
        for bad, raiser in zip(values[count:], self.raisers):
            if bad:
                raiser()
                raise AssertionError("a failed check did not raise its ValueError")  # a bug here, not in the input
        return values[:count] if lengths is not None else None


def rope_positions(batch: Mapping, input_ids: torch.Tensor, keep: torch.Tensor, mrope, audio) -> torch.Tensor:
    """[3, B, S] positions of each row alone, from an `MRopeConfig` or a callable."""
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
    kwargs = {k: batch[k] for k in _ROPE_INPUT_KEYS if batch.get(k) is not None and k in accepted}
    if audio is not None and "audio_seqlens" in accepted and "audio_seqlens" not in kwargs:
        kwargs["audio_seqlens"] = torch.tensor(audio.audio_lengths)
    result = fn(input_ids, attention_mask=keep.long(), **kwargs)
    positions = result[0] if isinstance(result, tuple) else result
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3 or positions.shape[0] != 3 \
            or tuple(positions.shape[1:]) != tuple(input_ids.shape):
        raise ValueError(f"mrope positions must be [3, B, S] = [3, {input_ids.shape[0]}, {input_ids.shape[1]}], "
                         f"got {tuple(getattr(positions, 'shape', ()))}")
    return positions


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
    if position_layout not in (None, "3BS", "B3S"):
        raise ValueError(f"position_layout must be '3BS' or 'B3S', got {position_layout!r}")
    batch_size, row_length = shape
    if given.dim() == 2:
        if tuple(given.shape) != shape:
            raise ValueError(f"position_ids has shape {tuple(given.shape)} but input_ids is {shape}")
        return dict(batch)
    if given.dim() != 3:
        raise ValueError(f"position_ids must be [B, S] or mRoPE [3, B, S], got shape {tuple(given.shape)}")
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


def check_1d_positions(given: torch.Tensor, keep: torch.Tensor) -> None:
    """[B, S] position_ids are recomputed from the lengths: they must be 0..n-1 on each row's real tokens.

    Positions that restart inside a row mean the row holds several documents: that is declared with
    `document_lengths`, never guessed (and never silently replaced by one arange per row).
    """
    expected = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    bad = keep & (given != expected)
    if bool(bad.any()):
        b, t = _first_bad(bad)
        hint = " (it restarts: a row with several documents? give document_lengths)" if int(given[b, t]) == 0 else ""
        raise ValueError(f"position_ids row {b} position {t} is {int(given[b, t])}, expected {t}{hint}; 1D positions "
                         f"are computed from the real lengths (restarting per document)")


def queue_position_checks(batch: Mapping, keep: torch.Tensor, mrope, checks: DeferredChecks) -> None:
    """Refuse [3, B, S] positions beside mrope= now; queue the check of [B, S] positions."""
    given = batch.get("position_ids")
    if given is None:
        return
    if mrope is not None and given.dim() == 3:
        raise ValueError("the batch has [3, B, S] position_ids and mrope= was given: pass one of them")
    if given.dim() == 2:
        expected = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
        checks.add((keep & (given != expected)).any(), lambda: check_1d_positions(given, keep))


def batch_positions(batch: Mapping, input_ids: torch.Tensor, keep: torch.Tensor, mrope, audio) -> torch.Tensor | None:
    """[3, B, S] mRoPE positions (computed, or given in the batch), or None for 1D positions.

    Run after `queue_position_checks` and the checks' read."""
    given = batch.get("position_ids")
    if mrope is not None:
        return rope_positions(batch, input_ids, keep, mrope, audio)
    if given is not None and given.dim() == 3:
        return given
    return None  # 1D positions: each document restarts at 0


def check_pad_token_id(pad_token_id) -> int:
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative int (the id written at pad slots), got {pad_token_id!r}")
    return pad_token_id


def check_ids(input_ids: torch.Tensor, keep: torch.Tensor, vocab_size: int | None, name: str) -> None:
    bad = keep & (input_ids < 0)
    if vocab_size is not None:
        bad = bad | (keep & (input_ids >= vocab_size))
    if bool(bad.any()):
        b, t = _first_bad(bad)
        raise ValueError(f"{name} row {b} position {t} is {int(input_ids[b, t])}: token ids must lie in "
                         f"[0, {vocab_size if vocab_size is not None else 'vocab_size'})")


def _extras(batch: Mapping, extra_keys, shape) -> dict:
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


def read_rows(batch, *, label_style: str, mrope, media: MediaTokens, extra_keys=(), vocab_size: int | None = None,
              position_layout: str | None = None) -> Rows:
    """Check a collated batch and read it into `Rows` (see the module docstring).

    With `document_lengths` in the batch every document becomes a row of its own first
    (`documents.split_documents`); `Rows.document_rows` then names each one's source row.
    """
    check_keys(batch, extra_keys=extra_keys, mrope=mrope)
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    name, input_ids = input_ids_of(batch)
    source_shape = tuple(input_ids.shape)
    for key in ("labels", "loss_mask"):
        row_tensor(batch, key, source_shape)
    _extras(batch, extra_keys, source_shape)
    batch = normalize_positions(batch, source_shape, position_layout)
    document_rows = None
    if batch.get(DOCUMENT_KEY) is not None:
        batch, document_rows = split_documents(batch, name, extra_keys)
        input_ids = batch[name].long()
    shape = tuple(input_ids.shape)
    mask, seq_lens = batch.get("attention_mask"), batch.get("seq_lens")
    keep, lengths, mask_bad = keep_mask_deferred(batch_size=shape[0], row_length=shape[1], attention_mask=mask,
                                                 seq_lens=seq_lens, device=input_ids.device)
    checks = DeferredChecks()
    if mask_bad is not None:  # raises the detailed mask error (holes, left padding, non-causal 4D)
        checks.add(mask_bad, lambda: real_lengths(batch_size=shape[0], row_length=shape[1], attention_mask=mask))
    bad_ids = (input_ids < 0) if vocab_size is None else ((input_ids < 0) | (input_ids >= vocab_size))
    checks.add((keep & bad_ids).any(), lambda: check_ids(input_ids, keep, vocab_size, name))
    labels, weights = labels_and_weights(batch, input_ids, keep, label_style, vocab_size, checks)
    queue_position_checks(batch, keep, mrope, checks)
    read = checks.read(keep.sum(dim=1) if lengths is None else None)  # the one host sync
    lengths = read if lengths is None else lengths
    vision = vision_inputs(batch, input_ids, keep, media)
    audio = audio_inputs(batch, input_ids, keep, media)
    return Rows(input_ids=input_ids, keep=keep, lengths=lengths, labels=labels, loss_weights=weights,
                positions=batch_positions(batch, input_ids, keep, mrope, audio), vision=vision, audio=audio,
                extras=_extras(batch, extra_keys, shape), row_tokens=source_shape[0] * source_shape[1],
                document_rows=document_rows)
