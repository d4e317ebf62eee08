"""A dense micro-batch built by hand (not `pad_batch`'s) whose rows hold several joined documents (positions
restarting at 0 inside a row, on real tokens) is a ValueError naming the row and the restart, not one causal row in
which every document attends to the ones before it. Before, the step trained it silently: Megatron-Core's dense
rotary reads no position_ids, so the loss was the very loss of one document per row.

The check reads the positions of a dense micro-batch whose positions no packer made (one host sync); a dense
micro-batch as `pad_batch` made it, moved or not, is not read. Real Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_vlm_packing import pad_batch
from megatron_vlm_packing.testing.step_models import step_loss
from megatron_vlm_packing.testing.sync_counter import count_host_syncs

R = dataclasses.replace
RESTART = r"position_ids row 0 restarts at 0 at slot 5 \(after 5 real tokens\)"


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.testing.step_models import step_batch, tiny_step_models

    torch.manual_seed(0)
    ids = torch.randint(1, 120, (2, 12))
    mask = torch.tensor([[1] * 10 + [0] * 2, [1] * 12])
    text = {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}
    return dict(models=tiny_step_models(), text=text, dense=pad_batch(text, label_style="hf"),
                vlm_batch=step_batch("vlm"))


def _joined(positions: torch.Tensor) -> torch.Tensor:
    """Row 0's positions restarting at 0 at slot 5: two documents of 5 tokens joined in one row."""
    joined = positions.clone()
    joined[..., 0, 5:] = torch.arange(positions.shape[-1] - 5)
    return joined


def test_a_hand_built_dense_row_of_two_documents_is_refused(setup):
    gpt, dense = setup["models"]["gpt"], setup["dense"]
    joined = R(dense, position_ids=_joined(dense.position_ids))
    with pytest.raises(ValueError, match=RESTART + r".*pack=True"):
        step_loss(gpt, joined, pack=False)  # yielded by the data iterator
    with pytest.raises(ValueError, match=RESTART):
        step_loss(gpt, setup["text"], pack=False, transform=lambda mb: R(mb, position_ids=_joined(mb.position_ids)))
    assert step_loss(gpt, dense, pack=False) == pytest.approx(step_loss(gpt, setup["text"], pack=False))


def test_mrope_positions_restarting_in_a_dense_row_are_refused(setup):
    """[3, B, L]: a real token at 0 on every channel after the row's first real token opens another document."""
    vlm = setup["models"]["vlm"]
    joined, cloned = (lambda mb: R(mb, position_ids=_joined(mb.position_ids)),  # noqa: E731
                      lambda mb: R(mb, position_ids=mb.position_ids.clone()))
    with pytest.raises(ValueError, match=RESTART):
        step_loss(vlm, setup["vlm_batch"], pack=False, transform=joined)
    assert step_loss(vlm, setup["vlm_batch"], pack=False, transform=cloned)


def test_hand_built_dense_rows_of_one_document_train(setup):
    """Pad slots at 0 and a left-padded row (its first real token at 0 after pad slots) are no restart."""
    gpt, dense = setup["models"]["gpt"], setup["dense"]
    pads_at_zero = torch.where(dense.padding_mask, 0, dense.position_ids)
    assert step_loss(gpt, R(dense, position_ids=pads_at_zero), pack=False) == pytest.approx(
        step_loss(gpt, dense, pack=False))
    left = R(dense, padding_mask=torch.zeros_like(dense.padding_mask), position_ids=dense.position_ids.clone())
    left_padding = left.padding_mask.clone()
    left_padding[0, :2] = True
    positions = left.position_ids.clone()
    positions[0] = torch.tensor([7, 7] + list(range(10)))
    assert step_loss(gpt, R(left, padding_mask=left_padding, position_ids=positions), pack=False) > 0


def test_the_check_reads_only_positions_no_packer_made(setup):
    from megatron_vlm_packing.train.step import check_unpacked_dense_positions

    dense = setup["dense"]
    with count_host_syncs() as syncs:
        check_unpacked_dense_positions(dense)
    assert syncs.total == 0, syncs.report()
    with count_host_syncs() as syncs:
        check_unpacked_dense_positions(R(dense, position_ids=dense.position_ids.clone()))
    assert syncs.total == 1, syncs.report()
