"""The step's checks of fields no packer checked (loss weights, labels, positions, packed boundaries: a `transform=`
gave the micro-batch its own) share one host read: a micro-batch with all of them its own costs the step one sync
more than the packer's own, not one per field (it was one each: 3 dense, 4 packed). Each fault is still named by
its own check, the first in the step's order when there are several.

Real Megatron-Core GPTModel (tiny, CPU, one process); a count, not a time (testing/sync_counter.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs

R = dataclasses.replace


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.testing.step_models import step_batch, tiny_step_models

    return dict(gpt=tiny_step_models()["gpt"], batch=step_batch("gpt"))


def _own_fields(mb):
    """Every field the step checks when no packer made it, as equal copies (no fault)."""
    changes = dict(loss_mask=mb.loss_mask.clone(), labels=mb.labels.clone(), position_ids=mb.position_ids.clone())
    if mb.is_packed:
        params = mb.packed_seq_params
        changes["packed_seq_params"] = R(params, cu_seqlens_q=params.cu_seqlens_q.clone(),
                                         cu_seqlens_kv=params.cu_seqlens_kv.clone(),
                                         cu_seqlens_q_padded=params.cu_seqlens_q_padded.clone(),
                                         cu_seqlens_kv_padded=params.cu_seqlens_kv_padded.clone())
    return R(mb, **changes)


def _step_syncs(setup, **options) -> tuple[int, float]:
    with count_host_syncs() as syncs:
        loss = step_loss(setup["gpt"], setup["batch"], **options)
    return syncs.total, loss


@pytest.mark.parametrize("pack", [True, False])
def test_fields_of_its_own_cost_the_step_one_read_for_all(setup, pack):
    packers, loss = _step_syncs(setup, pack=pack)
    own, own_loss = _step_syncs(setup, pack=pack, transform=_own_fields)
    assert own - packers == 1
    assert own_loss == pytest.approx(loss)


def test_the_first_fault_in_the_steps_order_is_named(setup):
    def faults(mb):
        mb = _own_fields(mb)
        labels, weights = mb.labels.clone(), mb.loss_mask.clone()
        labels[0, 3], weights[0, 5] = -7, float("nan")
        return R(mb, labels=labels, loss_mask=weights)

    with pytest.raises(ValueError, match=r"loss_mask .* is nan: loss weights must be finite and >= 0"):
        step_loss(setup["gpt"], setup["batch"], transform=faults)
    with pytest.raises(ValueError, match=r"labels .* is -7: a label must be -100"):
        step_loss(setup["gpt"], setup["batch"], transform=lambda mb: R(faults(mb), loss_mask=mb.loss_mask))
