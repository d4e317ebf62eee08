"""Checks on the boundary sets alone: well formed, consistent, aligned, covered by max_seqlen.

Shape legend: N = documents, T = physical packed slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation


@dataclass(frozen=True)
class Boundaries:
    """Host view of both boundary sets.

    Attributes:
        starts: N physical start slots (cu_seqlens_padded[:-1]).
        physical: N physical lengths.
        real: N real lengths (cu_seqlens differences); document i's real tokens are the first
            real[i] slots of its physical span (TransformerEngine's THD convention).
        separate_sets: True when a padded set distinct from the real one was given.
    """

    starts: tuple[int, ...]
    physical: tuple[int, ...]
    real: tuple[int, ...]
    separate_sets: bool

    @property
    def num_documents(self) -> int:
        return len(self.real)


def _malformed(name: str, cu: torch.Tensor) -> tuple[str, bool] | None:
    """(problem, fatal) for a boundary tensor, or None. A wrong integer dtype is not fatal."""
    if cu.dim() != 1 or cu.numel() < 2:
        return f"{name} must be [N+1] with N >= 1, got shape {tuple(cu.shape)}", True
    if cu.is_floating_point() or cu.dtype == torch.bool:
        return f"{name} has dtype {cu.dtype}; boundaries are int32", True
    values = cu.tolist()
    if values[0] != 0:
        return f"{name} must start at 0, got {values[:8]}", True
    if min(values) < 0:
        return f"{name} has negative values: {values[:16]}", True
    drops = [i for i in range(len(values) - 1) if values[i + 1] < values[i]]
    if drops:
        i = drops[0]
        return f"{name} is not monotonic: {name}[{i + 1}]={values[i + 1]} < {name}[{i}]={values[i]} ({values[:16]})", True
    if cu.dtype != torch.int32:
        return f"{name} has dtype {cu.dtype}; attention kernels (TE, flash varlen) take int32", False
    return None


def check_boundaries(inputs: PackedInputs) -> tuple[list[Violation], Boundaries | None]:
    """Well-formedness and consistency of cu_seqlens / cu_seqlens_padded (contract items 2, 10).

    Returns the violations and, when both sets can be read as boundaries, their host view.
    """
    if inputs.cu_seqlens is None and inputs.cu_seqlens_padded is None:
        msg = "no cu_seqlens: the model would run the whole pack as one causal document"
        return [Violation("malformed_boundaries", msg)], None
    violations = []
    real_cu = inputs.cu_seqlens if inputs.cu_seqlens is not None else inputs.cu_seqlens_padded
    pad_cu = inputs.cu_seqlens_padded if inputs.cu_seqlens_padded is not None else real_cu
    both = inputs.cu_seqlens is not None and inputs.cu_seqlens_padded is not None
    named = [("cu_seqlens", real_cu), ("cu_seqlens_padded", pad_cu)] if both else \
        [("cu_seqlens" if inputs.cu_seqlens is not None else "cu_seqlens_padded", real_cu)]
    named += [(n, c) for n, c in (("cu_seqlens_kv", inputs.cu_seqlens_kv),
                                  ("cu_seqlens_kv_padded", inputs.cu_seqlens_kv_padded)) if c is not None]
    fatal = False
    for i, (name, cu) in enumerate(named):
        problem = _malformed(name, cu)
        if problem:
            violations.append(Violation("malformed_boundaries", problem[0]))
            fatal |= problem[1] and i < (2 if both else 1)
    if fatal:
        return violations, None
    for name, ours, theirs in (("cu_seqlens_kv", real_cu, inputs.cu_seqlens_kv),
                               ("cu_seqlens_kv_padded", pad_cu, inputs.cu_seqlens_kv_padded)):
        if theirs is not None and theirs.tolist() != ours.tolist():
            q_name = name.replace("_kv", "_q")
            violations.append(Violation("real_vs_padded", f"{name} {theirs.tolist()[:16]} differs from "
                                        f"{q_name} {ours.tolist()[:16]} in a self-attention pack"))
    real_values, pad_values = real_cu.tolist(), pad_cu.tolist()
    if len(real_values) != len(pad_values):
        violations.append(Violation("real_vs_padded", f"cu_seqlens has {len(real_values) - 1} documents but "
                                    f"cu_seqlens_padded has {len(pad_values) - 1}"))
        return violations, None
    real = tuple(b - a for a, b in zip(real_values, real_values[1:]))
    physical = tuple(b - a for a, b in zip(pad_values, pad_values[1:]))
    bounds = Boundaries(starts=tuple(pad_values[:-1]), physical=physical, real=real,
                        separate_sets=inputs.cu_seqlens_padded is not None and inputs.cu_seqlens is not None)
    violations += _consistency(bounds, pad_values[-1], inputs.total)
    return violations, bounds


def _consistency(bounds: Boundaries, padded_total: int, total: int) -> list[Violation]:
    out = []
    empty = [i for i, n in enumerate(bounds.real) if n == 0]
    if empty:
        lengths = [(i, bounds.real[i], bounds.physical[i]) for i in empty[:8]]
        out.append(Violation("zero_length_segment", f"(document, real, physical) lengths {lengths}", tuple(empty)))
    over = [i for i, (r, p) in enumerate(zip(bounds.real, bounds.physical)) if r > p]
    if over:
        pairs = [(i, bounds.real[i], bounds.physical[i]) for i in over[:8]]
        out.append(Violation("real_vs_padded", f"real length > physical length: (document, real, physical) {pairs}",
                             tuple(over)))
    if padded_total != total:
        out.append(Violation("real_vs_padded", f"cu_seqlens_padded ends at {padded_total} but the batch has "
                             f"{total} slots (input_ids)"))
    return out


def check_alignment(inputs: PackedInputs, bounds: Boundaries) -> list[Violation]:
    """Physical lengths a multiple of the segment multiple, T of the total multiple (contract item 2)."""
    seg, tot = inputs.multiples.segment, inputs.multiples.total
    out = []
    bad = [i for i, p in enumerate(bounds.physical) if p % seg]
    if bad:
        out.append(Violation("alignment", f"physical lengths {[bounds.physical[i] for i in bad[:8]]} are not "
                             f"multiples of {seg} (2*cp: TE cuts every document in 2*cp chunks)", tuple(bad)))
    if inputs.total % tot:
        out.append(Violation("alignment", f"T={inputs.total} is not a multiple of {tot} (the total multiple of "
                             f"the layout: cp*tp under SP, 16 per rank slice under FP8)"))
    return out


def check_max_seqlen(inputs: PackedInputs, bounds: Boundaries) -> list[Violation]:
    """max_seqlen_q/kv present (when a PackedSeqParams was given), ints (a Python or numpy int, `bounds.is_int`, or
    a one-value integer tensor: what the attention checks take), covering every document."""
    if inputs.max_seqlen is None:
        return []
    longest = max(bounds.physical)
    out = []
    for name, value in zip(("max_seqlen_q", "max_seqlen_kv"), inputs.max_seqlen):
        if value is None:
            if inputs.has_packed_seq_params:
                out.append(Violation("max_seqlen", f"{name} is None; the longest document has {longest} slots"))
            continue
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 and not value.is_floating_point() else value
        if not is_int(value):
            out.append(Violation("max_seqlen", f"{name} is {value!r} ({type(value).__name__}), not an int"))
        elif value < longest:
            docs = tuple(i for i, p in enumerate(bounds.physical) if p > value)
            out.append(Violation("max_seqlen", f"{name}={value} but the longest document has {longest} slots", docs))
    return out
