"""The batch sampler in a real DataLoader, resume mid-epoch, and the Energon hooks on plain objects."""

import pytest
import torch

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import PackMultiples, pack_batch
from megatron_vlm_packing.packing.arena import all_in_one_storage
from megatron_vlm_packing.packing.collate import tensors_of
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
        assert packed.plan.real_lengths == tuple(len(s.payload["input_ids"]) for s in group)
    with pytest.raises(ValueError, match="multiples"):
        EnergonPackingHooks(metadata=metadata, collate=collate, layout=BinLayout(capacity=96),
                            pack_kwargs={"cp_size": 2})
    with pytest.raises(ValueError, match=r"\['cp'\] are not pack_batch keywords; EnergonPackingHooks passes on"):
        EnergonPackingHooks(metadata=metadata, collate=collate, layout=BinLayout(capacity=96), pack_kwargs={"cp": 2})
