"""Given mRoPE positions [3, B, S] that restart at 0 (every channel) inside a row on real tokens mean the row holds
several documents: a ValueError naming the row and position, as 1D positions already were, on every packing path.
Before, pack_batch made the row one segment (the documents attended to each other, bug class 11) and pad_batch one
causal dense row, silently. Checked in the packer's one read (no sync of its own)."""

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.packing.collate import PackingCollator

PACKERS = {
    "pack": lambda batch: pack_batch(batch, label_style="hf"),
    "pack_host": lambda batch: pack_batch(batch, label_style="hf", host_reads=True),
    "pad": lambda batch: pad_batch(batch, label_style="hf"),
    "collator": lambda batch: PackingCollator(label_style="hf")(batch),
}


def _batch(row0_positions) -> dict:
    ids = torch.arange(1, 17).reshape(2, 8)
    mask = torch.tensor([[1] * 7 + [0], [1] * 8])
    positions = torch.stack([torch.tensor(row0_positions), torch.arange(8)])[None].expand(3, 2, 8).clone()
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask, "position_ids": positions}


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_given_mrope_positions_restarting_inside_a_row_are_refused(packer):
    with pytest.raises(ValueError, match=r"position_ids row 0 position 4 is 0 on every channel after 4 real tokens "
                                         r"of its row.*give document_lengths"):
        PACKERS[packer](_batch([0, 1, 2, 3, 0, 1, 2, 0]))


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_given_mrope_positions_of_one_document_per_row_are_taken(packer):
    """A pad slot at 0 is no restart; nor is a channel at 0 beside others that are not (an image's first row)."""
    batch = _batch([0, 1, 2, 3, 4, 5, 6, 0])
    batch["position_ids"][1:, 0, 4] = 0  # t stays, h and w at 0: inside an image block
    mb = PACKERS[packer](batch)
    assert mb.position_ids[0, 0, :7].tolist() == [0, 1, 2, 3, 4, 5, 6]
