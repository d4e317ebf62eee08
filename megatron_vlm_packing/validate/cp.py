"""What each context-parallel rank received against TransformerEngine's rule (contract item 5).

TE's THD rule: each physical document is cut into 2*cp equal chunks, rank r keeps chunks r and
2*cp-1-r. Every sequence-aligned tensor a rank receives must be the full tensor at that index;
`input_ids` and `position_ids` may also stay full length (models that merge vision embeddings or
take a full rotary table select their CP tokens themselves).

Shape legend: T = physical packed slots, Tl = T / cp.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.parallel.cp import cp_partition_index
from megatron_vlm_packing.validate.boundaries import Boundaries
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation

_FULL_ALLOWED = ("input_ids", "position_ids")


def _te_index(bounds: Boundaries, cp_size: int, rank: int) -> torch.Tensor | None:
    cu = torch.tensor([0] + [sum(bounds.physical[:i + 1]) for i in range(len(bounds.physical))], dtype=torch.int32)
    try:
        return cp_partition_index(cu, cp_size, rank)
    except ValueError:  # lengths not multiples of 2*cp (or empty): `_unsplittable` says so
        return None


def _unsplittable(bounds: Boundaries, cp_size: int, layout_cp: int) -> list[Violation]:
    """TE cannot cut these documents for `cp_size` ranks: named here unless the layout's own cp is `cp_size`
    (alignment then named it). A cp told only by the ranks (cp_index's size, cp_ranks' count) was checked
    by nothing, and a split of unaligned documents passed as clean."""
    if cp_size == layout_cp:
        return []
    bad = [p for p in bounds.physical if p <= 0 or p % (2 * cp_size)]
    return [Violation("cp_partition", f"the ranks imply cp={cp_size}, but physical lengths {bad[:8]} are not "
                      f"multiples of {2 * cp_size}: TE cannot cut them in 2*cp chunks")]


def check_cp_index(index: torch.Tensor, bounds: Boundaries, cp_size: int, rank: int | None,
                   layout_cp: int = 1) -> list[Violation]:
    """One rank's partition index ([Tl], or [1, Tl] like the rank's other fields): TE's for `rank` (or, rank
    unknown, for some rank); `layout_cp`: the layout's cp (whose alignment was checked already)."""
    if index.dim() == 2 and index.shape[0] == 1:  # a [1, Tl] index was an IndexError in the comparison below
        index = index[0]
    if index.dim() != 1 or not is_integer_tensor(index):  # .long() read 2.25 as 2; torch indexes with ints only
        return [Violation("cp_partition", f"cp_index has dtype {index.dtype} and shape {tuple(index.shape)}; a "
                          f"partition index is [T/cp] integers")]
    ranks = [rank] if rank is not None else list(range(cp_size))
    for r in ranks:
        expected = _te_index(bounds, cp_size, r)
        if expected is None:
            return _unsplittable(bounds, cp_size, layout_cp)
        if torch.equal(index.long(), expected):
            return []
    expected = _te_index(bounds, cp_size, ranks[0])
    where = "rank " + str(rank) if rank is not None else "any rank"
    first = _first_difference(index, expected)
    return [Violation("cp_partition", f"cp_index ({index.numel()} slots) is not TE's zigzag for {where} at cp={cp_size}"
                      f"{first}")]


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    if got.numel() != expected.numel():
        return f"; it has {got.numel()} slots, TE's has {expected.numel()}"
    k = int((got.long() != expected).nonzero()[0])
    return f"; first difference at local slot {k}: {int(got[k])} where TE has {int(expected[k])}"


def _same_values(local: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape and values, whatever the dtypes (int32 labels match int64 ones); casting `local` to `want`'s
    dtype first read float labels 0.5 off as the right ones."""
    if local.shape != want.shape:
        return False
    if local.dtype == want.dtype:
        return torch.equal(local, want)
    if local.is_complex() or want.is_complex():
        return False
    return torch.equal(local.double(), want.double())


def check_cp_ranks(inputs: PackedInputs, bounds: Boundaries) -> list[Violation]:
    """Every rank's `cp_index` and local tensors against the full batch at TE's index."""
    out = []
    cp_size = inputs.cp_size if inputs.cp_size > 1 else len(inputs.cp_ranks)
    full = {"input_ids": inputs.input_ids, "labels": inputs.labels, "loss_mask": inputs.loss_mask,
            "padding_mask": inputs.padding_mask, "position_ids": inputs.position_ids}
    for rank, received in sorted(inputs.cp_ranks.items()):
        if not 0 <= int(rank) < cp_size:  # TE's rule for a rank that does not exist is no rule: it passed as clean
            out.append(Violation("cp_partition",
                                 f"cp_ranks has rank {rank}, but cp={cp_size} has ranks 0..{cp_size - 1}"))
            continue
        expected = _te_index(bounds, cp_size, int(rank))
        if expected is None:
            return out + _unsplittable(bounds, cp_size, inputs.cp_size)
        if received.get("cp_index") is not None:
            out += check_cp_index(torch.as_tensor(received["cp_index"]).cpu(), bounds, cp_size, int(rank),
                                  inputs.cp_size)
        for name, local in received.items():
            if name == "cp_index" or full.get(name) is None:
                continue
            local = torch.as_tensor(local).detach().cpu()
            local = local.reshape(3, -1) if name == "position_ids" and full[name].dim() == 2 else local.reshape(-1)
            want = full[name] if local.shape[-1] == inputs.total and name in _FULL_ALLOWED else \
                full[name].index_select(-1, expected)
            wrong = not _same_values(local, want)
            if wrong:
                out.append(Violation("cp_partition", f"rank {rank}'s {name} ({local.shape[-1]} slots) is not the "
                                     f"full {name} at TE's index for rank {rank} of cp={cp_size}"))
    return out
