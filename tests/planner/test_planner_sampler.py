"""The batch sampler in a real DataLoader, resume mid-epoch, and the Energon hooks on plain objects."""

import dataclasses
import io
import re

import numpy as np
import pytest
import torch

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import PackMultiples, pack_batch
from megatron_vlm_packing.packing.arena import all_in_one_storage
from megatron_vlm_packing.packing.collate import LoaderMicroBatch, tensors_of
from megatron_vlm_packing.planner import (BinLayout, CostModel, EnergonPackingHooks, PackedBatchSampler,
                                          PlannedPackingMixin, PlannerConfig, SampleTable, TokenCounter,
                                          plan_epoch)
from tests.planner.synthetic_metadata import CFG, metadata


@pytest.fixture(scope="module")
def samples():
    return synthetic_samples(60, seed=7, cfg=CFG)


def _config(**kw):
    multiples = PackMultiples.for_parallel(cp_size=2)
    kw = {"layout": BinLayout(capacity=160, multiples=multiples), "dp_size": 2, "micro_batches_per_rank": 2,
          "window_steps": 2, "seed": 3, **kw}
    return PlannerConfig(**kw)


def test_sampler_in_a_dataloader_packs_each_bin_as_planned(samples):
    table = SampleTable.from_samples([metadata(s) for s in samples])
    assert (table.text_tokens >= 0).all()
    config = _config()
    seen = []
    for rank in range(config.dp_size):
        sampler = PackedBatchSampler(table, config, dp_rank=rank)
        loader = torch.utils.data.DataLoader(
            samples, batch_sampler=sampler, num_workers=0,
            collate_fn=lambda group: (group, pack_batch(collate(group), cp_size=2, pad_to=160, label_style="hf",
                                                            image_token_id=SyntheticVLMConfig().image_token_id)))
        bins = sampler.plan().micro_batches(rank)
        batches = list(loader)
        assert len(batches) == len(sampler) == len(bins) > 0
        for (group, packed), planned in zip(batches, bins):
            assert [len(s["input_ids"]) for s in group] == list(planned.tokens)
            assert packed.plan == planned.plan(config.layout)
            seen.extend(planned.samples)
    assert sorted(seen + list(sampler.plan().carried)) == list(range(len(samples)))


def test_resume_mid_epoch_equals_uninterrupted(samples):
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry")
    straight = PackedBatchSampler(table, config, dp_rank=1)
    assert straight.plan().carried  # the second epoch starts with samples the first carried
    reference = list(straight) + list(straight)  # two epochs (carried samples lead the second)
    first = PackedBatchSampler(table, config, dp_rank=1)
    it = iter(first)
    taken = [next(it) for _ in range(3)]
    state = first.state_dict()
    resumed = PackedBatchSampler(table, config, dp_rank=1)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert taken + rest + list(resumed) == reference
    with pytest.raises(ValueError, match="sampler state has seed=3 but this sampler has seed=4"):
        PackedBatchSampler(table, _config(tail="carry", seed=4), dp_rank=0).load_state_dict(state)


