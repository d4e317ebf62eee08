"""Loss weights of a MicroBatch built (or changed) by hand are value-checked where it enters the model
(`prepare_for_model`): finite and >= 0 at every slot, as `pack_batch` checks the batch's. Before, a
negative, NaN or inf weight reached the loss. Micro-batches the packers made carry their checked
`loss_mask` (`checked_loss_mask`) and cost no host sync here, moved and pinned as the loader does."""

from dataclasses import fields, replace

import pytest
import torch

from megatron_vlm_packing.models.adapter import ModelAdapter
from megatron_vlm_packing.packing import pack_batch, pad_batch
from megatron_vlm_packing.packing.collate import PackingCollator, micro_batch_to
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from megatron_vlm_packing.train.step import prepare_for_model


class _Adapter(ModelAdapter):
    def __init__(self):
        self.model_name = "Model"


def _batch():
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    keep = (ids != 0).long()
    return {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep}


def _by_hand(micro_batch: MicroBatch, **changes) -> MicroBatch:
    """The same micro-batch rebuilt field by field, as a user builds one (no packer's mark)."""
    given = {f.name: getattr(micro_batch, f.name) for f in fields(MicroBatch) if f.name != "checked_loss_mask"}
    return MicroBatch(**{**given, **changes})


def _with_weight(loss_mask: torch.Tensor, slot: int, value: float) -> torch.Tensor:
    out = loss_mask.clone()
    out.view(-1)[slot] = value
    return out


@pytest.mark.parametrize("value, shown", [(-1.0, "-1.0"), (float("nan"), "nan"), (float("inf"), "inf")])
@pytest.mark.parametrize("packer", [pack_batch, pad_batch])
def test_bad_weights_in_a_hand_built_micro_batch_are_refused(value, shown, packer):
    packed = packer(_batch(), label_style="hf")
    bad = _with_weight(packed.loss_mask, 2, value)
    message = rf"loss_mask row 0 position 2 is {shown}: loss weights must be finite and >= 0"
    for built in (_by_hand(packed, loss_mask=bad), replace(packed, loss_mask=bad)):  # replace: a transform's way
        with pytest.raises(ValueError, match=message):
            prepare_for_model(built, _Adapter(), ParallelLayout())


def test_a_bad_weight_at_a_pad_slot_is_refused_too():
    """Pad slots multiply the loss as well: NaN * 0 is NaN."""
    packed = pack_batch(_batch(), label_style="hf", pad_to=16)
    assert packed.padding_mask[0, 15]
    with pytest.raises(ValueError, match=r"loss_mask row 0 position 15 is nan"):
        prepare_for_model(_by_hand(packed, loss_mask=_with_weight(packed.loss_mask, 15, float("nan"))), _Adapter(),
                          ParallelLayout())


def test_a_loss_mask_that_is_not_a_real_tensor_is_refused():
    packed = pack_batch(_batch(), label_style="hf")
    with pytest.raises(ValueError, match=r"loss_mask must be a real tensor of per-token weights, got list"):
        prepare_for_model(_by_hand(packed, loss_mask=packed.loss_mask.tolist()), _Adapter(), ParallelLayout())


def test_packed_micro_batches_cost_no_sync_and_hand_built_ones_one():
    loader = micro_batch_to(PackingCollator(label_style="hf")(_batch()), torch.device("cpu"))  # the step's move
    assert loader.loss_weights_checked
    for packed in (pack_batch(_batch(), label_style="hf"), pad_batch(_batch(), label_style="hf"), loader,
                   replace(loader, stats=loader.stats)):
        with count_host_syncs() as syncs:
            prepare_for_model(packed, _Adapter(), ParallelLayout())
        assert syncs.total == 0, syncs.report()
    with count_host_syncs() as syncs:
        prepare_for_model(_by_hand(loader), _Adapter(), ParallelLayout())
    assert syncs.total == 1, syncs.report()


def test_the_mark_survives_a_dataloader_worker():
    """The worker pickles the micro-batch; `checked_loss_mask` and `loss_mask` stay one tensor."""
    from torch.utils.data import DataLoader

    loader = DataLoader([_batch()], batch_size=None, num_workers=1, timeout=60,
                        collate_fn=PackingCollator(label_style="hf"))
    assert next(iter(loader)).loss_weights_checked
