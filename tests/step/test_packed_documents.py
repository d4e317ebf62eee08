"""A packed micro-batch built by hand (positions no packer made) whose document holds several joined documents
(positions restarting at 0 inside one segment of `packed_seq_params`, on real tokens) is a ValueError naming the
document and the slot:
attention runs over whole segments, so each joined document attended to the ones before it. Before, the step
trained it silently (the loss differed from the pack's with no error).

Read only for packed positions no packer made (one host sync); the packers' and the DataLoader's are not read.
Real Megatron-Core GPTModel (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.testing.step_models import tiny_step_models

    torch.manual_seed(0)
    ids = torch.randint(1, 120, (2, 12))
    text = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.tensor([[1] * 10 + [0] * 2, [1] * 12])}
    return dict(gpt=tiny_step_models()["gpt"], text=text, packed=pack_batch(text, label_style="hf"))


def _one_segment(mb):
    """The pack's two documents (10 and 12 tokens, no pad slots) as a packer of one's own would lay them out in one
    document of 22: boundaries [0, 22] and positions of its own (restarting at slot 10)."""
    one = torch.tensor([0, 22], dtype=torch.int32)
    params = R(mb.packed_seq_params, cu_seqlens_q=one, cu_seqlens_kv=one, cu_seqlens_q_padded=one,
               cu_seqlens_kv_padded=one, max_seqlen_q=22, max_seqlen_kv=22)
    return R(mb, packed_seq_params=params, plan=None, indices=None, rope_cu_seqlens=one,
             position_ids=mb.position_ids.clone())


def test_a_segment_of_two_joined_documents_is_refused(setup):
    gpt, packed = setup["gpt"], setup["packed"]
    assert packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 10, 22]
    message = r"position_ids restart at 0 at slot 10 inside document 0 \(slots 0\.\.21\), after 10 real tokens"
    with pytest.raises(ValueError, match=message):
        step_loss(gpt, _one_segment(packed))  # yielded by the data iterator
    with pytest.raises(ValueError, match=message):
        step_loss(gpt, setup["text"], transform=_one_segment)


def test_packed_positions_restarting_per_document_train(setup):
    gpt, packed = setup["gpt"], setup["packed"]
    assert step_loss(gpt, R(packed, position_ids=packed.position_ids.clone())) == pytest.approx(step_loss(gpt, packed))


def test_the_check_reads_only_positions_no_packer_made(setup):
    from megatron_vlm_packing.train.step import check_unpacked_packed_positions

    loader = PackingCollator(label_style="hf")(setup["text"])
    for packer_made in (setup["packed"], loader):
        with count_host_syncs() as syncs:
            check_unpacked_packed_positions(packer_made)
        assert syncs.total == 0, syncs.report()
    with count_host_syncs() as syncs:
        check_unpacked_packed_positions(R(loader, position_ids=loader.position_ids.clone()))
    assert syncs.total == 1, syncs.report()


@pytest.mark.parametrize("pack", [True, False])
def test_hand_built_positions_that_are_no_tensor_are_named(setup, pack):
    """Was an AttributeError ('list' object has no attribute 'dim') in the adapter's position check."""
    from megatron_vlm_packing import pad_batch

    mb = setup["packed"] if pack else pad_batch(setup["text"], label_style="hf")
    with pytest.raises(ValueError, match=r"sequence fields and extras are tensors, but \{'position_ids': 'list'\}"):
        step_loss(setup["gpt"], R(mb, position_ids=mb.position_ids.tolist()), pack=pack)
