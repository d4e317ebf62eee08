"""A packed micro-batch with no plan (`plan=None, indices=None`: built by hand with its `PackedSeqParams` only) has
`max_seqlen_q` / `max_seqlen_kv` and `pad_between_seqs` compared with its own boundaries, by the rules and with the
messages the plan path uses (tests/step/test_replaced_param_fields.py): `max_seqlen_*` at least the longest physical
document of its sets (flash and TE kernels size their grid by it and leave the rest of a longer document uncomputed),
`pad_between_seqs` not False while `cu_seqlens_q_padded` differs from `cu_seqlens_q` (TE then takes the padded set as
the real one). The boundaries ride the read the step makes of such a micro-batch anyway (its positions against its
boundaries): no sync more.

Before, only the positions were read against the boundaries: a short `max_seqlen_*` reached attention (on an
accelerator it trained silently; the CPU reference attention here refuses it itself, with its own message, after
the step) and `pad_between_seqs=False` over pad slots trained silently.

Real Megatron-Core GPTModel (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from tests.step.two_documents import LONGEST, PAD_TO, needs_pad_flag, two_document_setup

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    return two_document_setup()


def _planless(mb, *, copies: bool = False, **fields):
    """`mb` without its plan, with a new `PackedSeqParams` (its boundary tensors, or equal copies) and `fields`."""
    params = mb.packed_seq_params
    if copies:
        real, padded = params.cu_seqlens_q.clone(), params.cu_seqlens_q_padded.clone()
        params = R(params, cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                   cu_seqlens_kv_padded=padded)
    return R(mb, packed_seq_params=R(params, **fields), plan=None, indices=None)


def _refused(setup, message, **fields):
    for copies in (False, True):
        with pytest.raises(ValueError, match=message):
            step_loss(setup["gpt"], _planless(setup["loader"], copies=copies, **fields), pad_to=PAD_TO)


@pytest.mark.parametrize("value", [12, torch.tensor(12)], ids=["int", "tensor"])
@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_kv"])
def test_a_max_seqlen_below_the_longest_document_of_its_boundaries_is_refused(setup, name, value):
    _refused(setup, rf"packed_seq_params\.{name}=12 is below the longest physical document \({LONGEST} slots\): "
                    rf"attention would leave its tail uncomputed", **{name: value})


def test_kv_sets_unlike_the_q_sets_are_refused(setup):
    """Self-attention reads one set of documents for queries and keys: kv sets of their own (real or physical) are
    refused, naming the first entry that differs (before, only the CPU reference attention refused them; TE read
    them as given)."""
    kv_real, kv_padded = torch.tensor([0, 1, 22], dtype=torch.int32), torch.tensor([0, 1, 32], dtype=torch.int32)
    _refused(setup, r"packed_seq_params\.cu_seqlens_kv differs from cu_seqlens_q at entry 1 \(1 vs 10\)",
             cu_seqlens_kv=kv_real, cu_seqlens_kv_padded=kv_padded, max_seqlen_q=LONGEST, max_seqlen_kv=LONGEST)
    _refused(setup, r"packed_seq_params\.cu_seqlens_kv_padded differs from cu_seqlens_q_padded at entry 1 "
                    r"\(12 vs 10\)", cu_seqlens_kv_padded=torch.tensor([0, 12, 32], dtype=torch.int32))


def test_a_max_seqlen_at_or_above_the_longest_document_trains_as_the_packers(setup):
    gpt, loader = setup["gpt"], setup["loader"]
    expected = step_loss(gpt, loader, pad_to=PAD_TO)
    for value in (LONGEST, 64, torch.tensor(LONGEST)):  # None: Megatron-Core's rotary takes max() of both
        item = _planless(loader, copies=True, max_seqlen_q=value, max_seqlen_kv=value)
        assert step_loss(gpt, item, pad_to=PAD_TO) == pytest.approx(expected)


@needs_pad_flag
@pytest.mark.parametrize("false", [False, np.False_], ids=["bool", "numpy"])
def test_pad_between_seqs_false_over_pad_slots_is_refused(setup, false):
    """numpy's False too (a bool here, and TE reads it as False): it passed `is False` and trained silently."""
    _refused(setup, r"packed_seq_params\.pad_between_seqs is False but packed_seq_params\.cu_seqlens_q_padded has pad "
                    r"slots \(document 1: 12 real tokens in 22 slots\), as the packer sets it: True",
             pad_between_seqs=false)


@needs_pad_flag
def test_pad_between_seqs_must_be_a_bool_or_none(setup):
    _refused(setup, r"packed_seq_params\.pad_between_seqs must be a bool or None, got str 'False'",
             pad_between_seqs="False")


