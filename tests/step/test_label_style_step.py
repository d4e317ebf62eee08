"""Through the shipped step: labels in the other style than `make_forward_step(label_style=)` says are refused
before the model runs, packed or dense, for a GPTModel and for the mRoPE PackedVLM with media.

Before, Megatron labels (already shifted) given to the default `label_style="hf"` step were shifted again and
the step trained every token on the one two ahead, silently (the loss below is finite and differs); the rule
and its cases are in `packing/label_style.py` and tests/packing/test_label_style.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.packing.rows import shift_labels_within_rows
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.train.step import make_forward_step

AS_MEGATRON = r"labels look already shifted \(Megatron style\) but label_style=\"hf\" shifts them again"
AS_HF = r"labels look like Hugging Face \(unshifted\) labels but label_style=\"megatron\" takes them"


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.testing.step_models import step_batch, tiny_step_models

    torch.manual_seed(0)
    ids = torch.randint(1, 120, (3, 12))
    mask = (torch.arange(12)[None] < torch.tensor([[12], [9], [5]])).long()
    hf = {"input_ids": ids, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}
    vlm_hf = step_batch("vlm")  # Hugging Face style: unshifted, -100 at prompts and placeholders
    return dict(models=tiny_step_models(), gpt={"hf": hf, "megatron": as_megatron(hf)},
                vlm={"hf": vlm_hf, "megatron": as_megatron(vlm_hf)})


def as_megatron(batch: dict) -> dict:
    """The same samples with Megatron labels: each token's target (its next token, or -100) at its own position."""
    return dict(batch, labels=shift_labels_within_rows(batch["labels"], batch["attention_mask"].bool()))


@pytest.mark.parametrize("model_name", ["gpt", "vlm"])
@pytest.mark.parametrize("pack", [True, False])
def test_each_style_given_as_the_other_is_refused_by_the_step(setup, model_name, pack):
    model, batches = setup["models"][model_name], setup[model_name]
    for declared, refused in (("hf", AS_MEGATRON), ("megatron", AS_HF)):
        step = make_forward_step(pack=pack, label_style=declared)
        wrong = batches["megatron" if declared == "hf" else "hf"]
        with pytest.raises(ValueError, match=refused):
            step(iter([dict(wrong)]), model)
        output, loss_fn = step(iter([dict(batches[declared])]), model)
        assert torch.isfinite(loss_fn(output)[0])


def test_both_styles_of_one_sample_train_the_same_targets(setup):
    """The declared style read right: the same samples in either style give the same loss (so the refusal is
    all that stands between a user and the other style's loss)."""
    model, batches = setup["models"]["gpt"], setup["gpt"]
    losses = []
    for style in ("hf", "megatron"):
        output, loss_fn = make_forward_step(label_style=style)(iter([dict(batches[style])]), model)
        losses.append(float(loss_fn(output)[0]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_the_loader_refuses_in_its_worker(setup):
    """PackingCollator checks in the DataLoader's worker (the batch on the CPU, no sync; tests/perf holds the
    step's budget for what it yields); the step then takes the micro-batch as packed."""
    batches = setup["gpt"]
    with pytest.raises(ValueError, match=AS_MEGATRON):
        PackingCollator(label_style="hf")(dict(batches["megatron"]))
    packed = PackingCollator(label_style="hf")(dict(batches["hf"]))
    output, loss_fn = make_forward_step(label_style="hf")(iter([packed]), setup["models"]["gpt"])
    assert torch.isfinite(loss_fn(output)[0])


ONE_SAMPLE = (r"labels of one sample look already shifted \(Megatron style\) but label_style=\"hf\" shifts them again: "
              r"row {}")


@pytest.mark.parametrize("lengths, megatron_rows", [([20, 15, 30, 10], [0, 2, 3]), ([19] * 9, [4])],
                         ids=["3 Megatron rows, 1 HF (20/15/30/10)", "1 Megatron row among 8 HF"])
@pytest.mark.parametrize("pack", [True, False])
def test_a_micro_batch_mixing_styles_is_refused_by_the_step(setup, lengths, megatron_rows, pack):
    """Blended sources collated differently: Megatron rows among HF ones under the default "hf". Before, the
    micro-batch's counts passed it (the HF rows' evidence hid the others) and the step trained those rows on
    the token two ahead (52 of 71 targets in the first case, 18 of 152 in the second); now the row is named."""
    torch.manual_seed(1)
    width = max(lengths) + 2
    ids = torch.randint(1, 120, (len(lengths), width))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    hf = {"input_ids": ids, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}
    mixed = dict(hf, labels=hf["labels"].clone())
    mixed["labels"][megatron_rows] = as_megatron(hf)["labels"][megatron_rows]
    step = make_forward_step(pack=pack, label_style="hf")
    with pytest.raises(ValueError, match=ONE_SAMPLE.format(megatron_rows[0])):
        step(iter([dict(mixed)]), setup["models"]["gpt"])
    with pytest.raises(ValueError, match=ONE_SAMPLE.format(megatron_rows[0])):
        PackingCollator(label_style="hf")(dict(mixed))
    output, loss_fn = step(iter([dict(hf)]), setup["models"]["gpt"])
    assert torch.isfinite(loss_fn(output)[0])
