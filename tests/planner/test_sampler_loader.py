"""The batch sampler and the packing collator in a DataLoader with two persistent workers: every rank's micro-batch
holds exactly the samples its bin planned, in plan order, epoch after epoch, and a state taken with `consumed=`
while the workers run ahead resumes where training stood."""

import torch
from torch.utils.data import DataLoader, Dataset

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import PackMultiples
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.planner import BinLayout, PackedBatchSampler, PlannerConfig, SampleTable
from tests.planner.synthetic_metadata import CFG, metadata

_SAMPLES = synthetic_samples(40, seed=7, cfg=CFG)
_CONFIG = PlannerConfig(layout=BinLayout(capacity=160, multiples=PackMultiples.for_parallel(cp_size=2)), dp_size=2,
                        micro_batches_per_rank=2, window_steps=2, seed=3, tail="carry")


class _Indexed(Dataset):
    """The samples, each knowing its index (packed as a per-token extra, so a micro-batch says what it holds)."""

    def __len__(self):
        return len(_SAMPLES)

    def __getitem__(self, i):
        return {**_SAMPLES[i], "index": i}


def _collate(chunk):
    batch = collate(chunk)
    batch["index"] = torch.tensor([[s["index"]] * batch["input_ids"].shape[1] for s in chunk])
    return batch


def _held(micro_batch) -> list[int]:
    """The dataset index of each document of a packed micro-batch, in pack order."""
    starts = micro_batch.packed_seq_params.cu_seqlens_q_padded[:-1].tolist()
    return [int(micro_batch.extras["index"][0, start]) for start in starts]


def _loader(sampler):
    collator = PackingCollator(collate=_collate, cp_size=2, pad_to=160, label_style="hf", extra_keys=("index",),
                               pack_options=dict(image_token_id=SyntheticVLMConfig().image_token_id))
    return DataLoader(_Indexed(), batch_sampler=sampler, collate_fn=collator, num_workers=2, persistent_workers=True,
                      timeout=120)


def test_persistent_workers_pack_each_ranks_bins_in_plan_order_every_epoch():
    table = SampleTable.from_samples([metadata(s) for s in _SAMPLES])
    for rank in range(_CONFIG.dp_size):
        planned = PackedBatchSampler(table, _CONFIG, dp_rank=rank)
        reference = [list(planned) for _ in range(3)]  # the third epoch trains the samples the second carried
        sampler = PackedBatchSampler(table, _CONFIG, dp_rank=rank)
        loader = _loader(sampler)
        for epoch in range(3):
            sampler.set_epoch(epoch)
            assert [_held(mb) for mb in loader] == reference[epoch], (rank, epoch)


def test_a_state_taken_while_persistent_workers_run_ahead_resumes_where_training_stood():
    table = SampleTable.from_samples([metadata(s) for s in _SAMPLES])
    planned = PackedBatchSampler(table, _CONFIG, dp_rank=0)
    first = list(planned)
    reference = first + list(planned)
    for stop in (1, len(first) - 1, len(first) + 1):  # the workers have taken the epoch's last bins at the second
        sampler = PackedBatchSampler(table, _CONFIG, dp_rank=0)
        loader, trained = _loader(sampler), []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for micro_batch in loader:
                trained.append(_held(micro_batch))
                if len(trained) == stop:
                    break
            if len(trained) == stop:
                break
        state = sampler.state_dict(consumed=stop if stop <= len(first) else stop - len(first))
        resumed = PackedBatchSampler(table, _CONFIG, dp_rank=0)
        resumed.load_state_dict(state)
        rest = []
        for epoch in range(state["epoch"], 2):
            resumed.set_epoch(epoch)
            rest += list(resumed)
        assert trained + rest == reference, stop