def test_resume_with_a_prefetching_loader_across_the_epoch_boundary(samples):
    """A DataLoader with workers takes the epoch's last indices (and ends the sampler's epoch)
    before training has run them: state_dict(consumed=) then still counts the finished epoch.
    Before, it recorded the next epoch at that position: the rest of the epoch and the next
    epoch's first micro-batches were lost on resume."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry")
    straight = PackedBatchSampler(table, config, dp_rank=0)
    reference = list(straight) + list(straight)
    sampler = PackedBatchSampler(table, config, dp_rank=0)
    epoch_len = len(sampler)
    assert epoch_len > 3
    loader = torch.utils.data.DataLoader(list(range(len(samples))), batch_sampler=sampler, num_workers=1,
                                         prefetch_factor=2, collate_fn=lambda group: group)
    trained = []
    for batch in loader:
        trained.append(batch)
        if len(trained) == epoch_len - 1:
            break
    assert sampler.state_dict()["epoch"] == 1  # the sampler has moved on; training has not
    state = sampler.state_dict(consumed=len(trained))
    assert (state["epoch"], state["position"]) == (0, epoch_len - 1)
    resumed = PackedBatchSampler(table, config, dp_rank=0)
    resumed.load_state_dict(state)
    assert trained + list(resumed) + list(resumed) == reference
    with pytest.raises(ValueError, match="consumed=99"):
        sampler.state_dict(consumed=99)  # more than was ever yielded: resuming there would skip


def test_set_epoch_after_a_resume_keeps_its_place(samples):
    """`load_state_dict` then the usual `set_epoch(epoch)` at the top of the epoch loop: before,
    set_epoch restarted the epoch and its first micro-batches were trained twice."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config()
    straight = PackedBatchSampler(table, config, dp_rank=1)
    reference = list(straight)
    first = PackedBatchSampler(table, config, dp_rank=1)
    it = iter(first)
    taken = [next(it) for _ in range(3)]
    resumed = PackedBatchSampler(table, config, dp_rank=1)
    resumed.load_state_dict(first.state_dict())
    resumed.set_epoch(0)
    assert taken + list(resumed) == reference
    resumed.set_epoch(0)  # after the resumed epoch, set_epoch starts an epoch from its beginning again
    assert list(resumed) == reference
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        resumed.set_epoch(-1)


def test_state_from_another_layout_is_refused(samples):
    """A state whose position lies beyond this plan (written under more micro-batches per rank, say)
    would resume past the end of the epoch and skip it silently; it is a ValueError."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    sampler = PackedBatchSampler(table, _config(), dp_rank=0)
    state = sampler.state_dict()
    state["position"] = len(sampler) + 1
    with pytest.raises(ValueError, match=f"position={len(sampler) + 1} but epoch 0 has {len(sampler)}"):
        PackedBatchSampler(table, _config(), dp_rank=0).load_state_dict(state)
    state["position"] = -1
    with pytest.raises(ValueError, match="position=-1"):
        PackedBatchSampler(table, _config(), dp_rank=0).load_state_dict(state)


_OTHER_LAYOUTS = {  # the field a state saved under _config() differs in, and a config that changes only it
    "dp_size": dict(dp_size=4),
    "micro_batches_per_rank": dict(micro_batches_per_rank=1),
    "samples_per_step": dict(samples_per_step=12),
    "tail": dict(tail="carry"),
    "seed": dict(seed=4),
    "shuffle": dict(shuffle=False),
    "balance": dict(balance=False),
    "window_steps": dict(window_steps=3),
    "layout.capacity": dict(layout=BinLayout(capacity=200, multiples=PackMultiples.for_parallel(cp_size=2))),
    "layout.multiples.segment": dict(layout=BinLayout(capacity=160, multiples=PackMultiples(segment=2, total=4))),
    "layout.multiples.total": dict(layout=BinLayout(capacity=160, multiples=PackMultiples(segment=4, total=8))),
    "layout.static_shapes": dict(layout=BinLayout(capacity=160, multiples=PackMultiples.for_parallel(cp_size=2),
                                                  static_shapes=False)),
    "cost_model.lm_attention": dict(cost_model=dataclasses.replace(CostModel.qwen2_5_vl_7b(), lm_attention=1.0)),
    "expanded_tokens_fingerprint": dict(expanded_tokens=TokenCounter(vision_wrappers=3)),
}


@pytest.mark.parametrize("field", [*_OTHER_LAYOUTS, "num_samples", "table_fingerprint"])
def test_state_from_another_layout_is_refused_by_field(samples, field):
    """Before, a state recorded only seed, dataset size and DP size: one saved under another capacity,
    micro_batches_per_rank, tail, ... whose position still fit resumed silently at other samples."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    first = PackedBatchSampler(table, _config(), dp_rank=0)
    it = iter(first)
    [next(it) for _ in range(2)]
    state = first.state_dict()
    if field == "num_samples":
        table = SampleTable.from_samples([metadata(s) for s in samples[:-1]])
    elif field == "table_fingerprint":  # same size, one sample a token longer
        longer = dataclasses.replace(metadata(samples[5]), text_tokens=metadata(samples[5]).text_tokens + 1)
        table = SampleTable.from_samples([metadata(s) for s in samples[:5]] + [longer]
                                         + [metadata(s) for s in samples[6:]])
    other = PackedBatchSampler(table, _config(**_OTHER_LAYOUTS.get(field, {})), dp_rank=0)
    with pytest.raises(ValueError, match=f"sampler state has {re.escape(field)}=") as refused:
        other.load_state_dict(state)
    saved, mine = state["layout"][field], other.state_dict()["layout"][field]
    assert saved != mine and f"{field}={saved!r} but this sampler has {field}={mine!r}" in str(refused.value)
    assert (other.state_dict()["epoch"], len(other)) == (0, other._epoch_length())  # refused: left as it was


