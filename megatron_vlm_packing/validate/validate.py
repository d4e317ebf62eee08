"""`validate_packed_batch`: check what a model is about to receive from any packer.

The checks run in this order, each on what the previous ones settled: boundary sets (well formed,
consistent, aligned, max_seqlen) -> which slots are real (padding mask, source rows or pad id as
evidence; uniform / wrong boundaries) -> targets (loss on pads, labels crossing documents, labels vs
the source) -> image / video / audio placeholders per document -> positions (each document against
the model's index with its own grids, seconds and audio lengths: `model_index`) -> CP partition.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.validate.boundaries import check_alignment, check_boundaries, check_max_seqlen
from megatron_vlm_packing.validate.cp import check_cp_index, check_cp_ranks
from megatron_vlm_packing.validate.documents import check_padding_mask, make_documents, suspect_pad_tails
from megatron_vlm_packing.validate.inputs import PackedInputs, build_inputs
from megatron_vlm_packing.validate.positions import check_positions
from megatron_vlm_packing.validate.report import ValidationReport, Violation
from megatron_vlm_packing.validate.source import check_labels_vs_source, match_source
from megatron_vlm_packing.validate.tokens import check_labels_cross_documents, check_loss_on_pad, crossing_slots
from megatron_vlm_packing.validate.vision import check_vision


def validate_packed_batch(batch=None, **fields) -> ValidationReport:
    """Check a packed micro-batch from any packer against the packing contract and the bug classes.

    Args:
        batch: a `MicroBatch` / `PackedBatch`, or a mapping with the keys of
            `validate.inputs.SAVED_KEYS` (what `megatron-vlm-packing check FILE` reads), or None.
        **fields: any `PackedInputs` field or saved key, overriding the batch's: `input_ids`,
            `labels`, `loss_mask`, `position_ids` ([1, T] or [3, 1, T]), `padding_mask`,
            `packed_seq_params` or `cu_seqlens` / `cu_seqlens_padded` / `max_seqlen`,
            `image_grid_thw` + `image_token_id` (+ video, `second_per_grid_ts`), Qwen3-Omni
            `audio_seqlens` + `audio_token_id` (`audios_per_document`, `audio_n_window`,
            `use_audio_in_video`), `spatial_merge_size`, `source`
            (`SourceRows`: the unpacked rows), the layout (`tp_size`, `cp_size`,
            `sequence_parallel`, `fp8`, or `layout=ParallelLayout`), `cp_ranks`
            ({rank: {"cp_index": ..., "labels": ...}}), `pad_token_id`, `mrope`
            (`MRopeConfig` or the model's own index callable).

    Returns:
        A `ValidationReport`; `.ok` is True when nothing is violated. Never raises for bad data.

    Raises:
        ValueError: inputs that cannot be read as a packed batch at all (no input_ids, unknown keys), or a
            placeholder id, merge size or audio window that contradicts the `MRopeConfig` given as `mrope`.
    """
    return run_checks(build_inputs(batch, **fields))


def _shape_checked(inputs: PackedInputs) -> tuple[PackedInputs, list[Violation]]:
    """Drop (and report) sequence tensors whose token dim is not T, so later checks stay meaningful."""
    from dataclasses import replace

    out, drop = [], {}
    for name in ("labels", "loss_mask", "padding_mask", "position_ids"):
        value = getattr(inputs, name)
        if value is not None and value.shape[-1] != inputs.total:
            out.append(Violation("shapes", f"{name} has {value.shape[-1]} slots but input_ids has {inputs.total}"))
            drop[name] = None
    positions = inputs.position_ids
    if positions is not None and positions.dim() == 2 and positions.shape[0] != 3:
        out.append(Violation("shapes", f"position_ids has {positions.shape[0]} channels; mRoPE has 3"))
        drop["position_ids"] = None
    return replace(inputs, **drop), out


def _dtype_checked(inputs: PackedInputs) -> tuple[PackedInputs, list[Violation]]:
    """Report (and drop, except input_ids) token ids, labels and positions that are not integers.

    The embedding, the cross entropy and the rotary tables index with them, so a float / bool /
    complex tensor is a broken batch even when its values look right; and the 1D checks compare
    through `.long()` / `int()`, which would truncate 2.5 to 2 and pass a wrong position as right.
    [3, T] float32 mRoPE positions are valid: Qwen3-Omni's temporal positions are fractional and
    `pack_batch` packs them as float32 (the 3D checks compare them without truncating).
    """
    from dataclasses import replace

    out, changed = [], {}
    for name in ("input_ids", "labels", "position_ids"):
        value = getattr(inputs, name)
        if name == "position_ids" and value is not None and value.dim() == 2 and value.dtype == torch.float32:
            continue
        if value is not None and not is_integer_tensor(value):
            out.append(Violation("dtypes", f"{name} has dtype {value.dtype}; it must be an integer tensor "
                                           f"(torch.long / int32; mRoPE positions may also be float32)"))
            if name != "input_ids":
                changed[name] = None
            elif value.is_floating_point() and torch.equal(value, value.round()):
                # without input_ids nothing can be checked: keep whole-valued ids, as ids, so the
                # dtype is reported once rather than again by every check that reads them
                changed[name] = value.long()
    return replace(inputs, **changed), out


def run_checks(inputs: PackedInputs) -> ValidationReport:
    inputs, violations = _dtype_checked(inputs)
    if inputs.cp_index is None:
        inputs, found = _shape_checked(inputs)
        violations += found
    checked, skipped = ["malformed_boundaries", "real_vs_padded", "zero_length_segment"], []
    found, bounds = check_boundaries(inputs)
    violations += found
    if bounds is None:
        return ValidationReport(tuple(violations), 0, inputs.total, 0, tuple(checked),
                                (("the rest", "the boundaries cannot be read"),))
    violations += check_alignment(inputs, bounds) + check_max_seqlen(inputs, bounds)
    checked += ["alignment", "max_seqlen"]
    if inputs.cp_index is not None:
        cp_size = inputs.total // max(inputs.cp_index.numel(), 1)
        violations += check_cp_index(inputs.cp_index, bounds, cp_size, inputs.cp_rank)
        return ValidationReport(tuple(violations), bounds.num_documents, inputs.total, sum(bounds.real),
                                tuple(checked + ["cp_partition"]),
                                (("per-token checks", "the batch is localized to one CP rank: validate it "
                                  "before localize, with cp_ranks for what each rank received"),))
    if sum(bounds.physical) != inputs.total or any(r > p for r, p in zip(bounds.real, bounds.physical)):
        return ValidationReport(tuple(violations), bounds.num_documents, inputs.total, sum(bounds.real),
                                tuple(checked), (("per-token checks", "the boundaries do not lay the documents "
                                                  "out over the T slots"),))
    docs = make_documents(bounds, inputs.total)
    docs, more, skip = _settle_real_slots(inputs, docs)
    violations += more
    checked += ["uniform_boundaries", "padding_mask"]
    skipped += skip
    violations += check_loss_on_pad(inputs, docs) + check_labels_cross_documents(inputs, docs)
    checked += ["loss_on_pad", "labels_cross_documents"]
    if inputs.source is not None:
        skip_slots = {slot for _, slot, _ in crossing_slots(inputs, docs)}
        violations += check_labels_vs_source(inputs, docs, skip_slots)
        checked += ["tokens_vs_source", "labels_vs_source"]
    else:
        skipped.append(("tokens_vs_source, labels_vs_source", "no source rows given"))
    found, items, failed = check_vision(inputs, docs)
    violations += found
    if inputs.image_token_id is None and inputs.video_token_id is None:
        skipped.append(("vision_placeholders", "no image_token_id / video_token_id given"))
    else:
        checked.append("vision_placeholders")
    media_checked, media_skipped = _audio_checked(inputs)
    checked += media_checked
    skipped += media_skipped
    if inputs.position_ids is not None:
        found, unchecked = check_positions(inputs, docs, items, failed)
        violations += found
        checked += ["positions_restart", "mrope_channels_identical"] + (["mrope_positions"] if inputs.mrope else [])
        if inputs.position_ids.dim() == 2 and not inputs.mrope:  # say so: an OK must not read as "mRoPE checked"
            skipped.append(("mrope_positions", "no mrope (MRopeConfig or the model's index) given: [3, T] positions "
                            "are checked for restarts and identical channels only"))
        for reason in sorted(set(unchecked.values())):  # never an OK over documents the index was not asked about
            ds = sorted(d for d, why in unchecked.items() if why == reason)
            skipped.append(("mrope_positions", f"documents {ds[:16]}{' ...' if len(ds) > 16 else ''}: {reason}"))
    if inputs.cp_ranks:
        violations += check_cp_ranks(inputs, bounds)
        checked.append("cp_partition")
    return ValidationReport(tuple(violations), bounds.num_documents, inputs.total, sum(docs.real),
                            tuple(checked), tuple(skipped))


def _audio_checked(inputs: PackedInputs) -> tuple[list[str], list[tuple[str, str]]]:
    """Whether audio placeholders were checked against audio_seqlens, or why not (only when either is given)."""
    lengths = inputs.audio_seqlens is not None
    if inputs.audio_token_id is not None and lengths:
        return ["audio_placeholders"], []
    if inputs.audio_token_id is not None and bool((inputs.input_ids == inputs.audio_token_id).any()):
        return [], [("audio_placeholders", "no audio_seqlens given")]
    if lengths:
        return [], [("audio_placeholders", "audio_seqlens given but no audio_token_id")]
    return [], []


def _settle_real_slots(inputs: PackedInputs, docs):
    """Which slots are real, from the best evidence given; violations of the boundaries / mask."""
    out, skipped = [], []
    if inputs.padding_mask is not None:
        found, docs = check_padding_mask(inputs, docs)
        out += found
    if inputs.source is not None:
        found, docs = match_source(inputs, docs, trust_spans=inputs.padding_mask is not None)
        out += found
    elif inputs.padding_mask is None:
        found, docs = suspect_pad_tails(inputs, docs)
        out += found
        if inputs.pad_token_id is None:
            skipped.append(("uniform_boundaries", "no padding mask, source rows or pad_token_id: pads inside "
                            "real spans cannot be told from real tokens"))
    return docs, out, skipped
