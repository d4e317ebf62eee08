"""The step's comparison of a packed micro-batch's boundaries no packer made with its pack plan: every field of a
`PackedSeqParams` that is not the packer's (`MicroBatch.checked_boundaries`) and a `rope_cu_seqlens` that is not the
plan's own tensor. The plan's host ints decide each one without a read, but boundary sets held in new tensors and a
`max_seqlen_*` given as a tensor, which ride the step's one read (`train.unpacked_checks.check_unpacked_fields`).
Once the read found them equal, the micro-batch takes the plan's own tensors (`with_the_plans_tensors`), so that
`localize` builds the CP index from the plan's host ints, as for the packer's own boundaries. A micro-batch without a
plan (`plan=None, indices=None`) has its `max_seqlen_*` and `pad_between_seqs` held to the same rules
(`check_max_seqlen`, `check_pad_between_seqs`) against its own boundary sets, read with its positions
(`queue_own_boundary_fields`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_vlm_packing.packing.indices import PackIndices
from megatron_vlm_packing.packing.micro_batch import MicroBatch, boundaries_mark

if TYPE_CHECKING:  # unpacked_checks imports this module
    from megatron_vlm_packing.train.unpacked_checks import OneRead

_SETS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
_PARAMS_FIX = ("the micro-batch's positions, padding mask, labels and CP index were made from the plan's documents, "
               "so attention over these would join or split them silently (a transform or a replace of "
               "packed_seq_params): keep the packer's boundaries (another max_seqlen_* is fine), or give each document "
               "its own when packing (pack_batch with document_lengths=)")
_ROPE_FIX = ("rope_cu_seqlens says where each document's rotary positions restart, for a rotary of the user's that "
             "reads it: the real boundaries of the plan the positions were made from, full length on every CP rank "
             "(localize does not cut it); keep the packer's (PackIndices.cu_seqlens)")


def plan_boundary_ints(indices: PackIndices) -> dict[str, list[int]]:
    """{"real": [N+1] cumulative real lengths, "physical": [N+1] cumulative physical lengths} of `indices`' plan,
    host ints."""
    plan = indices.plan
    return {"real": [0, *itertools.accumulate(plan.real_lengths)],
            "physical": [0, *itertools.accumulate(plan.physical_lengths)]}


def queue_plan_boundaries(micro_batch: MicroBatch, checks: OneRead) -> bool:
    """Whether a packed micro-batch's boundaries are the ones its positions, padding mask, labels and CP index were
    made from: the packer's own `PackedSeqParams` (`boundaries_checked`; or declared by a control,
    `packing.micro_batch.declare_boundaries`), or other ones whose every field fits the plan (`indices`): each
    boundary set equal to the plan's (a set that is the plan's own tensor is known without a read, the others are
    queued on `checks` and compared at its read), `max_seqlen_*` at least the plan's longest physical document
    (`queue_max_seqlen`) and `pad_between_seqs` as the packer sets it (`check_pad_between_seqs`); `qkv_format` and
    the sets' types `packed_params_checks.check_packed_seq_params` checks. False when there is no plan to compare
    with (built with `plan=None, indices=None`): the positions are read then.

    Raises:
        ValueError: malformed boundaries (`packed_params_checks.check_packed_seq_params`), another
            `pad_between_seqs`; now or at the read, a boundary set other than the plan's (documents merged, a
            boundary shifted, another padded set), naming it, the entry (where which document starts) and both
            values, or a short `max_seqlen_*`.
    """
    if micro_batch.boundaries_checked:
        return True
    from megatron_vlm_packing.packing.packed_params_checks import check_packed_seq_params

    indices = micro_batch.indices
    if not isinstance(indices, PackIndices):
        return False
    check_packed_seq_params(micro_batch)  # metadata only: thd, integer [N+1] sets on one device
    params = micro_batch.packed_seq_params
    check_pad_between_seqs(params, indices.plan.real_lengths, indices.plan.physical_lengths, "the pack plan")
    expected = plan_boundary_ints(indices)
    sets = [(f"packed_seq_params.{label}", cu, kind) for label, cu, kind in _boundary_sets(params)]
    queue_equal_sets(sets, indices, expected, checks, _PARAMS_FIX)
    queue_max_seqlen(params, indices.plan.max_seqlen, checks)
    return True


def queue_equal_sets(sets: list[tuple[str, torch.Tensor, str]], indices: PackIndices, expected: dict[str, list[int]],
                     checks: OneRead, fix: str) -> None:
    """Refuse (now, or at `checks`' read) each set of `sets` ((name, [N+1] tensor, "real" / "physical")) that is not
    `expected[kind]`: a set that is the plan's own tensor (`indices`) is known without a read, the others are
    read together at `checks`' read."""
    # the plan's own tensors (one, without pad slots: both lists are then equal)
    values = {id(indices.cu_seqlens): expected["real"], id(indices.cu_seqlens_padded): expected["physical"]}
    unread = list({id(cu): cu for _, cu, _ in sets if id(cu) not in values}.values())

    def differs(host: list) -> bool:  # host: the unread sets' values, in order
        flat = iter(host)
        values.update({id(cu): [next(flat) for _ in range(cu.numel())] for cu in unread})
        return any(values[id(cu)] != expected[kind] for _, cu, kind in sets)

    def refuse() -> None:
        label, cu, kind = next(entry for entry in sets if values[id(entry[1])] != expected[entry[2]])
        refuse_boundaries(label, values[id(cu)], f"the pack plan's {kind} boundaries", expected[kind], fix,
                          owner="the plan's")

    if unread:  # boundaries no packer made: read with the other checks
        checks.add(torch.cat([cu.reshape(-1).long() for cu in unread]), differs, refuse)
    elif differs([]):  # the plan's own tensors in other roles (a real set as the physical one): no read
        refuse()


def queue_max_seqlen(params, longest: int, checks: OneRead) -> None:
    """`check_max_seqlen` of `max_seqlen_q` / `max_seqlen_kv` (types checked by
    `packed_params_checks.check_packed_seq_params`) against `longest`, the plan's longest physical document: ints
    now, a one-value tensor at `checks`' read."""
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(params, name)
        if isinstance(value, torch.Tensor):
            held = {}

            def short(host: list, name=name, held=held) -> bool:
                held[name] = host[0]
                return host[0] < longest

            checks.add(value.reshape(1).long(), short,
                       lambda name=name, held=held: check_max_seqlen(name, held[name], longest))
        else:
            check_max_seqlen(name, value, longest)


def check_max_seqlen(name: str, value: int, longest: int) -> None:
    """The rule for `packed_seq_params.<name>` (a host int; None is refused before,
    `packed_params_checks.check_packed_seq_params`): at least `longest`, the longest physical document, since flash
    and TE kernels size their grid by it and leave the rest of a longer document uncomputed, silently. A larger one
    is what a fixed kernel grid (CUDA graphs) uses, and is harmless.

    Raises:
        ValueError: naming the field, its value and `longest`.
    """
    from megatron_vlm_packing.packing.packed_params_checks import refuse_short_max_seqlen

    if value < longest:
        refuse_short_max_seqlen(name, value, longest)


def pad_between_seqs_of(params) -> bool | None:
    """`params.pad_between_seqs` (None when the installed `PackedSeqParams` has none), a bool or None.

    Raises:
        ValueError: a value that is no bool (or None), naming its type.
    """
    value = getattr(params, "pad_between_seqs", None)
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"packed_seq_params.pad_between_seqs must be a bool or None, got {type(value).__name__} "
                         f"{value!r}")
    return value