def test_state_round_trips_through_torch_save(samples):
    """The state is plain values: torch.load's default weights_only=True reads it back, and it
    resumes where it was saved (a numpy seed is stored as an int)."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry", seed=np.int64(3))
    reference = list(PackedBatchSampler(table, config, dp_rank=1))
    first = PackedBatchSampler(table, config, dp_rank=1)
    it = iter(first)
    taken = [next(it) for _ in range(3)]
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    assert state == first.state_dict()
    resumed = PackedBatchSampler(table, config, dp_rank=1)
    resumed.load_state_dict(state)
    assert taken + list(resumed) == reference
    with pytest.raises(ValueError, match="micro_batches_per_rank=2 but this sampler has micro_batches_per_rank=1"):
        PackedBatchSampler(table, _config(tail="carry", micro_batches_per_rank=1), dp_rank=1).load_state_dict(state)


def test_state_of_format_1_still_loads_with_a_warning(samples):
    """A state saved before the layout was recorded resumes (its seed, dataset size and DP size checked)
    with a warning that the rest of the layout could not be."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    reference = list(PackedBatchSampler(table, _config(), dp_rank=0))
    old = {"epoch": 0, "position": 3, "carried": [], "seed": 3, "num_samples": len(samples), "dp_size": 2}
    resumed = PackedBatchSampler(table, _config(), dp_rank=0)
    with pytest.warns(UserWarning, match="format 1 records only num_samples, dp_size and seed"):
        resumed.load_state_dict(old)
    assert list(resumed) == reference[3:]
    assert resumed.state_dict()["format"] == 2
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="seed=3 but this sampler has seed=4"):
        PackedBatchSampler(table, _config(seed=4), dp_rank=0).load_state_dict(old)
    with pytest.raises(ValueError, match="format=3; this version reads formats 1 and 2"):
        resumed.load_state_dict({**resumed.state_dict(), "format": 3})


class _TaskEncoder(PlannedPackingMixin):
    packing_hooks = EnergonPackingHooks(
        metadata=lambda s: metadata(s.payload), collate=lambda group: collate([s.payload for s in group]),
        layout=BinLayout(capacity=96),
        pack_kwargs={"label_style": "hf", "image_token_id": SyntheticVLMConfig().image_token_id})


class _Sample:  # an Energon-like encoded sample: any object
    def __init__(self, payload):
        self.payload = payload


def test_energon_hooks_select_and_pack(samples):
    encoder = _TaskEncoder()
    buffer = [_Sample(s) for s in samples[:20]]
    groups = encoder.select_samples_to_pack(buffer)
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in buffer)
    for group in groups:
        packed = encoder.pack_selected_samples(group)
        assert packed.input_ids.shape == (1, 96)
        assert all_in_one_storage(tensors_of(packed))  # one storage for the worker to send
        assert isinstance(packed, LoaderMicroBatch)  # DataLoader(pin_memory=True) pins it
        assert "is_real" in packed.indices.__dict__  # the pad-slot mask built in the worker, not the step
        assert packed.plan.real_lengths == tuple(len(s.payload["input_ids"]) for s in group)
    with pytest.raises(ValueError, match="multiples"):
        EnergonPackingHooks(metadata=metadata, collate=collate, layout=BinLayout(capacity=96),
                            pack_kwargs={"cp_size": 2})
    with pytest.raises(ValueError, match=r"\['cp'\] are not pack_batch keywords; EnergonPackingHooks passes on"):
        EnergonPackingHooks(metadata=metadata, collate=collate, layout=BinLayout(capacity=96), pack_kwargs={"cp": 2})
    for not_a_dict in (None, 3):  # was a TypeError ("argument of type 'NoneType' is not iterable")
        with pytest.raises(ValueError, match=r"EnergonPackingHooks's options must be a dict of pack_batch keywords"):
            EnergonPackingHooks(metadata=metadata, collate=collate, layout=BinLayout(capacity=96),
                                pack_kwargs=not_a_dict)


