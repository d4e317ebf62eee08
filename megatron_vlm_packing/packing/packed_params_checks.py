"""A packed micro-batch's `PackedSeqParams`, checked from metadata and the plan's host ints (no host read).

`check_packed_seq_params` is the one check of the boundaries' form (thd, integer [N+1] sets of one length on
one device, `max_seqlen_*` of a type both the attention backends and Megatron-Core's rotary take, and, when
the boundaries are the plan's own (`plan_indices_of`), not below the plan's longest document). `localize`
runs it first, and so do the step's reads of boundaries no packer made (`train.plan_boundaries`,
`train.unpacked_checks`), which is why it lives apart from `localize`'s own field checks.

Shape legend: N = documents.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.attention.boundaries import check_max_seqlen_type, physical_boundary_set
from megatron_vlm_packing.packing.indices import PackIndices
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.parallel.cp import check_boundary_tensor


def plan_indices_of(micro_batch: MicroBatch) -> PackIndices | None:
    """The micro-batch's `PackIndices` when its physical boundaries are the plan's own (the plan's host
    ints then describe them exactly: no read needed), else None (hand-built boundaries)."""
    indices = micro_batch.indices
    if isinstance(indices, PackIndices) \
            and physical_boundary_set(micro_batch.packed_seq_params)[1] is indices.cu_seqlens_padded:
        return indices
    return None


def check_packed_seq_params(micro_batch: MicroBatch) -> None:
    """A packed micro-batch's `PackedSeqParams`, checked from metadata and the plan's host ints (no host read).

    Raises:
        ValueError: `qkv_format` is not "thd" (Megatron-Core's attention and rotary then treat the pack
            as dense rows: it trains as one causal document), a boundary set that is missing, not a
            one-dimensional integer tensor, or of another length or device than `cu_seqlens_q`; a
            `rope_cu_seqlens` that is not a one-dimensional integer tensor or on another device; a `max_seqlen_*`
            that is not a positive int (numpy's too) or a 0-dim integer tensor (the attention backends' rule,
            `attention.boundaries.check_max_seqlen_type`, which takes None and any one-value tensor, narrowed to
            what Megatron-Core's rotary takes); a `cu_seqlens_kv` that is None; or, when the boundaries are
            the plan's own, a `max_seqlen_*` below the plan's longest physical document (attention
            kernels size their grid by it and leave the rest of a longer document uncomputed).
    """
    params = micro_batch.packed_seq_params
    if getattr(params, "qkv_format", None) != "thd":
        raise ValueError(f"packed_seq_params.qkv_format must be 'thd' for a packed micro-batch, got "
                         f"{getattr(params, 'qkv_format', None)!r}: Megatron-Core's attention and rotary treat any "
                         f"other format as dense rows, so the whole pack would train as one causal document")
    if params.cu_seqlens_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None: a packed micro-batch needs its real boundaries")
    if params.cu_seqlens_kv is None:
        raise ValueError("packed_seq_params.cu_seqlens_kv is None: Megatron-Core's rotary and attention read the kv "
                         "boundaries too (self-attention: the same sets as cu_seqlens_q)")
    sizes, devices = {}, {}
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded", "cu_seqlens_kv", "cu_seqlens_kv_padded"):
        cu = getattr(params, name)
        if cu is not None:
            check_boundary_tensor(f"packed_seq_params.{name}", cu)
            sizes[name], devices[name] = cu.numel(), str(cu.device)
    if len(set(sizes.values())) > 1:
        raise ValueError(f"packed_seq_params boundary sets must all have N+1 entries, got sizes {sizes}")
    rope = micro_batch.rope_cu_seqlens  # where the rotary restarts: read on the boundaries' device
    if rope is not None:
        check_boundary_tensor("rope_cu_seqlens", rope)
        devices["rope_cu_seqlens"] = str(rope.device)
    if len(set(devices.values())) > 1:
        raise ValueError(f"packed_seq_params boundary sets must all be on one device, got {devices} "
                         f"(rope_cu_seqlens, where the rotary restarts, too)")
    # The attention backends' own rule (one function): what they take passes here, what they refuse fails here.
    check_max_seqlen_type(params, allow_tensor=True)
    indices = plan_indices_of(micro_batch)
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(params, name)
        _refuse_max_seqlen_megatron_cannot_take(name, value)
        # a tensor's value is read in the step's one read (`train.plan_boundaries.queue_max_seqlen`), not here
        if not isinstance(value, torch.Tensor) and indices is not None and value < indices.plan.max_seqlen:
            refuse_short_max_seqlen(name, value, indices.plan.max_seqlen)


def _refuse_max_seqlen_megatron_cannot_take(name: str, value) -> None:
    """A `max_seqlen_*` the backends take but Megatron-Core's rotary does not: None (it sizes its frequency table
    by `max(max_seqlen_q, max_seqlen_kv)`: a TypeError) or a one-value tensor that is not 0-dim (`torch.arange`
    of a [1] tensor: a TypeError). Metadata only."""
    if value is None:
        raise ValueError(f"packed_seq_params.{name} is None: Megatron-Core's rotary sizes its frequency table by "
                         f"it and attention kernels their grid; give the longest physical document (the packers "
                         f"set it)")
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise ValueError(f"packed_seq_params.{name} must be a positive int, got Tensor of shape "
                         f"{tuple(value.shape)} and dtype {value.dtype} (a 0-dim integer tensor is taken too: "
                         f"Megatron-Core's rotary takes no other shape)")


def refuse_short_max_seqlen(name: str, value: int, longest: int) -> None:
    """ValueError: `packed_seq_params.<name>` is `value`, below `longest`, the longest physical document."""
    raise ValueError(f"packed_seq_params.{name}={value} is below the longest physical document ({longest} slots): "
                     f"attention would leave its tail uncomputed")
