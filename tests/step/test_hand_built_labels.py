"""Labels no packer checked (a `transform=` or a `dataclasses.replace` gave the micro-batch other labels) are
checked where the micro-batch enters the model (`prepare_for_model`): an integer tensor holding -100 or a
token id in [0, vocab_size) (the adapter's `vocab_size`, when known) at every slot.

Before, a label >= the vocabulary reached Megatron's vocab-parallel cross entropy, which masks a target
outside the rank's range: that token's loss silently became the log-sum-exp of its logits. Float labels
were an IndexError inside the cross entropy, a label of -5 an IndexError or a silent mask. Labels the
packers made (kept by moves and `replace` of other fields) cost no host sync here.
"""

from dataclasses import replace

import pytest
import torch

from megatron_vlm_packing.models.adapter import ModelAdapter
from megatron_vlm_packing.packing import pack_batch, pad_batch
from megatron_vlm_packing.packing.collate import PackingCollator, micro_batch_to
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from megatron_vlm_packing.train.step import prepare_for_model


class _Adapter(ModelAdapter):
    def __init__(self, vocab_size=None):
        self.model_name, self.vocab_size = "Model", vocab_size


def _batch():
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    keep = (ids != 0).long()
    return {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep}


def _with_label(labels: torch.Tensor, slot: int, value: int) -> torch.Tensor:
    out = labels.clone()
    out.view(-1)[slot] = value
    return out


@pytest.mark.parametrize("packer", [pack_batch, pad_batch])
def test_a_label_outside_the_vocabulary_is_refused(packer):
    packed = packer(_batch(), label_style="hf")
    bad = replace(packed, labels=_with_label(packed.labels, 1, 64))
    with pytest.raises(ValueError, match=r"labels row 0 position 1 is 64: a label must be -100 \(ignored\) or a "
                                         r"token id in \[0, 64\)"):
        prepare_for_model(bad, _Adapter(vocab_size=64), ParallelLayout())
    prepare_for_model(bad, _Adapter(vocab_size=65), ParallelLayout())  # in range: taken


@pytest.mark.parametrize("value", [-5, -101])
def test_a_negative_label_other_than_ignore_is_refused_with_or_without_a_vocabulary(value):
    packed = pack_batch(_batch(), label_style="hf")
    bad = replace(packed, labels=_with_label(packed.labels, 2, value))
    for adapter in (_Adapter(), _Adapter(vocab_size=64)):
        with pytest.raises(ValueError, match=rf"labels row 0 position 2 is {value}"):
            prepare_for_model(bad, adapter, ParallelLayout())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_labels_that_are_not_integers_are_refused(dtype):
    packed = pack_batch(_batch(), label_style="hf")
    with pytest.raises(ValueError, match=rf"labels must be an integer tensor of token ids, got {dtype}"):
        prepare_for_model(replace(packed, labels=packed.labels.to(dtype)), _Adapter(), ParallelLayout())


def test_packed_labels_cost_no_sync_and_replaced_ones_one():
    """Labels the packer checked below the model's vocabulary cost no sync; labels checked without it, or
    replaced, one (the step checks a loader's in host memory first: `check_loader_vocab`)."""
    from megatron_vlm_packing.train.loader_vocab import check_loader_vocab

    vocab = dict(vocab_size=64)
    loader = micro_batch_to(PackingCollator(label_style="hf", pack_options=vocab)(_batch()), torch.device("cpu"))
    unbound = PackingCollator(label_style="hf")(_batch())
    for packed in (pack_batch(_batch(), label_style="hf", **vocab), pad_batch(_batch(), label_style="hf", **vocab),
                   loader, replace(loader, stats=loader.stats), check_loader_vocab(unbound, 64)):
        with count_host_syncs() as syncs:
            prepare_for_model(packed, _Adapter(vocab_size=64), ParallelLayout())
        assert syncs.total == 0, syncs.report()
    for unchecked in (replace(loader, labels=loader.labels.clone()), unbound, pack_batch(_batch(), label_style="hf")):
        with count_host_syncs() as syncs:
            prepare_for_model(unchecked, _Adapter(vocab_size=64), ParallelLayout())
        assert syncs.total == 1, syncs.report()
    with count_host_syncs() as syncs:  # the model's vocabulary unknown: the lower bound the packer checked holds
        prepare_for_model(unbound, _Adapter(), ParallelLayout())
    assert syncs.total == 0, syncs.report()


def test_a_transform_giving_labels_beyond_the_models_vocabulary_is_refused(single_process_megatron):
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.train.step import make_forward_step

    torch.manual_seed(0)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=128), scatter_embedding_sequence_parallel=False)
    step = make_forward_step(transform=lambda mb: replace(mb, labels=torch.where(mb.labels >= 0, mb.labels + 1000,
                                                                                 mb.labels)))
    with pytest.raises(ValueError, match=r"labels row 0 position 0 is 1006: .* \[0, 128\)"):
        step(iter([_batch()]), model)
