"""`PackedSeqParams` fields in forms Megatron-Core's own code cannot take are refused by the step with a ValueError
naming the field, not a TypeError / RuntimeError inside its rotary: `max_seqlen_*` None (the rotary sizes its table
by it: `max(None, None)`) or a one-value tensor of any shape but 0-dim (`torch.arange` of a [1] tensor), and
`cu_seqlens_kv` None (the rotary and attention read the kv sets). A 0-dim integer tensor and ints stay taken.

Real Megatron-Core GPTModel (tiny, CPU, one process), with and without a plan.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from tests.step.two_documents import LONGEST, PAD_TO, two_document_setup

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    return two_document_setup()


def _with(mb, planless: bool, **fields):
    mb = R(mb, packed_seq_params=R(mb.packed_seq_params, **fields))
    return R(mb, plan=None, indices=None) if planless else mb


REFUSED = [
    ("max_seqlen_q None", dict(max_seqlen_q=None), r"packed_seq_params\.max_seqlen_q is None"),
    ("max_seqlen_kv None", dict(max_seqlen_kv=None), r"packed_seq_params\.max_seqlen_kv is None"),
    ("max_seqlen_q [1]", dict(max_seqlen_q=torch.tensor([LONGEST])),
     r"packed_seq_params\.max_seqlen_q must be a positive int, got Tensor of shape \(1,\)"),
    ("max_seqlen_kv [[1]]", dict(max_seqlen_kv=torch.tensor([[LONGEST]])),
     r"packed_seq_params\.max_seqlen_kv must be a positive int, got Tensor of shape \(1, 1\)"),
    ("cu_seqlens_kv None", dict(cu_seqlens_kv=None), r"packed_seq_params\.cu_seqlens_kv is None"),
]


@pytest.mark.parametrize("planless", [False, True], ids=["plan", "planless"])
@pytest.mark.parametrize("name, fields, message", REFUSED, ids=[case[0] for case in REFUSED])
def test_fields_megatron_cannot_take_are_named(setup, name, fields, message, planless):
    with pytest.raises(ValueError, match=message):
        step_loss(setup["gpt"], _with(setup["loader"], planless, **fields), pad_to=PAD_TO)


@pytest.mark.parametrize("planless", [False, True], ids=["plan", "planless"])
def test_a_0_dim_tensor_and_ints_still_train(setup, planless):
    expected = step_loss(setup["gpt"], setup["loader"], pad_to=PAD_TO)
    for value in (torch.tensor(LONGEST), LONGEST, PAD_TO):
        item = _with(setup["loader"], planless, max_seqlen_q=value, max_seqlen_kv=value)
        assert step_loss(setup["gpt"], item, pad_to=PAD_TO) == pytest.approx(expected)
