"""Checks of the `PackedSeqParams` a core attention receives (user-built ones included).

Two kinds: metadata checks (type, shape, dtype, device; no host read, fit for the GPU hot path) and
`read_thd_boundaries`, which reads both boundary sets once and checks their values: for the reference
backend, which needs the values on the host anyway.

Shape legend: N = documents, T = physical packed tokens (all CP ranks), Tq = local tokens, B = rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.parallel.cp import check_boundary_tensor

_SHOWN = 8  # offending documents named in a message


def refuse_ignored_boundaries(params, query: torch.Tensor) -> None:
    """A dense call (`qkv_format` not "thd") whose `cu_seqlens_q` describe more than one document per row.

    Megatron-Core runs attention on dense [S, B, H, D] rows unless `qkv_format == "thd"` (and
    `PackedSeqParams.qkv_format` defaults to None), so a pack whose params forgot the format
    trained as one causal document: the boundaries were ignored. Per-row boundaries (N == B, Megatron's
    LLaVA "sbhd" padding form) are left alone. Metadata only.

    Raises:
        ValueError: `cu_seqlens_q` given with N != B documents, or a query that is not [S, B, H, D].
    """
    cu = getattr(params, "cu_seqlens_q", None) if params is not None else None
    if not isinstance(cu, torch.Tensor):
        return
    documents = cu.numel() - 1
    rows = query.shape[1] if query.dim() == 4 else None
    if cu.dim() != 1 or documents != rows:
        raise ValueError(
            f"packed_seq_params.qkv_format is {params.qkv_format!r}, so attention runs on dense rows and ignores "
            f"the boundaries, but cu_seqlens_q holds {documents} documents for a query of shape "
            f"{tuple(query.shape)} ({rows} rows): documents would attend across their boundaries; "
            f"set qkv_format='thd'")


def check_thd_query(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """THD attention takes [Tq, H, D] query and [Tq, Hk, D] key / value. Metadata only."""
    shapes = {name: tuple(x.shape) for name, x in (("query", query), ("key", key), ("value", value))}
    if any(len(shape) != 3 for shape in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
        raise ValueError(f"qkv_format='thd' attention takes query [Tq, H, D] and key / value [Tq, Hk, D] with one Tq, "
                         f"got {shapes}")


def physical_boundary_set(params) -> tuple[str, torch.Tensor]:
    """(name, tensor): `cu_seqlens_q_padded`, else `cu_seqlens_q` (no pad slots: what TE and the
    attention backends fall back to when the padded set is None). Unchecked."""
    if params.cu_seqlens_q_padded is not None:
        return "cu_seqlens_q_padded", params.cu_seqlens_q_padded
    return "cu_seqlens_q", params.cu_seqlens_q


def physical_boundaries_of(params) -> tuple[str, torch.Tensor]:
    """`physical_boundary_set`, metadata checked.

    Raises:
        ValueError: `cu_seqlens_q` missing, or a set that is not an [N+1] integer tensor, or the two
            sets of different lengths.
    """
    if params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None: qkv_format='thd' attention needs the boundaries")
    check_boundary_tensor("packed_seq_params.cu_seqlens_q", params.cu_seqlens_q)
    name, cu = physical_boundary_set(params)
    if name == "cu_seqlens_q_padded":
        check_boundary_tensor("packed_seq_params.cu_seqlens_q_padded", cu)
        if cu.numel() != params.cu_seqlens_q.numel():
            raise ValueError(f"packed_seq_params.cu_seqlens_q_padded has {cu.numel()} entries but "
                             f"cu_seqlens_q has {params.cu_seqlens_q.numel()}: both must be [N+1]")
    return name, cu


def check_max_seqlen_type(params, *, allow_tensor: bool) -> None:
    """`max_seqlen_q` / `max_seqlen_kv` are None, a positive int (numpy's too) or, when allowed, a
    one-value integer tensor. A bool passed as 1; a float reached the kernel. Metadata only."""
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(params, name)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if allow_tensor and value.numel() == 1 and not (value.dtype.is_floating_point or value.dtype == torch.bool):
                continue
            # a tensor's repr shows its values (a host read): name it by metadata
            shown = f"Tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
        elif is_int(value) and value > 0:
            continue
        else:
            shown = f"{type(value).__name__} {value!r}"
        tensor = " (a one-value integer tensor is taken too)" if allow_tensor else ""
        raise ValueError(f"packed_seq_params.{name} must be a positive int, got {shown}{tensor}")


class ThdBoundaries(NamedTuple):
    """Checked boundaries of one THD call.

    Attributes:
        cu_seqlens: [N+1] long on the query's device, real tokens.
        cu_seqlens_padded: [N+1] long on the query's device, physical slots.
        total: T, physical slots of all CP ranks (host int).
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    total: int


def _bad(values) -> str:
    return f"(document, value) {values[:_SHOWN]}{' ...' if len(values) > _SHOWN else ''}"


def read_thd_boundaries(params, *, local_tokens: int, cp_size: int, device: torch.device) -> ThdBoundaries:
    """Both boundary sets of `params` (and `max_seqlen_*`), checked in ONE host read.

    For the reference backend, which needs the values on the host anyway (the mask's size). What was
    computed silently before: real lengths longer than physical ones or decreasing, real boundaries not
    starting at 0, float boundaries (truncated), a `max_seqlen_*` below the longest document (TE and
    varlen kernels size their grid by it and leave the tail uncomputed: the reference is the truth the
    parity suites compare against, so it refuses what the kernels would garble), a kv set other than q's.

    Args:
        params: `PackedSeqParams` with `qkv_format == "thd"`.
        local_tokens: Tq, this rank's tokens (the query's length).
        cp_size: the context-parallel size (physical lengths must be multiples of 2*cp_size when > 1).

    Raises:
        ValueError: naming the field and the numbers.
    """
    physical_name, padded = physical_boundaries_of(params)
    check_max_seqlen_type(params, allow_tensor=True)
    sets = {"cu_seqlens_q": params.cu_seqlens_q, physical_name: padded}
    for name in ("cu_seqlens_kv", "cu_seqlens_kv_padded"):
        cu = getattr(params, name)
        if cu is not None and all(cu is not other for other in sets.values()):
            check_boundary_tensor(f"packed_seq_params.{name}", cu)
            sets[name] = cu
    maxes = {name: getattr(params, name) for name in ("max_seqlen_q", "max_seqlen_kv")
             if isinstance(getattr(params, name), torch.Tensor)}
    on_device = [cu.to(device).long() for cu in sets.values()]
    on_device += [m.to(device).long().reshape(1) for m in maxes.values()]
    flat = torch.cat(on_device).tolist()  # the one host read
    host, at = {}, 0
    for name, cu in sets.items():
        host[name], at = flat[at:at + cu.numel()], at + cu.numel()
    host_max = {name: getattr(params, name) for name in ("max_seqlen_q", "max_seqlen_kv")}
    host_max.update(zip(maxes, flat[at:]))
    real, physical = host["cu_seqlens_q"], host[physical_name]
    _check_values(real, physical, physical_name, host, host_max, local_tokens=local_tokens, cp_size=cp_size)
    cu = on_device[0]
    return ThdBoundaries(cu, on_device[1] if physical_name != "cu_seqlens_q" else cu, physical[-1])


def _check_values(real, physical, physical_name, host, host_max, *, local_tokens, cp_size) -> None:
    if real[0] != 0 or physical[0] != 0:
        raise ValueError(f"packed_seq_params.cu_seqlens_q and {physical_name} must start at 0, got "
                         f"{real[0]} and {physical[0]}")
    real_lengths = [b - a for a, b in zip(real, real[1:])]
    physical_lengths = [b - a for a, b in zip(physical, physical[1:])]
    negative = [(i, n) for i, n in enumerate(real_lengths) if n < 0]
    if negative:
        raise ValueError(f"packed_seq_params.cu_seqlens_q must be non-decreasing, got lengths {_bad(negative)}")
    two_cp = 2 * cp_size if cp_size > 1 else 1
    misfit = [(i, n) for i, n in enumerate(physical_lengths) if n <= 0 or n % two_cp]
    if misfit:
        raise ValueError(f"packed_seq_params.{physical_name}: every document length must be a positive multiple of "
                         f"2*cp_size={two_cp}, got {_bad(misfit)}")
    over = [(i, (r, p)) for i, (r, p) in enumerate(zip(real_lengths, physical_lengths)) if r > p]
    if over:
        raise ValueError(f"packed_seq_params.cu_seqlens_q has more real tokens than {physical_name} has slots: "
                         f"(document, (real, physical)) {over[:_SHOWN]}")
    if physical[-1] != local_tokens * cp_size:
        raise ValueError(f"packed_seq_params.{physical_name}[-1]={physical[-1]} but attention was given "
                         f"{local_tokens} tokens x cp_size {cp_size} = {local_tokens * cp_size}")
    for name in ("cu_seqlens_kv", "cu_seqlens_kv_padded"):
        if name in host and host[name] != (real if name == "cu_seqlens_kv" else physical):
            mine = "cu_seqlens_q" if name == "cu_seqlens_kv" else physical_name
            raise ValueError(f"packed_seq_params.{name}={host[name][:_SHOWN]} differs from {mine}="
                             f"{host[mine][:_SHOWN]}: self-attention takes one boundary set")
    longest = max(physical_lengths)
    short = {name: value for name, value in host_max.items() if value is not None and value < longest}
    if short:
        raise ValueError(f"packed_seq_params {short} below the longest physical document ({longest} slots): "
                         f"attention kernels would leave its tail uncomputed")
