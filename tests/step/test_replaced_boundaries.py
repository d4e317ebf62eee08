"""A packed micro-batch whose `packed_seq_params` were replaced after packing (a `transform=`, a
`dataclasses.replace` of a loader micro-batch) while it keeps the packer's positions, padding mask, labels
and plan: its boundaries are compared with the plan's and refused where they differ, naming the boundary set,
the entry and both values. Before, the positions' mark (`MicroBatch.positions_checked`) vouched for the pack
whatever its boundaries: documents merged into one (bug class 11), boundaries shifted by one, or a physical set
other than the one the padding mask, positions and CP index were made from trained silently.

Without a plan to compare with (`plan=None, indices=None`), the packer's positions no longer vouch for
boundaries it did not make: the step reads them against the new boundaries (`check_unpacked_packed_positions`).
The parity controls, which break the boundaries on purpose, declare them (`declare_boundaries`) and run.

Real Megatron-Core GPTModel (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing.collate import PackingCollator, micro_batch_to, own_storages
from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from tests.step.two_documents import PAD_TO, two_document_setup

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    return two_document_setup()


def _cu(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _boundaries(mb, real, padded):
    """`mb` with both real sets `real` and both physical sets `padded` (None: no padded set)."""
    params = R(mb.packed_seq_params, cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
               cu_seqlens_kv_padded=padded, max_seqlen_q=PAD_TO, max_seqlen_kv=PAD_TO)
    return R(mb, packed_seq_params=params)


# (name, real, padded, what the step names): every one kept the packer's positions and plan.
REPLACED = [
    ("merged into one document", _cu(0, 22), _cu(0, 32),
     r"packed_seq_params\.cu_seqlens_q is \[0, 22\] \(1 document\) but the pack plan's real boundaries are "
     r"\[0, 10, 22\] \(2 documents\)"),
    ("shifted by one", _cu(0, 11, 22), _cu(0, 11, 32),
     r"packed_seq_params\.cu_seqlens_q is \[0, 11, 22\] but the pack plan's real boundaries are \[0, 10, 22\]: "
     r"entry 1 \(where document 1 starts\) is 11, the plan's 10"),
    ("another padded set", None, _cu(0, 12, 32),
     r"packed_seq_params\.cu_seqlens_q_padded is \[0, 12, 32\] but the pack plan's physical boundaries are "
     r"\[0, 10, 32\]: entry 1 \(where document 1 starts\) is 12, the plan's 10"),
    ("no padded set", None, None,
     r"packed_seq_params\.cu_seqlens_q \(the physical boundaries: cu_seqlens_q_padded is None\) is \[0, 10, 22\] "
     r"but the pack plan's physical boundaries are \[0, 10, 32\]: entry 2 \(the end of the last document\) is 22, "
     r"the plan's 32"),
]


def _replace(mb, real, padded):
    return _boundaries(mb, mb.packed_seq_params.cu_seqlens_q if real is None else real, padded)


@pytest.mark.parametrize("name, real, padded, message", REPLACED, ids=[case[0] for case in REPLACED])
def test_replaced_boundaries_of_a_step_packed_micro_batch_are_refused(setup, name, real, padded, message):
    with pytest.raises(ValueError, match=message):
        step_loss(setup["gpt"], setup["text"], pad_to=PAD_TO, transform=lambda mb: _replace(mb, real, padded))


@pytest.mark.parametrize("name, real, padded, message", REPLACED, ids=[case[0] for case in REPLACED])
def test_replaced_boundaries_of_a_loader_micro_batch_are_refused(setup, name, real, padded, message):
    with pytest.raises(ValueError, match=message):
        step_loss(setup["gpt"], _replace(setup["loader"], real, padded), pad_to=PAD_TO)


def test_without_a_plan_the_packers_positions_are_read_against_the_new_boundaries(setup):
    """Nothing to compare with: the positions' mark vouched only for the packer's boundaries."""
    merged = R(_replace(setup["loader"], _cu(0, 22), _cu(0, 32)), plan=None, indices=None)
    assert merged.positions_checked and not merged.boundaries_checked
    with pytest.raises(ValueError, match=r"position_ids restart at 0 at slot 10 inside document 0 \(slots 0\.\.31\), "
                                         r"after 10 real tokens"):
        step_loss(setup["gpt"], merged, pad_to=PAD_TO)


def test_the_plans_boundaries_in_new_params_train_as_the_packers(setup):
    """Another `PackedSeqParams` holding the plan's own boundary tensors (a larger max_seqlen, as for a fixed
    kernel grid), or equal copies of them, is the same pack: no error, the same loss."""
    gpt, packed = setup["gpt"], setup["packed"]
    params = packed.packed_seq_params
    own = R(packed, packed_seq_params=R(params, max_seqlen_q=64, max_seqlen_kv=64))
    copies = _boundaries(packed, params.cu_seqlens_q.clone(), params.cu_seqlens_q_padded.clone())
    expected = step_loss(gpt, setup["text"], pad_to=PAD_TO)
    for item in (own, copies):
        assert step_loss(gpt, item, pad_to=PAD_TO) == pytest.approx(expected)


def test_the_packers_boundaries_keep_their_mark_through_moves_pickles_and_replace(setup):
    packed, loader = setup["packed"], setup["loader"]
    kept = (packed, loader, micro_batch_to(packed, "cpu"), micro_batch_to(loader, "cpu"), own_storages(loader),
            pickle.loads(pickle.dumps(loader)), R(loader, labels=loader.labels.clone()))
    assert all(mb.boundaries_checked for mb in kept)
    assert not R(packed, packed_seq_params=R(packed.packed_seq_params)).boundaries_checked


def test_the_check_reads_only_boundaries_no_packer_made_and_not_the_plans_tensors(setup):
    from megatron_vlm_packing.train.step import check_packed_documents

    packed, loader = setup["packed"], setup["loader"]
    params = loader.packed_seq_params
    for mb, reads in ((packed, 0), (loader, 0), (R(loader, packed_seq_params=R(params, max_seqlen_q=64)), 0),
                      (_boundaries(loader, params.cu_seqlens_q.clone(), params.cu_seqlens_q_padded.clone()), 1)):
        with count_host_syncs() as syncs:
            check_packed_documents(mb)
        assert syncs.total == reads, syncs.report()


def test_declared_boundaries_train_as_they_say(setup):
    """The controls' opt-out: boundaries declared on purpose are neither compared nor read; the pack then trains
    as one document (its loss is not the pack's), which is what the parity controls show a parity check catches."""
    from megatron_vlm_packing.packing.micro_batch import declare_boundaries

    def one_document(mb):
        merged = _replace(mb, _cu(0, 22), _cu(0, 32)).packed_seq_params
        return declare_boundaries(mb, merged)

    declared = step_loss(setup["gpt"], setup["text"], pad_to=PAD_TO, transform=one_document)
    assert declared != pytest.approx(step_loss(setup["gpt"], setup["text"], pad_to=PAD_TO))
    assert declare_boundaries(setup["packed"], setup["packed"].packed_seq_params).boundaries_checked
    with pytest.raises(ValueError, match="declare_boundaries takes a MicroBatch"):
        declare_boundaries(setup["text"], setup["packed"].packed_seq_params)



FRESH = {"packed": lambda text: pack_batch(text, label_style="hf", pad_to=PAD_TO),
         "loader": lambda text: PackingCollator(label_style="hf", pad_to=PAD_TO)(text)}


def _written_in_place(setup, which, **fields):
    """A fresh packer-made micro-batch whose own `PackedSeqParams` object has `fields` written into it
    (`params.cu_seqlens_q = ...`, as a transform might): the micro-batch still holds the packer's object."""
    mb = FRESH[which](setup["text"])
    for name, value in fields.items():
        setattr(mb.packed_seq_params, name, value)
    return mb


@pytest.mark.parametrize("which", sorted(FRESH))
def test_fields_written_in_place_into_the_packers_params_are_checked(setup, which):
    """The mark holds the params' fields as the packer wrote them: a field rebound in place (the same
    PackedSeqParams object, a new value) is compared with the plan like replaced params."""
    shifted = _cu(0, 9, 22)
    with pytest.raises(ValueError, match=r"packed_seq_params\.cu_seqlens_q is \[0, 9, 22\] but the pack plan's "
                                         r"real boundaries are \[0, 10, 22\]"):
        step_loss(setup["gpt"], _written_in_place(setup, which, cu_seqlens_q=shifted, cu_seqlens_kv=shifted),
                  pad_to=PAD_TO)
    with pytest.raises(ValueError, match=r"max_seqlen_q"):
        step_loss(setup["gpt"], _written_in_place(setup, which, max_seqlen_q=4), pad_to=PAD_TO)
    untouched = _written_in_place(setup, which)
    assert untouched.boundaries_checked
    assert step_loss(setup["gpt"], untouched, pad_to=PAD_TO) == pytest.approx(
        step_loss(setup["gpt"], setup[which], pad_to=PAD_TO))
