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


def _own_ids_too(mb):
    return R(_own_fields(mb), input_ids=mb.input_ids.clone())


@pytest.mark.parametrize("pack", [True, False])
def test_ids_of_its_own_ride_the_same_read(setup, pack):
    """The adapter's check of ids no packer checked (`models.adapter.check_unpacked_ids`) read them alone: a
    transform that replaced ids and labels cost 2 reads."""
    packers, loss = _step_syncs(setup, pack=pack)
    own, own_loss = _step_syncs(setup, pack=pack, transform=_own_ids_too)
    assert own - packers == 1
    assert own_loss == pytest.approx(loss)


def test_a_bad_id_is_named_where_the_adapter_checks_ids(setup):
    """Labels before ids (the step's read first), the adapter's own refusals before ids (its check, in its order)."""
    def bad_ids(mb):
        ids = mb.input_ids.clone()
        ids[0, 2] = 500
        return R(_own_ids_too(mb), input_ids=ids)

    with pytest.raises(ValueError, match=r"input_ids row 0 position 2 is 500: token ids must lie in \[0, 128\)"):
        step_loss(setup["gpt"], setup["batch"], transform=bad_ids)

    def bad_ids_and_labels(mb):
        mb = bad_ids(mb)
        labels = mb.labels.clone()
        labels[0, 4] = -7
        return R(mb, labels=labels)

    with pytest.raises(ValueError, match=r"labels .* is -7: a label must be -100"):
        step_loss(setup["gpt"], setup["batch"], transform=bad_ids_and_labels)
    extra = lambda mb: R(bad_ids(mb), extras={"token_types": torch.zeros_like(mb.input_ids)})  # noqa: E731
    with pytest.raises(ValueError, match=r"the micro-batch carries \['extra:token_types'\]"):
        step_loss(setup["gpt"], setup["batch"], transform=extra)
