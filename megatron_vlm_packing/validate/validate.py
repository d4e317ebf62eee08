"""`validate_packed_batch`: check what a model is about to receive from any packer.

The checks run in this order, each on what the previous ones settled: boundary sets (well formed,
consistent, aligned, max_seqlen) -> which slots are real (padding mask, source rows or pad id as
evidence; uniform / wrong boundaries) -> targets (loss on pads, labels crossing documents, labels vs
the source) -> image / video / audio placeholders per document -> positions (each document against
the model's index with its own grids, seconds and audio lengths: `model_index`) -> CP partition.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.validate.boundaries import Boundaries, check_alignment, check_boundaries, check_max_seqlen
from megatron_vlm_packing.validate.cp import check_cp_index, check_cp_ranks
from megatron_vlm_packing.validate.documents import Documents, check_padding_mask, make_documents, suspect_pad_tails
from megatron_vlm_packing.validate.inputs import build_inputs
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.positions import check_positions
from megatron_vlm_packing.validate.report import ValidationReport, Violation
from megatron_vlm_packing.validate.source import check_labels_vs_source, match_source
from megatron_vlm_packing.validate.tokens import (
    check_labels_cross_documents, check_loss_on_pad, check_loss_weights, check_loss_without_target, crossings,
)
from megatron_vlm_packing.validate.vision import AudioCoverage, MediaFindings, check_vision


def validate_packed_batch(batch=None, **fields) -> ValidationReport:
    """Check a packed micro-batch from any packer against the packing contract and the bug classes.

    Args:
        batch: a `MicroBatch` / `PackedBatch`, or a mapping with the keys of
            `validate.saved_keys.SAVED_KEYS` (what `megatron-vlm-packing check FILE` reads), or None.
        **fields: any `PackedInputs` field or saved key, overriding the batch's: `input_ids`,
            `labels`, `loss_mask`, `position_ids` ([1, T] or [3, 1, T]), `padding_mask`,
            `packed_seq_params` or `cu_seqlens` / `cu_seqlens_padded` / `max_seqlen`,
            `image_grid_thw` + `image_token_id` (+ video, `second_per_grid_ts`), Qwen3-Omni
            `audio_seqlens` + `audio_token_id` (`audios_per_document`, `audio_n_window`,
            `use_audio_in_video`), `spatial_merge_size`, `source`
            (`SourceRows`: the unpacked rows), the layout (`tp_size`, `cp_size`,
            `sequence_parallel`, `fp8`, or `layout=ParallelLayout`), `cp_ranks`
            ({rank: {"cp_index": ..., "labels": ...}}) or, for a batch saved on one CP rank, its `cp_index`
            (+ `cp_rank`), `pad_token_id`, `mrope`
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
    """Report (and drop, except input_ids) token ids, labels and positions that are not integers, and
    report a padding mask that is not bool.

    The embedding, the cross entropy and the rotary tables index with them, so a float / bool /
    complex tensor is a broken batch even when its values look right; and the 1D checks compare
    through `.long()` / `int()`, which would truncate 2.5 to 2 and pass a wrong position as right.
    [3, T] floating mRoPE positions pass here: Qwen3-Omni's temporal positions are fractional, the rotary
    reads every position as float32, and the 3D checks name a dtype only where that reading changes a position
    (`positions.float64_read_changes`) or a bf16 / fp16 value may be a rounded one that no index judged
    (`positions.half_positions_unjudged`); they compare the values without truncating.
    """
    from dataclasses import replace

    out, changed = [], {}
    for name in ("input_ids", "labels", "position_ids"):
        value = getattr(inputs, name)
        if name == "position_ids" and value is not None and value.dim() == 2 and value.is_floating_point():
            continue
        if value is not None and not is_integer_tensor(value):
            what = "1D positions" if name == "position_ids" and value.dim() == 1 else "it"
            out.append(Violation("dtypes", f"{name} has dtype {value.dtype}; {what} must be an integer tensor "
                                           f"(torch.long / int32)"))
            if name != "input_ids":
                changed[name] = None
            elif value.is_floating_point() and torch.equal(value, value.round()):
                # without input_ids nothing can be checked: keep whole-valued ids, as ids, so the
                # dtype is reported once rather than again by every check that reads them
                changed[name] = value.long()
    mask = inputs.padding_mask
    if mask is not None and mask.dtype != torch.bool:  # its values are still read (nonzero: pad) by later checks
        out.append(Violation("dtypes", f"padding_mask has dtype {mask.dtype}; it must be a bool tensor (True at pad "
                                       f"slots): Megatron-Core's MoE router counts and masks tokens with "
                                       f"~padding_mask, which for an integer mask is -1 / -2 (not its complement)"))
    return replace(inputs, **changed), out


