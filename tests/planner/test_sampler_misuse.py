"""The batch sampler against datasets too small for a step and resume counts taken from the wrong start:
both trained silently wrong before (empty epochs, replayed micro-batches)."""

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


def _resumed_at(position: int, config, rank: int = 0) -> PackedBatchSampler:
    first = PackedBatchSampler(_TABLE, config, dp_rank=rank)
    it = iter(first)
    [next(it) for _ in range(position)]
    resumed = PackedBatchSampler(_TABLE, config, dp_rank=rank)
    resumed.load_state_dict(first.state_dict())
    return resumed


def test_consumed_below_the_position_an_epoch_was_resumed_at_is_refused():
    """After a resume at 4, a loop counting its own micro-batches (2 since the restart) passed consumed=2: the state
    went back to position 2 and a second resume trained micro-batches 2 and 3 again, silently."""
    config = _config()
    reference = list(PackedBatchSampler(_TABLE, config, dp_rank=0))
    resumed = _resumed_at(4, config)
    it = iter(resumed)
    taken = [next(it) for _ in range(2)]
    assert taken == reference[4:6]
    with pytest.raises(ValueError, match=r"consumed=2 is below 4, the micro-batches of epoch 0 trained before "
                                         r"this sampler resumed it .* count them from the epoch's start \(4 \+ "
                                         r"those trained since\)"):
        resumed.state_dict(consumed=2)
    state = resumed.state_dict(consumed=6)  # counted from the epoch's start: where it stands
    assert (state["epoch"], state["position"]) == (0, 6)
    assert resumed.state_dict(consumed=4)["position"] == 4  # nothing trained since the resume: still allowed
    again = PackedBatchSampler(_TABLE, config, dp_rank=0)
    again.load_state_dict(state)
    assert list(again) == reference[6:]


def test_consumed_of_a_resumed_epoch_the_loader_has_left_is_held_to_its_resume_position_too():
    """A prefetching loader finishes the resumed epoch before training does: consumed then counts that epoch, and
    a count below its resume position is refused there as well (not read as the previous epoch's position)."""
    config = _config(tail="carry")
    reference = list(PackedBatchSampler(_TABLE, config, dp_rank=0))
    resumed = _resumed_at(5, config)
    assert list(resumed) == reference[5:]  # the loader has taken the rest: the sampler is in epoch 1, at 0
    next(iter(resumed))  # and one micro-batch of epoch 1
    with pytest.raises(ValueError, match=r"consumed=3 is below 5, the micro-batches of epoch 0 trained before"):
        resumed.state_dict(consumed=3)
    assert (resumed.state_dict(consumed=1)["epoch"], resumed.state_dict(consumed=1)["position"]) == (1, 1)
    state = resumed.state_dict(consumed=len(reference) - 1)
    assert (state["epoch"], state["position"]) == (0, len(reference) - 1)


def test_set_epoch_and_the_next_epoch_count_from_zero_again():
    """The resume position binds only the epoch resumed: set_epoch on another epoch, or the next epoch, starts at 0."""
    config = _config()
    resumed = _resumed_at(4, config)
    list(resumed)  # the rest of epoch 0; now at the start of epoch 1
    it = iter(resumed)
    next(it)
    assert resumed.state_dict(consumed=1)["position"] == 1
    other = _resumed_at(4, config)
    other.set_epoch(2)
    next(iter(other))
    assert (other.state_dict(consumed=0)["epoch"], other.state_dict(consumed=0)["position"]) == (2, 0)


def test_a_tables_columns_cannot_be_written_in_place():
    """A SampleTable is frozen but its columns were writable: `table.text_tokens[i] = n` (lengths corrected
    mid-run) changed the plans of the epochs not yet planned while the sampler's cached layout record kept the old
    fingerprint, so a resume with the table rebuilt from its source replanned those epochs otherwise and resumed at
    other samples, silently. The columns are read-only: a new table is a new layout, which a state refuses."""
    table = SampleTable(text_tokens=np.array([5, 9, 3]), image_grids=[(1, 2, 2)], image_owner=[1],
                        video_grids=[(2, 4, 4)], video_owner=[0], audio_frames=[30], audio_owner=[2])
    for name in ("text_tokens", "image_grids", "image_owner", "video_grids", "video_owner", "audio_frames",
                 "audio_owner"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(table, name)[0] = 1
    given = np.array([5, 9, 3])
    SampleTable(text_tokens=given)
    given[0] = 7  # the caller's own array is copied, not frozen
    assert given[0] == 7
