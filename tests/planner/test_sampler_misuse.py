"""The batch sampler against datasets too small for a step: it trained silently wrong before (empty epochs)."""

import numpy as np
import pytest

from megatron_vlm_packing.packing import PackMultiples
from megatron_vlm_packing.planner import BinLayout, PackedBatchSampler, PlannerConfig, SampleTable, plan_epoch


def _config(**kw):
    kw = {"layout": BinLayout(capacity=128, multiples=PackMultiples.for_parallel(cp_size=2)), "dp_size": 3,
          "micro_batches_per_rank": 2, "window_steps": 2, "seed": 5, **kw}
    return PlannerConfig(**kw)


_TABLE = SampleTable(text_tokens=np.random.default_rng(0).integers(1, 90, 57))


@pytest.mark.parametrize("tokens, kw, words", [
    # fewer samples than ranks: no rank gets a micro-batch, the samples are carried (the next epoch trains them twice)
    ([3, 9], dict(), r"2 sample\(s\) \(0 carried in\) fill less than one step "
                     r"\(dp_size=3 x micro_batches_per_rank=2\)"),
    # tail="carry" and fewer bins than a step: carried on and on (2, 4, 6, ... copies), no epoch trained
    ([3, 9], dict(tail="carry", dp_size=1), r"2 sample\(s\) \(0 carried in\) fill less than one step "
                                             r"\(dp_size=1 x micro_batches_per_rank=2\).*or tail='short_step'"),
    ([30] * 5, dict(samples_per_step=6, tail="carry"), r"5 sample\(s\) \(0 carried in\) fill less than one step "
                                                       r"\(samples_per_step=6\)"),
])
def test_a_dataset_too_small_for_one_step_is_refused_not_trained_as_empty_epochs(tokens, kw, words):
    """The sampler yielded no micro-batch to any rank, epoch after epoch (a DataLoader of length 0: a loop over
    epochs trained nothing, without a word), while the carried samples piled up (1, 0 -> 1, 1, 0, 0 -> ...) until
    one step held many copies of each."""
    table = SampleTable(text_tokens=tokens)
    config = _config(**kw)
    assert plan_epoch(table, config).steps == ()  # the plan itself says so: everything carried
    for rank in range(config.dp_size):
        sampler = PackedBatchSampler(table, config, dp_rank=rank)
        for call in (len, list, lambda s: s.micro_batches_per_step()):
            with pytest.raises(ValueError, match=r"epoch 0 gives no rank a micro-batch: its " + words):
                call(sampler)


def test_a_dataset_of_one_step_still_plans():
    """The refusal is for no step at all: one short step (tail="short_step") or one whole step trains."""
    table = SampleTable(text_tokens=[3, 9, 5])
    assert [len(PackedBatchSampler(table, _config(), dp_rank=r)) for r in range(3)] == [1, 1, 1]
    assert len(PackedBatchSampler(table, _config(dp_size=1, micro_batches_per_rank=1, tail="carry"), dp_rank=0)) == 1
