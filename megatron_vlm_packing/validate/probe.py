"""The sampled parity probe: run one packed micro-batch again, and each of its samples alone, without
gradients, and compare the per-token losses (contract item 1: no cross-sample flow).

A pack that is wrong in a way that changes the numbers (boundaries that merge samples, labels
crossing documents, positions that do not restart, a CP index of the wrong rank) shows up as a loss
difference; above `tolerance` the probe raises `ParityProbeError` with the validator's report of
the same pack, so the message names the broken contract item.

Shape legend: B = rows, S = row length, T = physical packed slots, n = one sample's real tokens.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import torch

from megatron_vlm_packing.packing.media import MediaTokens
from megatron_vlm_packing.validate.packed_inputs import SourceRows
from megatron_vlm_packing.validate.probe_split import SampleMedia, split_rows  # noqa: F401 (importable from here)
from megatron_vlm_packing.validate.report import ValidationReport
from megatron_vlm_packing.validate.validate import validate_packed_batch


@dataclass(frozen=True)
class ProbeResult:
    """Packed vs alone per-token losses of one micro-batch.

    Attributes:
        max_abs_diff: max |loss_packed - loss_alone| over trained tokens.
        mean_abs_diff: mean of the same.
        num_tokens: trained tokens compared.
        per_document: max |diff| of each document (packed order).
        tolerance: the threshold the probe was run with.
    """

    max_abs_diff: float
    mean_abs_diff: float
    num_tokens: int
    per_document: tuple[float, ...]
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def __str__(self) -> str:
        return (f"parity probe: max |dloss| {self.max_abs_diff:.3e}, mean {self.mean_abs_diff:.3e} over "
                f"{self.num_tokens} tokens of {len(self.per_document)} samples (tolerance {self.tolerance:.1e})")


class ParityProbeError(AssertionError):
    """The packed losses differ from the samples' own; carries the result and the validator's report."""

    def __init__(self, result: ProbeResult, report: ValidationReport, worst: str):
        self.result, self.report = result, report
        super().__init__(f"{result}: packing is not exact ({worst})\n{report}")


def _samples(batch: dict, reference, pack_kwargs: dict, image_keywords: dict) -> list[tuple[int, dict]]:
    """Each sample of `batch` alone, its media given by `reference`'s per-sample counts (the packer's), else
    counted with the placeholder ids of `pack_kwargs` / `image_keywords` / `reference`."""
    ids = {k: pack_kwargs.get(k) for k in ("video_token_id", "audio_token_id")}
    tokens = MediaTokens.resolve(pack_kwargs.get("mrope"), **ids, **image_keywords, require_counts=False)
    extra_keys = tuple(getattr(reference, "extras", None) or pack_kwargs.get("extra_keys", ()))
    return split_rows(batch, media=SampleMedia.of(reference, tokens), extra_keys=extra_keys,
                      position_layout=pack_kwargs.get("position_layout"))


def _document_starts(packed) -> list[int]:
    """Physical start slot of each document: from the plan when the pack has one, else its boundaries."""
    plan = getattr(packed, "plan", None)
    if plan is not None:
        starts = [0]
        for n in plan.physical_lengths[:-1]:
            starts.append(starts[-1] + n)
        return starts
    params = packed.packed_seq_params
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    return cu[:-1].tolist()


def _alone(pack: Callable, sample: dict):
    """One sample as its own micro-batch: dense (no packed_seq_params) when it needs no padding."""
    single = pack(sample)
    if single.input_ids.shape[-1] == sample["input_ids" if "input_ids" in sample else "tokens"].shape[-1]:
        single = replace(single, packed_seq_params=None, rope_cu_seqlens=None)
    return single


def _token_differences(packed_loss: torch.Tensor, packed_trained: torch.Tensor, alone_loss: torch.Tensor,
                       alone_trained: torch.Tensor) -> torch.Tensor:
    """|difference| at every token trained in either run ([n] -> [k]); a token trained in only one
    run counts its whole loss (it learns a target it does not have alone, or loses one)."""
    both = packed_trained & alone_trained
    diff = torch.where(both, (packed_loss - alone_loss).abs(),
                       torch.where(packed_trained, packed_loss.abs(), alone_loss.abs()))
    return diff[packed_trained | alone_trained]


def _differences(forward: Callable, packed, rows: list[tuple[int, dict]], pack: Callable):
    """Per-token |differences| of every sample (and of loss on slots of no sample), max per sample."""
    packed_loss = forward(packed).detach().float().reshape(-1)  # [T]
    packed_trained = packed.loss_mask.reshape(-1) != 0
    starts = _document_starts(packed)
    covered = torch.zeros_like(packed_trained)
    diffs, per_doc = [], []
    for d, (_, sample) in enumerate(rows):
        alone = _alone(pack, sample)
        n = sample["input_ids" if "input_ids" in sample else "tokens"].shape[-1]
        window = slice(starts[d], starts[d] + n)
        covered[window] = True
        diff = _token_differences(packed_loss[window], packed_trained[window],
                                  forward(alone).detach().float().reshape(-1)[:n],
                                  alone.loss_mask.reshape(-1)[:n] != 0)
        diffs.append(diff)
        per_doc.append(float(diff.max()) if diff.numel() else 0.0)
    diffs.append(packed_loss[packed_trained & ~covered].abs())  # loss on slots of no sample: pad slots
    return diffs, per_doc


def parity_probe(
    forward: Callable,
    batch: dict,
    *,
    packed=None,
    pack: Callable | None = None,
    tolerance: float = 1e-4,
    image_token_id: int | None = None,
    spatial_merge_size: int | None = None,
    split_by=None,
    **pack_kwargs,
) -> ProbeResult:
    """Packed vs each sample alone, per token, without gradients.

    Args:
        forward: `forward(micro_batch) -> [1, T] / [1, n]` per-token losses (a model called with
            labels), taking what `pack` returns; `packed_seq_params` is None for a sample alone
            when it needs no padding (it then runs dense, causal).
        batch: the collated, right-padded batch the pack was made from: any batch `pack_batch` takes
            (token rows, pre-packed documents, mRoPE inputs, images, videos, audio clips, declared
            `extra_keys`); each sample alone gets exactly its own (`probe_split.split_rows`).
        packed: the packed micro-batch to probe (default: `pack(batch)`); must be full length
            (not localized to a CP rank).
        pack: batch -> micro-batch (default: `pack_batch(**pack_kwargs)`); used for each sample alone too.
        tolerance: largest |loss difference| accepted (fp32: 1e-4; use ~5e-2 under bf16).
        image_token_id, spatial_merge_size: the image placeholder id and merge size (also given to the
            default `pack`); the video / audio ids go in `pack_kwargs` as `pack_batch` takes them.
        split_by: a `MicroBatch` packed from `batch` by the packer, whose per-sample media counts give each
            sample its items (default: `pack(batch)`, never `packed`, which may be the corrupted pack under test).
        **pack_kwargs: for the default `pack` (label_style, mrope, tp_size, sequence_parallel, fp8, ...).

    Returns:
        `ProbeResult`.

    Raises:
        ParityProbeError: the difference exceeds `tolerance` (message: the numbers and the
            validator's report of `packed` against `batch`).
        ValueError: cp_size > 1 or a localized pack (each sample alone runs on one rank's view), or
            a batch the probe cannot split per sample.
    """
    if not is_tolerance(tolerance):  # inf: the probe could never raise; a str: a TypeError after the forwards
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    if pack_kwargs.get("cp_size", 1) != 1 or getattr(packed, "cp_index", None) is not None:
        raise ValueError("the parity probe compares full-length packs: cp_size must be 1 and packed not localized")
    image_keywords = {k: v for k, v in (("image_token_id", image_token_id), ("spatial_merge_size", spatial_merge_size))
                      if v is not None}
    if pack is None:
        from megatron_vlm_packing import pack_batch

        pack = partial(pack_batch, **pack_kwargs, **image_keywords)
    reference = pack(batch) if split_by is None else split_by
    rows = _samples(batch, reference, pack_kwargs, image_keywords)
    packed = reference if packed is None else packed
    if len(_document_starts(packed)) != len(rows):
        result = ProbeResult(float("inf"), float("inf"), 0, (), tolerance)
        raise ParityProbeError(result, _report(packed, batch, image_token_id, spatial_merge_size or 2, pack_kwargs),
                               f"the pack has {len(_document_starts(packed))} documents for {len(rows)} samples")
    with torch.no_grad():
        diffs, per_doc = _differences(forward, packed, rows, pack)
    every = torch.cat(diffs)
    result = ProbeResult(max_abs_diff=float(every.max()) if every.numel() else 0.0,
                         mean_abs_diff=float(every.mean()) if every.numel() else 0.0,
                         num_tokens=every.numel(), per_document=tuple(per_doc), tolerance=tolerance)
    if not result.ok:
        worst = max(range(len(per_doc)), key=per_doc.__getitem__)
        raise ParityProbeError(result, _report(packed, batch, image_token_id, spatial_merge_size or 2, pack_kwargs),
                               f"worst: document {worst} (row {rows[worst][0]}), |dloss| {per_doc[worst]:.3e}")
    return result


def is_tolerance(value) -> bool:
    """A finite real >= 0 (numpy scalars too), not a bool: inf would accept every difference, NaN none."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0


def _report(packed, batch: dict, image_token_id, merge: int, pack_kwargs: dict) -> ValidationReport:
    ids = batch["input_ids"] if batch.get("input_ids") is not None else batch["tokens"]
    source = SourceRows(input_ids=ids, attention_mask=batch.get("attention_mask"), labels=batch.get("labels"),
                        label_style=pack_kwargs.get("label_style", "megatron"))
    layout = {k: pack_kwargs[k] for k in ("tp_size", "sequence_parallel", "fp8") if k in pack_kwargs}
    extra = {}
    if image_token_id is not None and batch.get("image_grid_thw") is not None:
        extra = dict(image_token_id=image_token_id, image_grid_thw=batch["image_grid_thw"], spatial_merge_size=merge)
    return validate_packed_batch(packed, source=source, mrope=pack_kwargs.get("mrope"), **layout, **extra)
