"""`cat_row_prefixes` / `cat_row_next_tokens`, the loader's copies for a plan without pad slots, against
`cat_documents_host` with the plan's `DocumentSlices` (what they replace), on random plans: empty rows,
one-token documents, full rows, int64 and float32 rows; and `pack_batch(host_reads=True)` with Hugging
Face labels against the device path on such plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing.indices import DocumentSlices
from megatron_vlm_packing.packing.pack import cat_documents_host, cat_row_next_tokens, cat_row_prefixes
from megatron_vlm_packing.packing.plan import make_pack_plan


def random_plan(rng: np.random.Generator, batch: int, row_length: int):
    lengths = rng.integers(0, row_length + 1, batch)
    lengths[rng.integers(batch)] = rng.integers(1, row_length + 1)  # at least one document
    if rng.random() < 0.3:
        lengths[rng.integers(batch)] = 1
    return make_pack_plan(lengths.tolist(), row_capacity=row_length)


@pytest.mark.parametrize("seed", range(40))
def test_row_copies_equal_the_document_slices_copies(seed):
    rng = np.random.default_rng(seed)
    batch, row_length = int(rng.integers(1, 7)), int(rng.integers(1, 40))
    plan = random_plan(rng, batch, row_length)
    assert plan.real_lengths == plan.physical_lengths  # no pad slots: the plans these copies are for
    for dtype in (np.int64, np.float32):
        rows = rng.integers(-5, 1000, (batch, row_length)).astype(dtype)
        flat = rows.reshape(-1)
        expected = cat_documents_host(flat, DocumentSlices.of(plan), 0)
        assert np.array_equal(cat_row_prefixes(rows, plan), expected)
        shifted = cat_documents_host(flat, DocumentSlices.of(plan, shift=1), -100)
        got = cat_row_next_tokens(rows, plan, -100)
        assert got.dtype == rows.dtype and np.array_equal(got, shifted)


@pytest.mark.parametrize("seed", range(6))
def test_hf_labels_pack_the_same_on_the_host_as_on_the_device_path(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (5,), generator=g)
    keep = torch.arange(24) < lengths[:, None]
    ids = torch.where(keep, torch.randint(1, 500, (5, 24), generator=g), 0)
    labels = torch.where(keep & (torch.rand(5, 24, generator=g) < 0.8), ids, -100)
    batch = dict(input_ids=ids, labels=labels, attention_mask=keep.long(), loss_mask=keep.float())
    host = pack_batch(batch, label_style="hf", host_reads=True)
    device = pack_batch(batch, label_style="hf")
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert torch.equal(getattr(host, name), getattr(device, name)), name