def check_pad_between_seqs(params, real_lengths, physical_lengths, owner: str) -> None:
    """The rule for `pad_between_seqs` (Megatron-Core >= 0.19 hands it to TE): None, True, or False only where no
    document has pad slots (`real_lengths` == `physical_lengths`, host ints: the plan's, or read from the sets of a
    micro-batch without one, `owner` naming which): the packer sets True exactly when a document has pad slots,
    and TE given False takes the padded set as the real one (the pad slots as tokens). True without pad slots only
    keeps FlashAttention off (TE's padded kernels read the same sets); None makes TE infer it from the two sets.

    Raises:
        ValueError: a value that is no bool (or None), or False over pad slots, naming the first padded document.
    """
    value = pad_between_seqs_of(params)
    if value is None or value or list(real_lengths) == list(physical_lengths):
        return
    document, (real, physical) = next((i, pair) for i, pair in enumerate(zip(real_lengths, physical_lengths))
                                      if pair[0] != pair[1])
    raise ValueError(f"packed_seq_params.pad_between_seqs is False but {owner} has pad slots (document "
                     f"{document}: {real} real tokens in {physical} slots), as the packer sets it: True; TE given "
                     f"False takes the padded boundaries as the real ones and attends to the pad slots: keep the "
                     f"packer's (or None, which TE infers from the two sets)")