def test_energon_hooks_build_every_cp_rank_index_in_the_worker(samples):
    layout = BinLayout(capacity=96, multiples=PackMultiples.for_parallel(cp_size=2))
    hooks = EnergonPackingHooks(
        metadata=metadata, collate=collate, layout=layout,
        pack_kwargs={"label_style": "hf", "cp_size": 2, "image_token_id": SyntheticVLMConfig().image_token_id})
    group = hooks.select_samples_to_pack(samples[:6])[0]
    packed = hooks.pack_selected_samples(group)
    assert isinstance(packed, LoaderMicroBatch) and all_in_one_storage(tensors_of(packed))
    cached = packed.indices.__dict__["_cp_indices"]
    assert set(cached) == {(2, 0), (2, 1)}
    every_slot = torch.cat([cached[(2, 0)], cached[(2, 1)]]).sort().values
    assert torch.equal(every_slot, torch.arange(packed.input_ids.shape[1]))


def test_dp_rank_must_be_an_int(samples):
    """dp_rank=1.5 passed the range check and failed later indexing the step's ranks (TypeError)."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    with pytest.raises(ValueError, match=r"dp_rank=1.5 must lie in \[0, 2\)"):
        PackedBatchSampler(table, _config(), dp_rank=1.5)


def _len_then_drain(sampler: PackedBatchSampler) -> list:
    """The next iteration's micro-batches, after checking that len() announced as many."""
    announced = len(sampler)
    batches = list(sampler)
    assert announced == len(batches)
    return batches


def test_len_counts_what_the_next_iteration_yields(samples):
    """After a resume at position p, len() counted the whole epoch while iteration yielded the rest:
    a DataLoader's len and progress bars were p micro-batches too long."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry")
    straight = PackedBatchSampler(table, config, dp_rank=1)
    assert straight.plan().carried  # epoch 1 starts with epoch 0's carried samples
    first_epoch, second_epoch = _len_then_drain(straight), _len_then_drain(straight)
    assert len(first_epoch) > 3
    for epoch, reference in ((0, first_epoch), (1, second_epoch)):
        sampler = PackedBatchSampler(table, config, dp_rank=1)
        sampler.set_epoch(0)
        if epoch:
            _len_then_drain(sampler)  # carries its tail into epoch 1
        it = iter(sampler)
        taken = [next(it) for _ in range(3)]
        assert len(sampler) == len(reference) - 3  # a paused iteration: what is left of it
        resumed = PackedBatchSampler(table, config, dp_rank=1)
        resumed.load_state_dict(sampler.state_dict())
        loader = torch.utils.data.DataLoader(list(range(len(samples))), batch_sampler=resumed,
                                             collate_fn=lambda group: group)
        assert len(loader) == len(reference) - 3
        resumed.set_epoch(epoch)  # the resumed epoch keeps its place, and its length
        assert taken + _len_then_drain(resumed) == reference
        assert len(_len_then_drain(resumed)) > 0  # the next epoch, whole
        resumed.set_epoch(epoch)  # from its beginning (its carried-in samples stay carried)
        assert len(resumed) == len(_len_then_drain(resumed))
    sampler = PackedBatchSampler(table, config, dp_rank=1)
    next(iter(sampler))
    sampler.set_epoch(1)  # another epoch: all of it
    assert len(sampler) == len(list(sampler))


def test_set_epoch_back_plans_with_the_samples_carried_so_far(samples):
    """The plan was cached by epoch alone: set_epoch(0) after epoch 0 (which carried samples out)
    reused epoch 0's first plan, while state_dict recorded the carried samples: a resume then planned
    another epoch 0 and continued at other samples. Whether len() ran in between changed the plan."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry")
    sampler = PackedBatchSampler(table, config, dp_rank=0)
    list(sampler)
    carried = sampler.state_dict()["carried"]
    assert carried
    sampler.set_epoch(0)
    it = iter(sampler)
    taken = [next(it) for _ in range(2)]
    resumed = PackedBatchSampler(table, config, dp_rank=0)
    resumed.load_state_dict(sampler.state_dict())
    replay = plan_epoch(table, config, epoch=0, carried_in=carried).micro_batches(0)
    assert taken + list(it) == taken + list(resumed) == [list(b.samples) for b in replay]