class _Findings(NamedTuple):
    """What a run of checks found: `violations` in check order, the names of the checks that ran
    (`checked`), and (check, reason) pairs for those that could not run (`skipped`)."""

    violations: list[Violation]
    checked: list[str]
    skipped: list[tuple[str, str]]

    def then(self, more: _Findings) -> _Findings:
        """These findings followed by `more` (each list kept in check order)."""
        return _Findings(self.violations + more.violations, self.checked + more.checked, self.skipped + more.skipped)


def run_checks(inputs: PackedInputs) -> ValidationReport:
    """Every check on `inputs` (from `build_inputs`), in the module's order, each on what the previous settled.

    The per-token checks run only when the boundaries can be read, the batch is not localized to one CP
    rank (its `cp_index` is checked instead), the documents lay out exactly the T slots and the ids are
    numbers (not bool or complex: their dtype is reported); otherwise the report says in `skipped` why not.
    """
    inputs, violations = _readable(inputs)
    checked = ["malformed_boundaries", "real_vs_padded", "zero_length_segment"]
    found, bounds = check_boundaries(inputs)
    if bounds is None:
        return ValidationReport(tuple(violations + found), 0, inputs.total, 0, tuple(checked),
                                (("the rest", "the boundaries cannot be read"),))
    so_far = _Findings(violations + found + check_alignment(inputs, bounds) + check_max_seqlen(inputs, bounds),
                       checked + ["alignment", "max_seqlen"], [])
    if inputs.cp_index is not None:
        return _localized_report(inputs, bounds, so_far)
    if not _documents_fill_slots(bounds, inputs.total):
        return _report(inputs, bounds, sum(bounds.real), so_far,
                       ("per-token checks", "the boundaries do not lay the documents out over the T slots"))
    if inputs.input_ids.dtype == torch.bool or inputs.input_ids.is_complex():  # torch.isin refuses both
        return _report(inputs, bounds, sum(bounds.real), so_far, (
            "per-token checks", f"input_ids are {inputs.input_ids.dtype}, not token ids the checks can read"))
    docs, per_token = _per_token_checks(inputs, bounds)
    return _report(inputs, bounds, sum(docs.real), so_far.then(per_token))


def _readable(inputs: PackedInputs) -> tuple[PackedInputs, list[Violation]]:
    """`inputs` with the fields the checks cannot read dropped (`_dtype_checked`, then, unless localized to
    one CP rank, `_shape_checked`), and the violations that say so."""
    inputs, violations = _dtype_checked(inputs)
    if inputs.cp_index is None:
        inputs, found = _shape_checked(inputs)
        violations += found
    return inputs, violations


def _documents_fill_slots(bounds: Boundaries, total: int) -> bool:
    """The physical documents cover exactly the `total` slots, each holding its real tokens (host ints)."""
    return sum(bounds.physical) == total and not any(r > p for r, p in zip(bounds.real, bounds.physical))


def _report(inputs: PackedInputs, bounds: Boundaries, real_tokens: int, findings: _Findings,
            skip_rest: tuple[str, str] | None = None) -> ValidationReport:
    """The report of `findings` over the documents of `bounds`; `skip_rest`: (checks, why) that did not run."""
    skipped = findings.skipped + ([skip_rest] if skip_rest is not None else [])
    return ValidationReport(tuple(findings.violations), bounds.num_documents, inputs.total, real_tokens,
                            tuple(findings.checked), tuple(skipped))