def queue_own_boundary_fields(micro_batch: MicroBatch, checks: OneRead) -> None:
    """A packed micro-batch without a plan (`plan=None, indices=None`, its boundaries no packer's): `max_seqlen_q` /
    `max_seqlen_kv` against the longest physical document of its own q / kv sets (`check_max_seqlen`) and
    `pad_between_seqs` against its own `cu_seqlens_q` / `cu_seqlens_q_padded` (`check_pad_between_seqs`), the rules
    the plan's host ints are held to. The sets (and a tensor `max_seqlen_*`) are queued on `checks` only: call it
    where the step reads such a micro-batch's positions against these boundaries anyway
    (`unpacked_checks.queue_packed_positions`), so they ride that read (the sets' own values are always held to
    `check_own_boundary_values`).

    Raises:
        ValueError: malformed boundaries (`packed_params_checks.check_packed_seq_params`), a `pad_between_seqs`
            that is no bool; at the read, a short `max_seqlen_*` or False over pad slots, as on the plan path.
    """
    from megatron_vlm_packing.packing.packed_params_checks import check_packed_seq_params

    check_packed_seq_params(micro_batch)  # metadata only: well-formed, same-length sets on one device
    params = micro_batch.packed_seq_params
    real = params.cu_seqlens_q
    physical = {"q": params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else real}
    # check_packed_seq_params refused a None cu_seqlens_kv and a None max_seqlen_*
    physical["kv"] = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
    read = {"max_seqlen_q": physical["q"], "max_seqlen_kv": physical["kv"]}
    flag = pad_between_seqs_of(params)  # numpy's False too: `is False` passed np.False_, which TE reads as False
    pads_to_find = flag is not None and not flag and physical["q"] is not real
    sets = {name: getattr(params, name) for name in _SETS if getattr(params, name) is not None}
    tensors = [*sets.values(), *(value for value in (params.max_seqlen_q, params.max_seqlen_kv)
                                 if isinstance(value, torch.Tensor))]
    tensors = list({id(t): t for t in tensors}.values())
    held = {}

    def host_lengths(cu) -> list[int]:
        bounds = held[id(cu)]
        return [end - start for start, end in zip(bounds, bounds[1:])]

    def apply_rules() -> None:
        check_own_boundary_values({name: held[id(cu)] for name, cu in sets.items()},
                                  micro_batch.padding_mask.numel())
        for name, cu in read.items():
            value = getattr(params, name)
            check_max_seqlen(name, held[id(value)][0] if isinstance(value, torch.Tensor) else value,
                             max(host_lengths(cu)))
        if pads_to_find:
            check_pad_between_seqs(params, host_lengths(real), host_lengths(physical["q"]),
                                   "packed_seq_params.cu_seqlens_q_padded")

    def fails(host: list) -> bool:
        flat = iter(host)
        held.update({id(t): [next(flat) for _ in range(t.numel())] for t in tensors})
        try:
            apply_rules()
        except ValueError:
            return True
        return False

    checks.add(torch.cat([t.reshape(-1).long().to(real.device) for t in tensors]), fails, apply_rules)