def _steps_then_drain(sampler: PackedBatchSampler) -> list:
    """The next iteration's micro-batches, after checking that micro_batches_per_step() lists its steps
    (and sums to len()); returns them grouped by those steps."""
    per_step = sampler.micro_batches_per_step()
    assert sum(per_step) == len(sampler)
    it = iter(sampler)
    steps = [[next(it) for _ in range(n)] for n in per_step]
    assert list(it) == []
    return steps


# rank 1's steps: 3, 3, 1 micro-batches; 1, 1, 2, 1, ...
@pytest.mark.parametrize("kw", [dict(micro_batches_per_rank=3), dict(samples_per_step=8)])
def test_micro_batches_per_step_lists_the_steps_the_next_iteration_yields(samples, kw):
    """After a resume at position p, micro_batches_per_step() still listed every step of the epoch: a loop
    `for n in sampler.micro_batches_per_step()` ran steps past the epoch's end, and steps cut
    micro-batches at other places than the plan's steps."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(**kw)
    straight = PackedBatchSampler(table, config, dp_rank=1)
    whole = straight.micro_batches_per_step()
    assert len(whole) > 2 and sum(whole) == len(straight)
    reference = _steps_then_drain(straight)
    flat = [b for step in reference for b in step]
    next_epoch = straight.micro_batches_per_step()
    for position in range(len(flat)):  # at a step boundary or inside a step
        first = PackedBatchSampler(table, config, dp_rank=1)
        it = iter(first)
        [next(it) for _ in range(position)]
        resumed = PackedBatchSampler(table, config, dp_rank=1)
        resumed.load_state_dict(first.state_dict())
        for sampler in (first, resumed):  # mid-iteration, resumed: the rest, the current step's rest first
            assert sum(sampler.micro_batches_per_step()) == len(sampler) == len(flat) - position
        steps = _steps_then_drain(resumed)
        done = np.searchsorted(np.cumsum(whole), position, side="right")  # steps finished before p
        inside = position - sum(whole[:done])
        assert steps == [reference[done][inside:]] + reference[done + 1:]
        assert resumed.micro_batches_per_step() == next_epoch  # the next epoch, all its steps
        assert sum(next_epoch) == len(resumed) > 0
    resumed.set_epoch(0)  # a new epoch: all its steps
    assert sum(resumed.micro_batches_per_step()) == len(resumed) == len(_len_then_drain(resumed))


def test_state_at_the_end_of_an_unfinished_iteration_resumes_at_the_next_epoch(samples):
    """A state saved after next() took the epoch's last micro-batch (the iterator not yet exhausted)
    resumed into an empty epoch (len 0) before the next one; it is now the start of the next epoch,
    as if saved after the iteration finished."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry")
    straight = PackedBatchSampler(table, config, dp_rank=0)
    assert straight.plan().carried  # the next epoch starts with samples this one carried
    list(straight)
    finished = straight.state_dict()
    assert (finished["epoch"], finished["position"]) == (1, 0) and finished["carried"]
    reference = list(straight) + list(straight)
    paused = PackedBatchSampler(table, config, dp_rank=0)
    it = iter(paused)
    [next(it) for _ in range(len(paused))]
    assert paused.state_dict() == paused.state_dict(consumed=paused._epoch_length()) == finished
    unfinished = {**finished, "epoch": 0, "position": paused._epoch_length(), "carried": []}  # saved before this fix
    for state in (paused.state_dict(), unfinished):
        resumed = PackedBatchSampler(table, config, dp_rank=0)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == finished
        assert len(resumed) == sum(resumed.micro_batches_per_step()) > 0
        assert _len_then_drain(resumed) + _len_then_drain(resumed) == reference


