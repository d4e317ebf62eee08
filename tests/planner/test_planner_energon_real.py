"""The Energon hooks through Megatron-Energon's own machinery (skipped where megatron-energon is absent).

A tiny WebDataset is written and indexed with Energon's prepare API; a task encoder built on
`PlannedPackingMixin` goes through `get_train_dataset(..., packing_buffer_size=N)` and Energon's
savable loader (in-process and with worker processes). Every pack is matched back to its samples by
token content and compared with `pack_batch` of them.
"""

import json

import pytest
import torch

pytestmark = pytest.mark.energon
energon = pytest.importorskip("megatron.energon")
wds = pytest.importorskip("webdataset")

from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, basic_sample_keys, stateless  # noqa: E402
from megatron.energon.flavors.webdataset import BaseWebdatasetFactory  # noqa: E402
from megatron.energon.wrappers.packing_dataset import PackingDataset  # noqa: E402

from megatron_vlm_packing import pack_batch  # noqa: E402
from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples  # noqa: E402
from megatron_vlm_packing.planner import BinLayout, EnergonPackingHooks, PlannedPackingMixin  # noqa: E402
from tests.planner.synthetic_metadata import CFG, metadata  # noqa: E402

CAPACITY, BUFFER, NUM_SAMPLES = 96, 7, 45  # 45 = 6 full buffers and a last one of 3 in one process
PACK = {"label_style": "hf", "image_token_id": SyntheticVLMConfig().image_token_id}
FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")


@pytest.fixture(scope="module")
def samples():
    drawn = synthetic_samples(NUM_SAMPLES, seed=17, cfg=CFG)
    assert len({tuple(s["input_ids"].tolist()) for s in drawn}) == NUM_SAMPLES  # a pack's rows name its samples
    return drawn


@pytest.fixture(scope="module")
def dataset_path(tmp_path_factory, samples):
    """Two shards of JSON samples, indexed by Energon (`.nv-meta/`), read as a CrudeWebdataset."""
    root = tmp_path_factory.mktemp("energon_wds")
    shards = ["part_0.tar", "part_1.tar"]
    for shard, first in zip(shards, (0, 1)):
        with wds.TarWriter(str(root / shard)) as writer:
            for index in range(first, len(samples), 2):
                s = samples[index]
                writer.write({"__key__": f"s{index:03d}", "json": json.dumps(
                    {k: s[k].tolist() for k in ("input_ids", "labels", "image_grid_thw", "pixel_values")}).encode()})
    BaseWebdatasetFactory.prepare_dataset(root, shards, split_parts_ratio=[("train", 1.0)], workers=1)
    (root / ".nv-meta" / "dataset.yaml").write_text("__module__: megatron.energon\n__class__: CrudeWebdataset\n")
    return root


@stateless
def cook(crude: dict) -> dict:
    """The JSON part -> the tensors `collate` and `metadata` read (Energon's sample keys kept for restore)."""
    d = crude["json"]
    return dict(**basic_sample_keys(crude), input_ids=torch.tensor(d["input_ids"]), labels=torch.tensor(d["labels"]),
                image_grid_thw=torch.tensor(d["image_grid_thw"], dtype=torch.long).reshape(-1, 3),
                pixel_values=torch.tensor(d["pixel_values"]).reshape(-1, CFG.patch_features))


def encoder(layout: BinLayout = BinLayout(capacity=CAPACITY)):
    class Encoder(PlannedPackingMixin, DefaultTaskEncoder):
        cookers = [Cooker(cook)]
        packing_hooks = EnergonPackingHooks(metadata=metadata, collate=collate, layout=layout, pack_kwargs=PACK)

    return Encoder()


def loader(path, *, num_workers=0, batch_size=None, layout=BinLayout(capacity=CAPACITY), state=None):
    dataset = energon.get_train_dataset(
        path, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=num_workers), batch_size=batch_size,
        shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=encoder(layout),
        packing_buffer_size=BUFFER, repeat=False)
    savable = energon.get_savable_loader(dataset, checkpoint_every_min_n_samples=1, watchdog_timeout_seconds=None)
    if state is not None:
        savable.restore_state_rank(state)
    return savable