def check_own_boundary_values(sets: dict[str, list[int]], total: int) -> None:
    """The values of a plan-less pack's boundary sets (`sets`: name -> host ints, those given) lay out its `total`
    slots as the plan's would: each set starts at 0 and never decreases, the physical set (`cu_seqlens_q_padded`,
    else `cu_seqlens_q`) ends at `total`, and no document holds more real tokens than slots. Else the CP index and
    the THD rotary met them first (a RuntimeError there: allocated size, negative repeats), and TE read them as
    given (a set short of the pack's length: its last slots in no document).

    Raises:
        ValueError: naming the set, the entry or document and the values.
    """
    for name, values in sets.items():
        if values[0] != 0:
            raise ValueError(f"packed_seq_params.{name} starts at {values[0]}, not 0: the first document starts at "
                             f"the pack's first slot")
        drop = next((i for i in range(1, len(values)) if values[i] < values[i - 1]), None)
        if drop is not None:
            raise ValueError(f"packed_seq_params.{name} decreases at entry {drop}: {values[drop - 1]} then "
                             f"{values[drop]} (document {drop - 1} would have a negative length)")
    padded = "cu_seqlens_q_padded" if "cu_seqlens_q_padded" in sets else "cu_seqlens_q"
    if sets[padded][-1] != total:
        raise ValueError(f"packed_seq_params.{padded} ends at {sets[padded][-1]} but the micro-batch holds {total} "
                         f"slots: the physical boundaries lay out every slot of the pack")
    real, physical = sets["cu_seqlens_q"], sets[padded]
    _refuse_kv_sets_unlike_q(sets, real, physical)
    over = next(((i, r1 - r0, p1 - p0) for i, (r0, r1, p0, p1) in enumerate(zip(real, real[1:], physical,
                                                                                physical[1:])) if r1 - r0 > p1 - p0),
                None)
    if over is not None:
        raise ValueError(f"packed_seq_params.cu_seqlens_q holds {over[1]} real tokens in document {over[0]} but "
                         f"{padded} gives it {over[2]} slots")


def _refuse_kv_sets_unlike_q(sets: dict[str, list[int]], real: list[int], physical: list[int]) -> None:
    """A plan-less pack's kv sets (those given) equal its q sets: the decoder's self-attention reads one set of
    documents for queries and keys (the plan path holds both to the plan's). Before, only the CPU reference
    attention refused kv sets of their own; TE read them as given."""
    for kv, q, expected in (("cu_seqlens_kv", "cu_seqlens_q", real),
                            ("cu_seqlens_kv_padded", "cu_seqlens_q_padded" if "cu_seqlens_q_padded" in sets
                             else "cu_seqlens_q", physical)):
        given = sets.get(kv)
        if given is not None and given != expected:
            entry = next(i for i, (a, b) in enumerate(zip(given, expected)) if a != b)
            raise ValueError(f"packed_seq_params.{kv} differs from {q} at entry {entry} ({given[entry]} vs "
                             f"{expected[entry]}): self-attention reads one set of documents for queries and keys, "
                             f"so the kv sets must equal the q sets")


def queue_rope_boundaries(micro_batch: MicroBatch, checks: OneRead) -> None:
    """A packed micro-batch's `rope_cu_seqlens` ([N+1] real boundaries, where the rotary restarts; None: none) that is
    not its plan's own `indices.cu_seqlens` must equal the plan's real boundaries (with no plan: `cu_seqlens_q`).
    No rotary of this package reads it (Megatron-Core's THD rotary takes `packed_seq_params`, the mRoPE paths the
    positions), but it travels with the micro-batch for a rotary of the user's, so one replaced by a transform (the
    padded set, another pack's) is refused rather than handed on. The plan's own tensors: no read.

    Raises:
        ValueError: not an [N+1] integer tensor; now or at `checks`' read, naming the entry and both values.
    """
    rope, indices = micro_batch.rope_cu_seqlens, micro_batch.indices
    if not micro_batch.is_packed or rope is None:
        return
    from megatron_vlm_packing.parallel.cp import check_boundary_tensor

    check_boundary_tensor("rope_cu_seqlens", rope)
    if isinstance(indices, PackIndices):
        if rope is not indices.cu_seqlens:
            queue_equal_sets([("rope_cu_seqlens", rope, "real")], indices, plan_boundary_ints(indices), checks,
                             _ROPE_FIX)
        return
    real = getattr(micro_batch.packed_seq_params, "cu_seqlens_q", None)
    if not isinstance(real, torch.Tensor) or rope is real:
        return  # a pack without real boundaries is named by localize's checks
    held = []

    def differs(host: list) -> bool:
        held[:] = [host[:rope.numel()], host[rope.numel():]]
        return held[0] != held[1]

    checks.add(torch.cat([rope.reshape(-1).long(), real.reshape(-1).long().to(rope.device)]), differs,
               lambda: refuse_boundaries("rope_cu_seqlens", held[0],
                                         "the real boundaries of packed_seq_params.cu_seqlens_q", held[1], _ROPE_FIX,
                                         owner="cu_seqlens_q's"))


