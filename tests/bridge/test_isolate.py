"""benchmarks/bridge_qwen3_vl_gpu.py --isolate cannot rot: on the smallest CPU config every hook fires
as often as the forwards it ran must make it, every stage is compared (every image / video of the vision
output), the fp32 stages of packed and alone agree within 1e-5 in every setup, and the one-document
control shows up first in the language model; the bf16 build runs the same path."""

import sys
from pathlib import Path

import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
ARGS = ["--device", "cpu", "--isolate", "--samples", "3", "--max-text", "24"]


def _benchmark():
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import bridge_qwen3_vl_gpu

    return bridge_qwen3_vl_gpu


def _isolate(rank, world_size):
    from megatron_vlm_packing.bridge.samples import qwen_vl_samples
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig

    samples = qwen_vl_samples(TinyBridgeConfig(family="qwen3_vl"), 3, seed=0, max_text=24)
    counts = {"samples": len(samples), "with_vision": sum(len(s["image_grid_thw"]) + len(s["video_grid_thw"]) > 0
                                                          for s in samples),
              "items": sum(len(s["image_grid_thw"]) + len(s["video_grid_thw"]) for s in samples)}
    runs = {dtype: _benchmark().run(ARGS + ["--dtype", dtype]) for dtype in ("fp32", "bf16")}
    return counts, runs


def check_hooks(hooks: dict, samples: int, with_vision: int, items: int) -> None:
    """Hook calls of the four setups: as is (pack + each alone), alone fed packed vision (each alone),
    vision per item (pack + each alone, the tower's modules once per image / video), control (pack)."""
    forwards = 3 + 3 * samples
    tower = 3 + 3 * with_vision
    inner = 1 + with_vision + with_vision + 2 * items + 1
    for name, fired in hooks.items():
        if name in ("vision.grid", "vision.embeds") or name.startswith("vision.deepstack"):
            assert fired == tower, (name, fired, tower)
        else:
            assert fired == (inner if name.startswith("vision.") else forwards), (name, fired)


@pytest.fixture(scope="module")
def isolate_runs():
    return run_distributed(_isolate, 1, timeout_s=300)


@pytest.mark.bridge
def test_isolate_fp32_stages_equal_and_hooks_fired(isolate_runs):
    counts, runs = isolate_runs
    result, text, status = runs["fp32"]
    assert status == 0 and result["dtype"] == str(torch.float32) and "| stage |" in text
    detail = ["input_layernorm", "self_attention.linear_qkv", "self_attention.q_layernorm",
              "self_attention.k_layernorm", "self_attention.core_attention", "self_attention.linear_proj",
              "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2"]
    vision_detail = [d for d in detail if d not in ("self_attention.q_layernorm", "self_attention.k_layernorm")]

    def layers(prefix, names, count):
        return [f"{prefix}.layer{i}{suffix}" for i in range(count) for suffix in [f".{n}" for n in names] + [""]]

    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig

    cfg = TinyBridgeConfig(family="qwen3_vl")

    stages = ["positions", "lm.rotary", "lm.rotary cos/sin", "vision.patch_embed", *layers("vision", vision_detail, cfg.vision_depth),
              "vision.merger.patch_norm", "vision.merger.linear_fc1", "vision.merger.linear_fc2", "vision.merger",
              "vision.embeds", "vision.deepstack0", "vision.deepstack1", "lm.decoder_input", *layers("lm", detail, cfg.num_layers)]
    hooked = [s for s in stages if s not in ("positions", "lm.rotary cos/sin", "vision.deepstack0", "vision.deepstack1")]
    assert set(result["hooks"]) == {*hooked, "vision.grid", "vision.deepstack0", "vision.deepstack1"}
    check_hooks(result["hooks"], counts["samples"], counts["with_vision"], counts["items"])
    assert result["dropped_stages"] == []
    setups = result["setups"]
    for name in ("as is", "alone fed packed vision", "vision one item at a time"):
        setup = setups[name]
        own_tower = [s for s in hooked if s.startswith("vision.") and s != "vision.embeds"]  # replaced when fed
        expected = [s for s in stages if name != "alone fed packed vision" or s not in own_tower]
        assert list(setup["stages"]) == expected, (name, list(setup["stages"]))
        assert all(diff <= 1e-5 for diff, _ in setup["stages"].values()), (name, setup["stages"])
        assert setup["token_mult_prob_error"] < 1 + 1e-5, (name, setup["token_mult_prob_error"])
        assert all(n == counts["items"] for _, n in setup["items_bitwise"].values()), setup["items_bitwise"]
    control = setups["control: pack as one document"]
    assert control["token_mult_prob_error"] > 1.001
    assert control["first_difference"] == "lm.layer0.self_attention.core_attention"  # where documents meet


@pytest.mark.bridge
def test_isolate_bf16_runs_the_same_path(isolate_runs):
    _, runs = isolate_runs
    result, text, status = runs["bf16"]
    assert status == 0 and result["dtype"] == str(torch.bfloat16) and "CPU bf16" in text
    assert result["hooks"] == runs["fp32"][0]["hooks"]
    assert result["setups"]["control: pack as one document"]["token_mult_prob_error"] > 1.001


def _setups(as_is: float, fed: float) -> dict:
    return {"as is": {"token_mult_prob_error": as_is, "first_difference": "vision.merger.linear_fc1"},
            "alone fed packed vision": {"token_mult_prob_error": fed,
                                        "first_difference": "lm.layer0.self_attention.core_attention"}}


def test_verdict_names_the_vision_tower_or_the_language_model():
    verdict = _benchmark().verdict
    assert "nothing to isolate" in verdict(_setups(1.0000004, 1.0))
    assert "vision tower" in verdict(_setups(1.001368, 1.0000004)) and "vision.merger.linear_fc1" in verdict(
        _setups(1.001368, 1.0))
    text = verdict(_setups(1.001368, 1.0009))
    assert "language-model path" in text and "1.000900" in text and "core_attention" in text


def test_table_shows_sub_modules_of_layer_0_and_of_the_first_differing_layer():
    shown = _benchmark().shown
    setups = {"as is": {"first_difference": "lm.layer1.mlp.linear_fc1"}}
    assert shown("lm.layer0.mlp.linear_fc1", setups) and shown("lm.layer1.self_attention.linear_qkv", setups)
    assert not shown("lm.layer2.mlp.linear_fc1", setups) and not shown("vision.layer1.mlp.linear_fc1", setups)
    assert shown("lm.layer2", setups) and shown("vision.merger.linear_fc1", setups)
