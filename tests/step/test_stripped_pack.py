"""A packed micro-batch whose `packed_seq_params` were removed after packing (a `transform=`, a
`dataclasses.replace` of a loader micro-batch) is refused, naming what still says it is packed.

Without its boundaries the [1, T] pack went on as one dense row: every sample attended to the ones
before it and the pack trained as one causal document (bug classes 10 and 11), with a loss a little
different from each sample alone and no error. Real Megatron-Core GPTModel (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

STRIPPED = r"packed_seq_params is None but the micro-batch .* packed"


@pytest.fixture(scope="module")
def gpt(single_process_megatron):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt

    torch.manual_seed(0)
    return build_tiny_gpt(TinyGPTConfig(), scatter_embedding_sequence_parallel=False)


def _batch() -> dict:
    from megatron_vlm_packing.testing.parity import variable_batch

    return variable_batch([13, 5, 21, 9], 21, vocab_size=120, seed=1)


def _loss(model, item, **options) -> float:
    from megatron_vlm_packing.train.step import make_forward_step

    output, loss_fn = make_forward_step(label_style="megatron", **options)(iter([item]), model)
    return float(loss_fn(output)[0])


@pytest.mark.parametrize("keep", ["everything else", "only the plan", "only rope_cu_seqlens"])
def test_a_transform_that_strips_the_boundaries_is_refused(gpt, keep):
    def strip(mb):
        changes = dict(packed_seq_params=None)
        if keep == "only the plan":
            changes.update(rope_cu_seqlens=None, indices=None)
        if keep == "only rope_cu_seqlens":
            changes.update(plan=None, indices=None)
        return dataclasses.replace(mb, **changes)

    with pytest.raises(ValueError, match=STRIPPED):
        _loss(gpt, _batch(), transform=strip)


def test_a_loader_micro_batch_without_its_boundaries_is_refused(gpt):
    from megatron_vlm_packing.packing.collate import PackingCollator

    packed = PackingCollator(label_style="megatron")(_batch())
    with pytest.raises(ValueError, match=STRIPPED):
        _loss(gpt, dataclasses.replace(packed, packed_seq_params=None), pack=False)


def test_packed_and_dense_still_run_and_agree(gpt):
    assert _loss(gpt, _batch()) == pytest.approx(_loss(gpt, _batch(), pack=False), rel=1e-5)


def test_a_pack_of_one_document_may_run_as_one_dense_row(gpt):
    """What the parity probe does with a sample alone (`validate.probe._alone`): one document, no boundaries."""
    from megatron_vlm_packing.testing.parity import variable_batch

    one = variable_batch([16], 16, vocab_size=120, seed=2)
    stripped = _loss(gpt, one, transform=lambda mb: dataclasses.replace(mb, packed_seq_params=None))
    assert stripped == pytest.approx(_loss(gpt, one), rel=1e-5)
