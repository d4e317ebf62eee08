"""The batch sampler in a real DataLoader, resume mid-epoch, and the Energon hooks on plain objects."""

import pytest
import torch

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import PackMultiples, pack_batch
from megatron_vlm_packing.packing.arena import all_in_one_storage
from megatron_vlm_packing.packing.collate import LoaderMicroBatch, tensors_of
from megatron_vlm_packing.planner import (BinLayout, EnergonPackingHooks, PackedBatchSampler, PlannedPackingMixin,
                                          PlannerConfig, SampleMetadata, SampleTable)

CFG = SyntheticVLMConfig(max_text=40, grid_choices=(2, 4))


def metadata(sample: dict) -> SampleMetadata:
    """What a loader knows before reading pixels: token ids and image grids."""
    grids = tuple(tuple(int(x) for x in g) for g in sample["image_grid_thw"].tolist())
    vision = sum(t * h * w // 4 + 2 for t, h, w in grids)
    return SampleMetadata(text_tokens=len(sample["input_ids"]) - vision, image_grids=grids)


@pytest.fixture(scope="module")
def samples():
    return synthetic_samples(60, seed=7, cfg=CFG)


def _config(**kw):
    multiples = PackMultiples.for_parallel(cp_size=2)
    kw.setdefault("layout", BinLayout(capacity=160, multiples=multiples))
    return PlannerConfig(dp_size=2, micro_batches_per_rank=2, window_steps=2, seed=3, **kw)


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
    other_seed = PlannerConfig(layout=config.layout, dp_size=2, micro_batches_per_rank=2, seed=4)
    with pytest.raises(ValueError, match="seed"):
        PackedBatchSampler(table, other_seed, dp_rank=0).load_state_dict(state)


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