def test_cost_model_is_part_of_the_layout_only_when_it_balances(samples):
    """With balance=False costs only price the bins, they move no sample: a state was refused after a
    harmless change of the cost model's coefficients. Under balance=True they move samples: refused."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    cheaper = dataclasses.replace(CostModel.qwen2_5_vl_7b(), lm_attention=1.0, vision_linear=2.0)
    for balance in (False, True):
        first = PackedBatchSampler(table, _config(balance=balance), dp_rank=1)
        it = iter(first)
        taken = [next(it) for _ in range(3)]
        state = first.state_dict()
        other = PackedBatchSampler(table, _config(balance=balance, cost_model=cheaper), dp_rank=1)
        if balance:
            with pytest.raises(ValueError, match="sampler state has cost_model.lm_attention="):
                other.load_state_dict(state)
            continue
        assert not any(key.startswith("cost_model") for key in state["layout"])
        reference = list(PackedBatchSampler(table, _config(balance=False, cost_model=cheaper), dp_rank=1))
        other.load_state_dict(state)
        assert taken + list(other) == reference
        # a state saved before this change recorded the coefficients under balance=False too
        default = CostModel.qwen2_5_vl_7b()
        coefficients = {f"cost_model.{f.name}": getattr(default, f.name) for f in dataclasses.fields(default)}
        other.load_state_dict({**state, "layout": {**state["layout"], **coefficients}})
        assert taken + list(other) == reference


def test_a_new_iteration_after_the_last_micro_batch_was_taken_starts_the_next_epoch(samples):
    """After next() took an epoch's last micro-batch (the iterator not yet exhausted), a fresh iter() yielded
    an empty epoch first. It now yields the next epoch, and the old iterator, exhausted later, neither
    yields again nor moves the sampler on a second time (whether before or after the new one started)."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    config = _config(tail="carry")
    straight = PackedBatchSampler(table, config, dp_rank=1)
    epochs = [list(straight) for _ in range(3)]
    assert straight.plan().carried is not None and all(epochs)

    def took_all(sampler):
        it = iter(sampler)
        assert [next(it) for _ in range(len(epochs[0]))] == epochs[0]
        return it

    for old_finishes in ("before_new_starts", "after_new_starts", "after_new_finishes"):
        sampler = PackedBatchSampler(table, config, dp_rank=1)
        old = took_all(sampler)
        assert len(sampler) == len(epochs[1]) and sum(sampler.micro_batches_per_step()) == len(epochs[1])
        new = iter(sampler)
        if old_finishes == "before_new_starts":
            assert list(old) == []
            assert list(new) == epochs[1]
        elif old_finishes == "after_new_starts":
            first = next(new)
            assert list(old) == []
            assert [first, *new] == epochs[1]
        else:
            assert list(new) == epochs[1]
            assert list(old) == []
        assert list(sampler) == epochs[2]


