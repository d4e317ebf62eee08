import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from megatron_vlm_packing import loss_func, make_forward_step
from megatron_vlm_packing.packing.micro_batch import BatchStats
from megatron_vlm_packing.train.build import StepOptions


def test_two_and_three_argument_forms():
    assert list(inspect.signature(make_forward_step()).parameters) == ["data_iterator", "model"]
    assert list(inspect.signature(make_forward_step(with_state=True)).parameters) == ["state", "data_iterator", "model"]


def test_example_script_wires_our_forward_step():
    path = Path(__file__).resolve().parents[2] / "examples" / "pretrain_vlm_packed.py"
    spec = importlib.util.spec_from_file_location("pretrain_vlm_packed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert list(inspect.signature(module.forward_step).parameters) == ["data_iterator", "model"]
    assert module.datasets_provider.is_distributed


def test_step_options_refuse_the_other_paths_length():
    with pytest.raises(ValueError, match=r"seq_length=8 is the dense row length"):
        StepOptions(pack=True, seq_length=8)
    with pytest.raises(ValueError, match=r"pad_to=8 is the fixed packed length"):
        StepOptions(pack=False, pad_to=8)
    with pytest.raises(ValueError, match=r"label_style must be 'megatron' or 'hf', got 'HF'"):
        make_forward_step(label_style="HF")


@pytest.mark.parametrize("kwargs, message", [
    (dict(pack=None), r"pack must be a bool, got None"),  # ran dense
    (dict(pack="no"), r"pack must be a bool, got 'no'"),  # packed
    (dict(with_state="False"), r"with_state must be a bool, got 'False'"),  # gave the 3-argument form
    (dict(broadcast_from_tp_rank0=1), r"broadcast_from_tp_rank0 must be a bool, got 1"),
    (dict(transform=5), r"transform must be a callable .* got 5"),  # a TypeError at the first call
    # Each below was accepted here and refused only at the first step (from a micro-batch packed in the
    # DataLoader, pad_to="8" was compared with the pack's length: "has length 8 but ... pad_to=8")
    (dict(fp8="no"), r"fp8 must be a bool, got 'no'"),
    (dict(pad_to="8"), r"pad_to must be an int \(the packed length T\) or None, got '8'"),
    (dict(pad_to=0), r"pad_to must be a positive int \(the packed length T\) or None, got 0"),
    (dict(pack=False, seq_length=8.0), r"seq_length must be a positive int \(the dense row length\) or None, got 8.0"),
    (dict(mrope="qwen2_vl"), r"mrope must be an MRopeConfig, a callable or None, got str"),
    (dict(adapter=3), r"adapter must be a ModelAdapter or a factory model -> ModelAdapter, got 3"),
])
def test_make_forward_step_refuses_options_of_the_wrong_type(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_forward_step(**kwargs)


def test_loss_func_contract_and_model_returned_mask():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    stats = BatchStats(real_tokens=3, physical_tokens=4, row_tokens=8)
    loss_sum, num, report = loss_func(mask, stats, losses)
    assert loss_sum.item() == 7.0 and num.item() == 3 and num.dtype == torch.int
    assert report["lm loss"].tolist() == [7.0, 3.0] and report["packing efficiency"].tolist() == [3.0, 4.0]
    assert report["padding efficiency"].tolist() == [3.0, 8.0]
    own_mask = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    loss_sum, num, _ = loss_func(mask, stats, (losses, own_mask))  # the model's own mask wins
    assert loss_sum.item() == 3.0 and num.item() == 1


def test_a_slot_of_weight_zero_adds_nothing_even_when_its_loss_is_not_finite():
    # Pad slots between THD documents hold whatever attention left there: NaN * 0 must not reach the sum.
    losses = torch.tensor([[1.0, float("nan"), 3.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.5, 0.0]])
    loss_sum, num, report = loss_func(mask, {"real_tokens": 2, "physical_tokens": 4}, losses)
    assert loss_sum.item() == 2.5 and num.item() == 2 and report["lm loss"].tolist() == [2.5, 2.0]
    loss_sum.backward()
    assert losses.grad.tolist() == [[1.0, 0.0, 0.5, 0.0]]


def test_loss_func_keeps_float_weights_and_refuses_size_mismatch():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    weights = torch.tensor([[0.5, 2.0, 0.0, 1.0]])
    loss_sum, num, _ = loss_func(weights, {"real_tokens": 4, "physical_tokens": 4}, losses)
    assert loss_sum.item() == 8.5 and num.item() == 3  # weights kept; tokens with a nonzero weight counted
    with pytest.raises(ValueError, match="returned 4 per-token losses but the loss mask has 2 entries"):
        loss_func(weights[:, :2], {"real_tokens": 4, "physical_tokens": 4}, losses)


def test_loss_func_refuses_stats_without_token_counts_and_odd_tuples():
    losses, mask = torch.ones(1, 4), torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"stats must give real_tokens and physical_tokens, got real_tokens=None"):
        loss_func(mask, {"physical_tokens": 4}, losses)  # was TypeError from float(None)
    with pytest.raises(ValueError, match=r"must return \(losses, loss_mask\), got 3 items"):
        loss_func(mask, {"real_tokens": 4, "physical_tokens": 4}, (losses, mask, mask))
