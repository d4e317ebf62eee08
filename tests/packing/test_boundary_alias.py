"""The THD boundaries we hand Megatron-Core / Transformer Engine, as TE reads them on an accelerator.

TE's `DotProductAttention` needs `pad_between_seqs`. Megatron-Core >= 0.19 passes ours (a host bool); older
ones cannot, and TE then infers it from the two boundary sets: by identity (TE >= 2.18: distinct tensors mean
"padding between documents", which turns FlashAttention 2 / 4 off) or with `torch.equal` (TE <= 2.17: two host
syncs per layer on CUDA unless both sides are one tensor). So with no pad slots the two sets must be ONE tensor
object on every device, not only on the CPU (benchmarks/results/thd_step_syncs_desk_study.md). The "meta"
device takes the accelerator branch of `PackIndices` on a CPU-only machine.
"""

import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.packing import PackMultiples, pack_batch
from megatron_vlm_packing.packing.batch import make_packed_seq_params
from megatron_vlm_packing.packing.collate import map_tensors
from megatron_vlm_packing.packing.indices import plan_indices
from megatron_vlm_packing.packing.plan import make_pack_plan

HAS_PAD_BETWEEN_SEQS = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}


def _check_thd_params(params: PackedSeqParams, *, aliased: bool, n_docs: int) -> None:
    assert (params.cu_seqlens_q_padded is params.cu_seqlens_q) is aliased
    assert params.cu_seqlens_kv is params.cu_seqlens_q and params.cu_seqlens_kv_padded is params.cu_seqlens_q_padded
    for cu in (params.cu_seqlens_q, params.cu_seqlens_q_padded):
        assert cu.dtype == torch.int32 and cu.shape == (n_docs + 1,) and cu.is_contiguous()
    # Python ints: TE derives a missing max_seqlen with `.max().item()` per layer (a sync), Megatron's rotary
    # length from them (`max(max_seqlen_q, max_seqlen_kv)`) with no tensor in sight.
    assert type(params.max_seqlen_q) is int and type(params.max_seqlen_kv) is int
    if HAS_PAD_BETWEEN_SEQS:  # Megatron-Core >= 0.19 forwards it to TE: no inference there at all
        assert params.pad_between_seqs is (not aliased)
    # Set, total_tokens makes PackedSeqParams build seq_idx with repeat_interleave (a sync on CUDA).
    assert getattr(params, "total_tokens", None) is None


def test_boundaries_are_one_tensor_without_pad_slots_on_every_device():
    plan = make_pack_plan([5, 0, 3, 7], row_capacity=8)
    for device in ("cpu", "meta"):
        indices = plan_indices(plan, device)
        assert indices.cu_seqlens.device.type == device
        _check_thd_params(make_packed_seq_params(plan, indices), aliased=True, n_docs=3)
    assert plan_indices(plan).cu_seqlens.tolist() == [0, 5, 8, 15]


def test_boundaries_stay_two_tensors_with_pad_slots():
    plan = make_pack_plan([5, 0, 3], row_capacity=8, multiples=PackMultiples(segment=4, total=4))
    for device in ("cpu", "meta"):
        _check_thd_params(make_packed_seq_params(plan, plan_indices(plan, device)), aliased=False, n_docs=2)
    on_cpu = plan_indices(plan)
    assert (on_cpu.cu_seqlens.tolist(), on_cpu.cu_seqlens_padded.tolist()) == ([0, 5, 8], [0, 8, 12])


def test_moving_a_micro_batch_keeps_the_boundaries_one_tensor():
    ids = torch.tensor([[3, 4, 5, 0], [6, 7, 8, 9]])
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": (ids != 0).long()},
                        label_style="hf")
    moved = map_tensors(packed, lambda t: t.to("meta"))
    _check_thd_params(moved.packed_seq_params, aliased=True, n_docs=2)
    assert moved.packed_seq_params.cu_seqlens_q.device.type == "meta"


def test_llava_expanded_boundaries_are_one_tensor_without_pad_slots():
    from megatron_vlm_packing.models.llava import (
        LlavaPackPlan, LlavaSpace, expanded_packed_seq_params, llava_pack_plan,
    )

    space = LlavaSpace(img_seq_len=4, image_token_index=9)
    for opens_with_image, aliased in (([False, False], True), ([False, True], False)):  # an image opener needs a pad
        plan = llava_pack_plan([5, 3], row_capacity=8, row_expansion=[3, 3], opens_with_image=opens_with_image,
                               space=space)
        plan = LlavaPackPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}, space=space,
                             tiles=(1, 1), images_per_document=(1, 1), expansion=(3, 3),
                             opens_with_image=tuple(opens_with_image))
        collapsed = make_packed_seq_params(plan, plan_indices(plan, "meta"))
        expanded = expanded_packed_seq_params(plan, collapsed)
        _check_thd_params(expanded, aliased=aliased, n_docs=2)
        assert expanded.max_seqlen_q == max(plan.expanded_physical)


def test_a_loader_micro_batch_keeps_the_boundaries_one_tensor_through_the_worker_and_the_move():
    """The collator lays the micro-batch out in one buffer, a worker pickles it, the step moves the buffer and
    rebuilds the views: the one boundary tensor must come back as one tensor (else TE sees two sets)."""
    import io
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from megatron_vlm_packing.packing.collate import PackingCollator, micro_batch_to
    from megatron_vlm_packing.packing.localize import localize
    from megatron_vlm_packing.parallel.layout import ParallelLayout

    ids = torch.tensor([[3, 4, 5, 6], [6, 7, 8, 9]])
    for cp_size in (1, 2):
        packed = PackingCollator(label_style="hf", cp_size=cp_size)({"input_ids": ids, "labels": ids})
        sent = io.BytesIO()
        ForkingPickler(sent, pickle.HIGHEST_PROTOCOL).dump(packed)
        moved = micro_batch_to(pickle.loads(sent.getvalue()), torch.device("meta"))
        _check_thd_params(moved.packed_seq_params, aliased=True, n_docs=2)
        assert moved.rope_cu_seqlens is moved.packed_seq_params.cu_seqlens_q is moved.indices.cu_seqlens_padded
        local = localize(moved, ParallelLayout(cp_size=cp_size, cp_rank=0))
        _check_thd_params(local.packed_seq_params, aliased=True, n_docs=2)
