"""Every field of a `PackedSeqParams` that is not the packer's (a `transform=`, a `dataclasses.replace`), not only its
boundary sets, against the pack plan: `qkv_format` ("thd"), the kv sets (self-attention: the plan's, as the q sets),
`max_seqlen_q` / `max_seqlen_kv` (at least the longest physical document: flash and TE kernels size their grid by
it and leave the rest of a longer document uncomputed; a larger one is what a fixed kernel grid uses, and is
harmless) and `pad_between_seqs` (the packer sets True when the plan has pad slots; False there makes TE take the
padded set as the real one). Before, a `max_seqlen_*` below the plan's longest document beside boundaries equal to
the plan's but held in new tensors, or given as a tensor, and `pad_between_seqs=False` over a plan with pad slots,
trained silently (on an accelerator: the CPU reference attention here refuses a short `max_seqlen_*` itself, with
its own message, after the step). The host ints of the plan decide all of them but a tensor `max_seqlen_*`, which
rides the step's one read.

Real Megatron-Core GPTModel (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from tests.step.two_documents import LONGEST, PAD_TO, needs_pad_flag, two_document_setup

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    return two_document_setup()


def _params(mb, *, copies: bool, **fields):
    """`mb` with a new `PackedSeqParams`: the plan's own boundary tensors, or equal copies (`copies`), and `fields`."""
    params = mb.packed_seq_params
    if copies:
        real, padded = params.cu_seqlens_q.clone(), params.cu_seqlens_q_padded.clone()
        params = R(params, cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                   cu_seqlens_kv_padded=padded)
    return R(mb, packed_seq_params=R(params, **fields))


def _refused(setup, message, **fields):
    for copies in (False, True):
        with pytest.raises(ValueError, match=message):
            step_loss(setup["gpt"], setup["text"], pad_to=PAD_TO, transform=lambda mb: _params(mb, copies=copies,
                                                                                               **fields))
        with pytest.raises(ValueError, match=message):
            step_loss(setup["gpt"], _params(setup["loader"], copies=copies, **fields), pad_to=PAD_TO)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_kv"])
def test_a_max_seqlen_below_the_plans_longest_document_is_refused(setup, name):
    _refused(setup, rf"packed_seq_params\.{name}=12 is below the longest physical document "
                    rf"\({LONGEST} slots\)", **{name: 12})


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_kv"])
def test_a_max_seqlen_tensor_below_the_plans_longest_document_is_refused_at_the_read(setup, name):
    _refused(setup, rf"packed_seq_params\.{name}=12 is below the longest physical document "
                    rf"\({LONGEST} slots\)", **{name: torch.tensor(12)})


def test_a_max_seqlen_at_or_above_the_plans_longest_document_trains_as_the_packers(setup):
    gpt, text = setup["gpt"], setup["text"]
    expected = step_loss(gpt, text, pad_to=PAD_TO)
    for copies in (False, True):
        for value in (LONGEST, 64, torch.tensor(LONGEST)):
            item = _params(setup["loader"], copies=copies, max_seqlen_q=value, max_seqlen_kv=value)
            assert step_loss(gpt, item, pad_to=PAD_TO) == pytest.approx(expected)


@needs_pad_flag
def test_pad_between_seqs_false_over_a_plan_with_pad_slots_is_refused(setup):
    _refused(setup, r"packed_seq_params\.pad_between_seqs is False but the pack plan has pad slots \(document 1: "
                    r"12 real tokens in 22 slots\), as the packer sets it: True", pad_between_seqs=False)


@needs_pad_flag
def test_pad_between_seqs_must_be_a_bool_or_none(setup):
    _refused(setup, r"packed_seq_params\.pad_between_seqs must be a bool or None, got str 'False'",
             pad_between_seqs="False")


@needs_pad_flag
def test_pad_between_seqs_true_or_none_trains_as_the_packers(setup):
    """True makes TE read the padded set (right for any plan; the packer's own value without pad slots is False,
    which lets FlashAttention run); None makes TE infer it from the two sets."""
    gpt, without_pads = setup["gpt"], setup["without_pads"]  # real == physical: the packer says False
    assert without_pads.packed_seq_params.pad_between_seqs is False
    for mb in (setup["loader"], without_pads):
        expected = step_loss(gpt, mb)
        for flag in (True, None):
            assert step_loss(gpt, _params(mb, copies=True, pad_between_seqs=flag)) == pytest.approx(expected)


def test_another_qkv_format_is_refused(setup):
    _refused(setup, r"packed_seq_params\.qkv_format must be 'thd' for a packed micro-batch, got 'sbhd'",
             qkv_format="sbhd")


def test_kv_sets_other_than_the_plans_are_refused(setup):
    """Self-attention takes one boundary set: the kv sets are the plan's, as the q sets."""
    shifted = torch.tensor([0, 11, 22], dtype=torch.int32)
    _refused(setup, r"packed_seq_params\.cu_seqlens_kv is \[0, 11, 22\] but the pack plan's real boundaries are "
                    r"\[0, 10, 22\]: entry 1 \(where document 1 starts\) is 11, the plan's 10", cu_seqlens_kv=shifted)
    _refused(setup, r"packed_seq_params\.cu_seqlens_kv \(the physical boundaries: cu_seqlens_kv_padded is None\) is "
                    r"\[0, 10, 22\] but the pack plan's physical boundaries are \[0, 10, 32\]",
             cu_seqlens_kv_padded=None)


def test_the_fields_are_checked_from_the_plans_host_ints(setup):
    """A new PackedSeqParams over the plan's own tensors with int fields costs no read; a tensor max_seqlen one."""
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_fields

    loader = setup["loader"]
    for fields, reads in ((dict(max_seqlen_q=64, max_seqlen_kv=LONGEST), 0), (dict(max_seqlen_q=torch.tensor(64)), 1)):
        with count_host_syncs() as syncs:
            check_unpacked_fields(_params(loader, copies=False, **fields), None)
        assert syncs.total == reads, syncs.report()


def test_boundaries_found_equal_become_the_plans_own_tensors(setup):
    """After the read, `localize` sees the plan's own tensors (`plan_indices_of`: the CP index from host ints), with
    the other fields as given; declared boundaries and the packer's own are left as they are."""
    from megatron_vlm_packing.packing.packed_params_checks import plan_indices_of
    from megatron_vlm_packing.packing.micro_batch import declare_boundaries
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_fields

    loader = setup["loader"]
    indices = loader.indices
    copies = _params(loader, copies=True, max_seqlen_q=64, max_seqlen_kv=64)
    copies = R(copies, rope_cu_seqlens=loader.rope_cu_seqlens.clone())
    assert plan_indices_of(copies) is None
    checked = check_unpacked_fields(copies, None)
    params = checked.packed_seq_params
    assert params.cu_seqlens_q is indices.cu_seqlens and params.cu_seqlens_kv is indices.cu_seqlens
    assert params.cu_seqlens_q_padded is indices.cu_seqlens_padded
    assert params.cu_seqlens_kv_padded is indices.cu_seqlens_padded
    assert (params.max_seqlen_q, params.max_seqlen_kv) == (64, 64) and checked.rope_cu_seqlens is indices.cu_seqlens
    assert plan_indices_of(checked) is indices and checked.boundaries_checked
    assert copies.packed_seq_params.cu_seqlens_q is not indices.cu_seqlens  # the given params are not changed
    declared = declare_boundaries(loader, copies.packed_seq_params)
    assert check_unpacked_fields(declared, None).packed_seq_params is copies.packed_seq_params
    assert check_unpacked_fields(loader, None) is loader
