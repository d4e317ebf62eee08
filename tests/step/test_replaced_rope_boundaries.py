"""A packed micro-batch whose `rope_cu_seqlens` was replaced after packing (a `transform=`, a `dataclasses.replace`):
it carries no packer's mark, and no rotary of this package reads it (Megatron-Core's THD rotary takes
`packed_seq_params`, the mRoPE paths the positions), but it travels with the micro-batch for a user's rotary that
restarts at its entries. It must be the plan's real boundaries, full length (`localize` does not cut it): the step
compares one that is not the plan's own tensor with the plan (in its one read, or from the plan's host ints) and
refuses another, naming the entry and both values. Before, any tensor of the right type passed silently.

Real Megatron-Core GPTModel (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from tests.step.two_documents import PAD_TO, two_document_setup

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    return two_document_setup()


def _refused(setup, rope_of, message):
    with pytest.raises(ValueError, match=message):
        step_loss(setup["gpt"], setup["text"], pad_to=PAD_TO, transform=lambda mb: R(mb, rope_cu_seqlens=rope_of(mb)))
    with pytest.raises(ValueError, match=message):
        step_loss(setup["gpt"], R(setup["loader"], rope_cu_seqlens=rope_of(setup["loader"])), pad_to=PAD_TO)


def test_a_shifted_rope_cu_seqlens_is_refused(setup):
    _refused(setup, lambda mb: torch.tensor([0, 11, 22], dtype=torch.int32),
             r"rope_cu_seqlens is \[0, 11, 22\] but the pack plan's real boundaries are \[0, 10, 22\]: entry 1 "
             r"\(where document 1 starts\) is 11, the plan's 10; rope_cu_seqlens says where each document's rotary "
             r"positions restart")


def test_the_padded_set_as_rope_cu_seqlens_is_refused_without_a_read(setup):
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_fields

    message = (r"rope_cu_seqlens is \[0, 10, 32\] but the pack plan's real boundaries are \[0, 10, 22\]: entry 2 "
               r"\(the end of the last document\) is 32, the plan's 22")
    _refused(setup, lambda mb: mb.indices.cu_seqlens_padded, message)
    loader = setup["loader"]
    with count_host_syncs() as syncs, pytest.raises(ValueError, match=message):
        check_unpacked_fields(R(loader, rope_cu_seqlens=loader.indices.cu_seqlens_padded), None)
    assert syncs.total == 0, syncs.report()


def test_another_packs_rope_cu_seqlens_is_refused(setup):
    _refused(setup, lambda mb: torch.tensor([0, 5, 10, 22], dtype=torch.int32),
             r"rope_cu_seqlens is \[0, 5, 10, 22\] \(3 documents\) but the pack plan's real boundaries are "
             r"\[0, 10, 22\] \(2 documents\)")


def test_without_a_plan_rope_cu_seqlens_is_compared_with_cu_seqlens_q(setup):
    loader = setup["loader"]
    shifted = R(loader, rope_cu_seqlens=torch.tensor([0, 11, 22], dtype=torch.int32), plan=None, indices=None)
    with pytest.raises(ValueError, match=r"rope_cu_seqlens is \[0, 11, 22\] but the real boundaries of "
                                         r"packed_seq_params\.cu_seqlens_q are \[0, 10, 22\]: entry 1 \(where document "
                                         r"1 starts\) is 11, cu_seqlens_q's 10"):
        step_loss(setup["gpt"], shifted, pad_to=PAD_TO)


def test_the_plans_rope_cu_seqlens_equal_copies_or_none_train_as_the_packers(setup):
    from megatron_vlm_packing.train.unpacked_checks import check_unpacked_fields

    gpt, loader = setup["gpt"], setup["loader"]
    expected = step_loss(gpt, setup["text"], pad_to=PAD_TO)
    for rope, reads in ((loader.rope_cu_seqlens, 0), (loader.rope_cu_seqlens.clone(), 1),
                        (loader.rope_cu_seqlens.long(), 1), (None, 0)):
        item = R(loader, rope_cu_seqlens=rope)
        with count_host_syncs() as syncs:
            check_unpacked_fields(item, None)
        assert syncs.total == reads, syncs.report()
        assert step_loss(gpt, item, pad_to=PAD_TO) == pytest.approx(expected)