@needs_pad_flag
def test_pad_between_seqs_false_without_pad_slots_true_or_none_train_as_the_packers(setup):
    gpt, loader, without_pads = setup["gpt"], setup["loader"], setup["without_pads"]
    assert without_pads.packed_seq_params.pad_between_seqs is False  # the packer's own, real == physical
    expected = step_loss(gpt, without_pads)
    no_padded_sets = R(without_pads.packed_seq_params, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
    for mb in (without_pads, R(without_pads, packed_seq_params=no_padded_sets)):
        assert step_loss(gpt, _planless(mb, pad_between_seqs=False)) == pytest.approx(expected)
    expected = step_loss(gpt, loader, pad_to=PAD_TO)
    for flag in (True, None):
        assert step_loss(gpt, _planless(loader, copies=True, pad_between_seqs=flag), pad_to=PAD_TO) == \
            pytest.approx(expected)


@pytest.mark.parametrize("fields", [dict(max_seqlen_q=LONGEST, max_seqlen_kv=64),
                                    dict(max_seqlen_q=torch.tensor(64), max_seqlen_kv=torch.tensor(LONGEST)),
                                    dict(max_seqlen_q=np.int64(LONGEST), max_seqlen_kv=np.int32(64))],
                         ids=["ints", "tensor", "numpy"])  # None: refused (tests/step/test_params_field_forms.py)
@pytest.mark.parametrize("copies", [False, True])
def test_the_fields_ride_the_read_of_the_positions(setup, fields, copies):
    """The step reads such a micro-batch's positions against its boundaries anyway: one read for all."""
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_fields

    with count_host_syncs() as syncs:
        check_unpacked_fields(_planless(setup["loader"], copies=copies, **fields), None)
    assert syncs.total == 1, syncs.report()


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("fields, message", [
    (dict(cu_seqlens_q_padded=_cu(0, 10, 30), cu_seqlens_kv_padded=_cu(0, 10, 30)),
     r"packed_seq_params\.cu_seqlens_q_padded ends at 30 but the micro-batch holds 32 slots"),
    (dict(cu_seqlens_q_padded=_cu(0, 10, 34), cu_seqlens_kv_padded=_cu(0, 10, 34), max_seqlen_q=64,
          max_seqlen_kv=64), r"packed_seq_params\.cu_seqlens_q_padded ends at 34 but the micro-batch holds 32 slots"),
    (dict(cu_seqlens_q=_cu(0, 10, 10, 22), cu_seqlens_kv=_cu(0, 10, 10, 22), cu_seqlens_q_padded=_cu(0, 20, 10, 32),
          cu_seqlens_kv_padded=_cu(0, 20, 10, 32)),
     r"packed_seq_params\.cu_seqlens_q_padded decreases at entry 2: 20 then 10"),
    (dict(cu_seqlens_q=_cu(0, 10, 5), cu_seqlens_kv=_cu(0, 10, 5)),
     r"packed_seq_params\.cu_seqlens_q decreases at entry 2: 10 then 5"),
    (dict(cu_seqlens_q=_cu(2, 10, 22), cu_seqlens_kv=_cu(2, 10, 22)),
     r"packed_seq_params\.cu_seqlens_q starts at 2, not 0"),
    (dict(cu_seqlens_q=_cu(0, 12, 22), cu_seqlens_kv=_cu(0, 12, 22)),
     r"packed_seq_params\.cu_seqlens_q holds 12 real tokens in document 0 but cu_seqlens_q_padded gives it 10 slots"),
], ids=["ends-short", "ends-long", "padded-decreases", "real-decreases", "starts-late", "real-over-physical"])
def test_boundary_values_that_do_not_lay_out_the_pack_are_refused_by_the_step(setup, fields, message):
    """The step's read of a plan-less pack's positions holds its boundaries' values too: before, these reached the
    CP index / THD rotary (a RuntimeError there: allocated size, negative repeats) or attention (the CPU reference
    names them; TE read a set that does not end at the pack's length as given)."""
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_fields

    for copies in (False, True):
        item = R(_planless(setup["loader"], copies=copies, **fields), rope_cu_seqlens=None)
        with pytest.raises(ValueError, match=message):
            check_unpacked_fields(item, None)
        with pytest.raises(ValueError, match=message):
            step_loss(setup["gpt"], item, pad_to=PAD_TO)


@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_kv"])
def test_a_meta_max_seqlen_is_refused_by_name(setup, name):
    """A 0-dim `max_seqlen_*` on the meta device (no value) cannot move to the model's device: the step's
    refusal named no field."""
    _refused(setup, rf"the micro-batch holds meta tensors \(no values\): packed_seq_params\.{name}; it cannot move",
             **{name: torch.tensor(64, device="meta")})