def with_the_plans_tensors(micro_batch: MicroBatch) -> MicroBatch:
    """`micro_batch` with the plan's own boundary tensors (`indices.cu_seqlens`, `.cu_seqlens_padded`) in place of
    the boundary sets and `rope_cu_seqlens` the step compared equal to them (call it only after that read), the
    new `PackedSeqParams` marked as the plan's (`checked_boundaries`): `localize` then builds the CP index from
    the plan's host ints (`plan_indices_of`), not from a read of the copies, and TE sees one tensor where the plan
    has one. Same values, so the same pack; other fields (`max_seqlen_*`, ...) are kept. Sets on another device
    than the plan's tensors are kept (the read is then `localize`'s). Declared boundaries are never swapped."""
    indices = micro_batch.indices
    if not micro_batch.is_packed or not isinstance(indices, PackIndices):
        return micro_batch
    changes = {}
    if not micro_batch.boundaries_checked:
        params = _on_the_plans_tensors(micro_batch.packed_seq_params, indices)
        if params is not None:
            changes.update(packed_seq_params=params, checked_boundaries=boundaries_mark(params))
    rope = micro_batch.rope_cu_seqlens
    if isinstance(rope, torch.Tensor) and rope is not indices.cu_seqlens and rope.device == indices.device:
        changes["rope_cu_seqlens"] = indices.cu_seqlens
    return replace(micro_batch, **changes) if changes else micro_batch


def _on_the_plans_tensors(params, indices: PackIndices):
    """A shallow copy of `params` whose boundary sets (values already compared equal) are the plan's own tensors;
    None when they are already, or one lies on another device. A copy, not `dataclasses.replace`: that would run
    `PackedSeqParams.__post_init__` again (`seq_idx`, a sync with `total_tokens` set)."""
    own = {"cu_seqlens_q": indices.cu_seqlens, "cu_seqlens_kv": indices.cu_seqlens,
           "cu_seqlens_q_padded": indices.cu_seqlens_padded, "cu_seqlens_kv_padded": indices.cu_seqlens_padded}
    given = {name: getattr(params, name) for name in _SETS if getattr(params, name) is not None}
    if all(cu is own[name] for name, cu in given.items()) or any(cu.device != indices.device for cu in given.values()):
        return None
    swapped = copy.copy(params)
    for name in given:
        setattr(swapped, name, own[name])
    return swapped


def _boundary_sets(params) -> list[tuple[str, torch.Tensor, str]]:
    """(what to call it, tensor, "real" / "physical") for each boundary set attention reads: `cu_seqlens_q` / `_kv`
    (real), `cu_seqlens_q_padded` / `_kv_padded` (physical), or the real set again where the padded one is None
    (attention then takes it as the physical set)."""
    sets = [(f"cu_seqlens_{side}", getattr(params, f"cu_seqlens_{side}"), "real") for side in ("q", "kv")]
    for side in ("q", "kv"):
        padded = getattr(params, f"cu_seqlens_{side}_padded")
        if padded is not None:
            sets.append((f"cu_seqlens_{side}_padded", padded, "physical"))
        else:
            sets.append((f"cu_seqlens_{side} (the physical boundaries: cu_seqlens_{side}_padded is None)",
                         getattr(params, f"cu_seqlens_{side}"), "physical"))
    return [(label, cu, kind) for label, cu, kind in sets if cu is not None]


def refuse_boundaries(label: str, got: list[int], reference: str, wanted: list[int], fix: str, *, owner: str) -> None:
    """ValueError: `label` holds `got`, not `reference`'s `wanted` (the first entry that differs, `owner`'s value, or
    the document counts), then `fix`."""
    def shown(values: list[int]) -> str:
        return str(values) if len(values) <= 12 else f"[{', '.join(map(str, values[:8]))}, ..., {values[-1]}]"

    def documents(values: list[int]) -> str:
        return f"{len(values) - 1} document{'' if len(values) == 2 else 's'}"

    head = f"{label} is {shown(got)}"
    if len(got) != len(wanted):
        where = f"{head} ({documents(got)}) but {reference} are {shown(wanted)} ({documents(wanted)})"
    else:
        entry = next(i for i, (a, b) in enumerate(zip(got, wanted)) if a != b)
        place = "the start of the pack" if entry == 0 else \
            "the end of the last document" if entry == len(wanted) - 1 else f"where document {entry} starts"
        where = f"{head} but {reference} are {shown(wanted)}: entry {entry} ({place}) is {got[entry]}, {owner} " \
                f"{wanted[entry]}"
    raise ValueError(f"{where}; {fix}")