def _localized_report(inputs: PackedInputs, bounds: Boundaries, so_far: _Findings) -> ValidationReport:
    """A batch localized to one CP rank: its `cp_index` ([T/cp]) against TE's partition of the boundaries;
    its sequence tensors hold T/cp slots, so no per-token check runs."""
    local = inputs.cp_index.numel()
    if local == 0 or inputs.total % local:  # T // local would be taken for cp, and an empty index passed
        found = [Violation("cp_partition", f"cp_index has {local} slots: T={inputs.total} is not cp times that")]
    else:
        found = check_cp_index(inputs.cp_index, bounds, inputs.total // local, inputs.cp_rank, inputs.cp_size)
    found = _Findings(found, ["cp_partition"], [])
    return _report(inputs, bounds, sum(bounds.real), so_far.then(found),
                   ("per-token checks", "the batch is localized to one CP rank: validate it before localize, "
                    "with cp_ranks for what each rank received"))


def _per_token_checks(inputs: PackedInputs, bounds: Boundaries) -> tuple[Documents, _Findings]:
    """The checks that read the T slots, in order: which slots are real, targets, the source rows, the
    placeholders, the positions, what each CP rank received. Returns the documents with their real slots
    settled, and the findings."""
    docs, found, skipped = _settle_real_slots(inputs, make_documents(bounds, inputs.total))
    findings = _Findings(found, ["uniform_boundaries", "padding_mask"], skipped)
    crossed, undecided = check_labels_cross_documents(inputs, docs)
    targets = (check_loss_weights(inputs, docs) + check_loss_on_pad(inputs, docs)
               + check_loss_without_target(inputs, docs) + crossed)
    findings = findings.then(_Findings(targets, ["loss_weights", "loss_on_pad", "loss_without_target",
                                                 "labels_cross_documents"],
                                       [("labels_cross_documents", undecided)] if undecided else []))
    findings = findings.then(_source_checks(inputs, docs))
    media = check_vision(inputs, docs)
    findings = findings.then(_vision_findings(inputs, media)).then(_audio_findings(media.audio))
    findings = findings.then(_position_checks(inputs, docs, media))
    if inputs.cp_ranks:
        findings = findings.then(_Findings(check_cp_ranks(inputs, bounds), ["cp_partition"], []))
    return docs, findings


def _source_checks(inputs: PackedInputs, docs: Documents) -> _Findings:
    """Tokens and labels against the unpacked source rows (slots whose label crosses a document are
    skipped: reported already), or why not."""
    if inputs.source is None:
        return _Findings([], [], [("tokens_vs_source, labels_vs_source", "no source rows given")])
    skip_slots = {slot for _, slot, _ in crossings(inputs, docs).found}
    return _Findings(check_labels_vs_source(inputs, docs, skip_slots), ["tokens_vs_source", "labels_vs_source"], [])


def _vision_findings(inputs: PackedInputs, media: MediaFindings) -> _Findings:
    """The placeholders' violations (`check_vision`, every kind), and whether vision ones were checked or why not."""
    if inputs.image_token_id is None and inputs.video_token_id is None:
        skipped = [("vision_placeholders", "no image_token_id / video_token_id given")]
        return _Findings(media.violations, [], skipped)
    return _Findings(media.violations, ["vision_placeholders"], [])


def _audio_findings(audio: AudioCoverage) -> _Findings:
    """Whether audio placeholders were checked against audio_seqlens, or why not (`vision.audio_coverage`)."""
    return _Findings([], ["audio_placeholders"] if audio.checked else [],
                     [("audio_placeholders", audio.skip)] if audio.skip else [])


# Why an index given with 1D positions compared nothing (`megatron-vlm-packing check` recognises it).
POSITIONS_1D = ("position_ids are 1D: the model's index gives [3, T] mRoPE positions, so nothing is compared "
                "with it; documents with image / video placeholders are reported by mrope_channels_identical")


def _position_checks(inputs: PackedInputs, docs: Documents, media: MediaFindings) -> _Findings:
    """Positions per document (`check_positions`) when given; `skipped` says what the model's index did not
    check (never an OK over documents it was not asked about, nor over 1D positions it cannot be compared with)."""
    if inputs.position_ids is None:
        return _Findings([], [], [])
    found, unchecked = check_positions(inputs, docs, media)
    checked, skipped = ["positions_restart", "mrope_channels_identical"], []
    if inputs.mrope and inputs.position_ids.dim() == 1:  # nothing was compared: an OK must not read as compared
        skipped.append(("mrope_positions", POSITIONS_1D))
    elif inputs.mrope:  # mrope_index: the index gave [3, 1, L] positions for every document it was asked about
        checked += ["mrope_index", "mrope_positions"]
    elif inputs.position_ids.dim() == 2:  # say so: an OK must not read as "mRoPE checked"
        skipped.append(("mrope_positions", "no mrope (MRopeConfig or the model's index) given: [3, T] positions "
                        "are checked for restarts and identical channels only"))
    for reason in sorted(set(unchecked.values())):
        ds = sorted(d for d, why in unchecked.items() if why == reason)
        skipped.append(("mrope_positions", f"documents {ds[:16]}{' ...' if len(ds) > 16 else ''}: {reason}"))
    return _Findings(found, checked, skipped)


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
