import importlib.util
import inspect
from pathlib import Path

import torch

from megatron_vlm_packing import make_forward_step
from megatron_vlm_packing.step import ParallelLayout, call_model, dense_inputs, loss_func, packed_inputs


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


def batch():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return {"input_ids": ids, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}


def test_packed_inputs_keep_full_ids_and_slice_the_rest_for_cp():
    inputs = packed_inputs(batch(), ParallelLayout(cp_size=2, cp_rank=1), label_style="hf", pad_to=None,
                           fp8=False, mrope=None)
    assert inputs["input_ids"].shape == (1, 8)  # full: the model merges vision embeddings first
    assert inputs["labels"].shape == (1, 4) and inputs["cp_index"].tolist() == [1, 2, 5, 6]
    assert inputs["labels"].tolist() == [[7, -100, -100, -100]]
    assert (inputs["real_tokens"], inputs["physical_tokens"], inputs["padded_tokens"]) == (5, 8, 8)


def test_dense_inputs_pad_to_the_cp_multiple():
    inputs = dense_inputs(batch(), ParallelLayout(cp_size=2, cp_rank=0), label_style="hf", seq_length=None, fp8=False)
    assert inputs["input_ids"].shape == (2, 4) and inputs["labels"].shape == (2, 2)
    assert inputs["packed_seq_params"] is None


def test_call_model_passes_only_accepted_keywords_and_local_ids_to_plain_models():
    seen = {}

    class Plain(torch.nn.Module):
        def forward(self, input_ids, position_ids, attention_mask, labels=None, packed_seq_params=None, padding_mask=None):
            seen.update(input_ids=input_ids, padding_mask=padding_mask)
            return torch.zeros(1, 4)

    class BridgeStyle(torch.nn.Module):
        def forward(self, input_ids, position_ids, labels=None, cp_index=None, moe_padding_mask=None, **kwargs):
            seen.update(bridge_ids=input_ids, moe=moe_padding_mask, extra=sorted(kwargs))
            return torch.zeros(1, 4)

    inputs = packed_inputs(batch(), ParallelLayout(cp_size=2, cp_rank=1), label_style="hf", pad_to=None,
                           fp8=False, mrope=None)
    call_model(Plain(), inputs, {})
    assert seen["input_ids"].shape == (1, 4) and seen["padding_mask"].shape == (1, 4)
    call_model(BridgeStyle(), inputs, {"pixel_values": torch.zeros(1)})
    assert seen["bridge_ids"].shape == (1, 8) and seen["moe"].shape == (1, 4)
    assert "pixel_values" in seen["extra"] and "padding_mask" not in seen["extra"]


def test_loss_func_contract_and_model_returned_mask():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    stats = {"real_tokens": 3, "physical_tokens": 4, "padded_tokens": 8}
    loss_sum, num, report = loss_func(mask, stats, losses)
    assert loss_sum.item() == 7.0 and num.item() == 3
    assert report["lm loss"].tolist() == [7.0, 3.0] and report["packing efficiency"].tolist() == [3.0, 4.0]
    own_mask = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    loss_sum, num, _ = loss_func(mask, stats, (losses, own_mask))  # the model's own mask wins
    assert loss_sum.item() == 3.0 and num.item() == 1