def test_set_epoch_leaves_an_earlier_iterator_without_more_micro_batches(samples):
    """An iterator that outlived a set_epoch yielded its old epoch's bins from the new epoch's position."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    sampler = PackedBatchSampler(table, _config(), dp_rank=0)
    reference = list(PackedBatchSampler(table, _config(), dp_rank=0))
    old = iter(sampler)
    next(old)
    sampler.set_epoch(3)
    assert list(old) == []
    assert sampler.state_dict()["epoch"] == 3 and sampler.state_dict()["position"] == 0
    sampler.set_epoch(0)
    assert list(sampler) == reference


@pytest.mark.parametrize("edit, message", [
    (dict(epoch=1.5), r"sampler state has epoch=1.5: it must be an int >= 0"),  # resumed epoch 1
    (dict(position=True), r"sampler state has position=True: it must be an int >= 0"),  # resumed at 1
    (dict(epoch=None), r"sampler state has epoch=None: it must be an int >= 0"),  # TypeError from int()
    (dict(carried=[1.5]), r"sampler state has carried=\[1.5\]: it must be a list of sample indices"),  # sample 1
    (dict(carried=3), r"sampler state has carried=3: it must be a list of sample indices"),  # TypeError
    (dict(layout="x"), r"sampler state has layout='x': it must be a dict \(what state_dict\(\) saved\)"),
    (dict(format=True), r"sampler state has format=True; this version reads formats 1 and 2"),  # read as format 1
    (dict(format=torch.tensor(2)), r"sampler state has format=tensor\(2\); this version reads formats 1 and 2"),
])
def test_a_state_with_fields_of_the_wrong_type_is_refused_not_truncated(samples, edit, message):
    table = SampleTable.from_samples([metadata(s) for s in samples])
    sampler = PackedBatchSampler(table, _config(), dp_rank=0)
    state = {**sampler.state_dict(), **edit}
    with pytest.raises(ValueError, match=message):
        PackedBatchSampler(table, _config(), dp_rank=0).load_state_dict(state)


def test_a_state_with_keys_no_sampler_saves_is_refused(samples):
    """A key nothing reads (a typo of a field, or another object's state) was ignored and the state resumed."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    sampler = PackedBatchSampler(table, _config(), dp_rank=0)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match=r"sampler state of format 2 has key\(s\) 'postion' that no sampler saves"):
        PackedBatchSampler(table, _config(), dp_rank=0).load_state_dict({**state, "postion": 3})
    old = {"epoch": 0, "position": 3, "carried": [], "seed": 3, "num_samples": len(samples), "dp_size": 2}
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"format 1 has key\(s\) 'layout', 'tail'"):
        PackedBatchSampler(table, _config(), dp_rank=0).load_state_dict({**old, "tail": "carry", "layout": {}})
    resumed = PackedBatchSampler(table, _config(), dp_rank=0)
    with pytest.warns(UserWarning):
        resumed.load_state_dict({**old, "format": 1})  # format 1 written out loads as before
    assert resumed.state_dict()["position"] == 3


def test_a_sampler_refuses_arguments_of_the_wrong_type(samples):
    table = SampleTable.from_samples([metadata(s) for s in samples])
    sampler = PackedBatchSampler(table, _config(), dp_rank=0)
    with pytest.raises(ValueError, match=r"the sampler state must be a dict \(what state_dict\(\) saved\), got NoneType"):
        sampler.load_state_dict(None)  # was an AttributeError ('get')
    with pytest.raises(ValueError, match=r"consumed must be an int \(micro-batches trained\) or None, got 1.5"):
        sampler.state_dict(consumed=1.5)  # was read as 1
    with pytest.raises(ValueError, match=r"table must be a SampleTable, got list"):
        PackedBatchSampler([5, 6], _config(), dp_rank=0)  # an AttributeError when planning
    with pytest.raises(ValueError, match=r"config must be a PlannerConfig, got NoneType"):
        PackedBatchSampler(table, None, dp_rank=0)  # an AttributeError ('dp_size')
    with pytest.raises(ValueError, match=r"progress must be a bool, got 'no'"):
        PackedBatchSampler(table, _config(), dp_rank=0, progress="no")  # drew the progress line
    with pytest.raises(ValueError, match=r"progress must be a bool, got 'no'"):
        plan_epoch(table, _config(), progress="no")


def test_carried_over_names_the_samples_the_last_epoch_left_untrained(samples):
    """tail="carry": an epoch's last samples (less than a step) lead the next epoch, so those of the last epoch a
    run trains are never trained. The sampler kept them only in a private field (and in state_dict's "carried"),
    so a run could not see how many it left out."""
    table = SampleTable.from_samples([metadata(s) for s in samples])
    sampler = PackedBatchSampler(table, _config(tail="carry"), dp_rank=0)
    first = sampler.plan()
    assert sampler.carried_over() == ()  # nothing carried into the first epoch
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(len(sampler))]
    assert first.carried and sampler.carried_over() == first.carried  # its last micro-batch taken, not finished
    assert list(iterator) == [] and sampler.carried_over() == first.carried  # finished: the same samples
    assert not {s for b in taken for s in b} & set(first.carried)  # not trained in this epoch
    assert tuple(sampler.state_dict()["carried"]) == first.carried
    second = sampler.plan()
    assert set(first.carried) <= {s for b in second.bins() for s in b.samples}  # a next epoch trains them first