def members(packed, samples) -> list[int]:
    """The indices of the samples whose tokens the pack's documents are, in pack order."""
    by_tokens = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(samples)}
    ids, starts = packed.input_ids[0].tolist(), packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    return [by_tokens[tuple(ids[start:start + n])] for start, n in zip(starts, packed.plan.real_lengths)]


def assert_is_pack_batch_of(packed, group: list[dict], capacity: int) -> None:
    expected = pack_batch(collate(group), pad_to=capacity, **PACK)
    assert packed.input_ids.shape == (1, capacity)
    for name in FIELDS:
        assert torch.equal(getattr(packed, name), getattr(expected, name)), name
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        assert torch.equal(getattr(packed.packed_seq_params, name), getattr(expected.packed_seq_params, name)), name
    assert packed.plan == expected.plan
    if expected.vision is None:  # no sample of the group has an image
        assert packed.vision is None
    else:
        assert torch.equal(packed.vision.pixel_values, expected.vision.pixel_values)
        assert torch.equal(packed.vision.image_grid_thw, expected.vision.image_grid_thw)


@pytest.mark.parametrize("num_workers, batch_size", [(0, None), (2, None), (0, 1)])
def test_every_sample_lands_in_exactly_one_pack(dataset_path, samples, num_workers, batch_size):
    """batch_size=1 (Megatron's micro-batch of one pack): Energon's default `batch` failed on the MicroBatch
    (TypeError), its error handler logged each failure and dropped the pack: the epoch yielded nothing."""
    packs = list(loader(dataset_path, num_workers=num_workers, batch_size=batch_size))
    groups = [members(p, samples) for p in packs]
    assert sorted(i for g in groups for i in g) == list(range(NUM_SAMPLES))
    assert len(packs) < NUM_SAMPLES  # packed, not one sample a pack
    for packed, group in zip(packs, groups):
        assert_is_pack_batch_of(packed, [samples[i] for i in group], CAPACITY)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_mid_epoch_resumes_without_loss_or_duplication(dataset_path, samples, num_workers):
    """Energon's state holds the buffered samples and the selected groups not yet packed (restore keys);
    after a restore they are re-read, re-encoded and packed: the rest of the epoch is the uninterrupted one."""
    reference = [members(p, samples) for p in loader(dataset_path, num_workers=num_workers)]
    for stop in (1, 3, len(reference) // 2):
        first = loader(dataset_path, num_workers=num_workers)
        it = iter(first)
        seen = [members(next(it), samples) for _ in range(stop)]
        state = first.save_state_rank()
        # Drained, the first loader's workers end at once; abandoned mid-epoch, each waits out torch's join timeout.
        assert seen + [members(p, samples) for p in it] == reference, stop  # saving the state changed nothing
        rest = [members(p, samples) for p in loader(dataset_path, num_workers=num_workers, state=state)]
        assert seen + rest == reference, stop


def test_an_oversize_sample_stops_energon_under_oversize_error(dataset_path, samples):
    """Energon's error handler logs a hook's exception and drops the whole buffer: under oversize='error'
    one sample over the capacity dropped the 6 others of its buffer and training went on without them."""
    capacity = max(len(s["input_ids"]) for s in samples) - 1
    with pytest.raises(ValueError, match=rf"exceed the bin capacity {capacity}"):
        list(loader(dataset_path, layout=BinLayout(capacity=capacity)))
    own = BinLayout(capacity=capacity, oversize="own_bin")
    packs = list(loader(dataset_path, layout=own))
    groups = [members(p, samples) for p in packs]
    assert sorted(i for g in groups for i in g) == list(range(NUM_SAMPLES))
    assert [len(g) for g, p in zip(groups, packs) if p.input_ids.shape[1] > capacity] == [1]  # alone, untruncated


def test_energon_reads_the_mixin_as_stateless(dataset_path):
    """The final packer's `__stateless__` (what Energon's @stateless sets) is what Energon records."""
    dataset = energon.get_train_dataset(
        dataset_path, worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), batch_size=None,
        shuffle_buffer_size=None, max_samples_per_sequence=None, task_encoder=encoder(), packing_buffer_size=BUFFER)
    while not isinstance(dataset, PackingDataset):  # the outermost with batch_size=None
        dataset = dataset.dataset
    assert dataset.final_packer_stateless and dataset.buffer_size == BUFFER
