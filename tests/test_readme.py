"""The README's code must stay true: its self-contained example runs and prints what its comments say,
and the examples that assume the user's own objects (a dataset, a model class, metadata) run with small
stand-ins for those, so a renamed function, keyword or module fails here, not in a user's first hour."""

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def block_with(*needles: str) -> str:
    """The one README python block holding every needle."""
    found = [b for b in python_blocks() if all(n in b for n in needles)]
    assert len(found) == 1, (needles, len(found))
    return found[0]


def run(block: str, namespace: dict) -> dict:
    exec(compile(block, str(README), "exec"), namespace)
    return namespace


def test_pack_batch_example_prints_what_its_comments_say():
    block = next(b for b in python_blocks() if "pack_batch(" in b and "megatron.training" not in b)
    expected = [m.group(1).strip() for m in re.finditer(r"^print\(.*\)\s*#\s*(\[.*?\])(?:\s{2,}.*)?$", block, flags=re.M)]
    assert len(expected) >= 4, "the README example should document its outputs in comments"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {})
    assert out.getvalue().strip().splitlines() == expected


def test_every_name_the_readme_imports_exists():
    """`from megatron_vlm_packing... import a, b` in every block (the model-building one included, which
    needs a user's model to run) names modules and attributes that exist."""
    imports = [m for b in python_blocks()
               for m in re.finditer(r"^from (megatron_vlm_packing[\w.]*) import (.+)$", b, flags=re.M)]
    assert len(imports) >= 10, len(imports)
    for match in imports:
        module = importlib.import_module(match.group(1))
        for name in (n.strip() for n in match.group(2).split(",")):
            assert hasattr(module, name), f"README imports {name} from {match.group(1)}, which has none"


def test_token_counter_presets_example_counts_what_its_asserts_say():
    run(block_with("TokenCounter.for_family"), {})


def _qwen2_5_vl_config():
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen2_5_VLConfig()


def test_packing_collator_example_builds_a_collator_that_packs():
    from megatron_vlm_packing.packing.micro_batch import MicroBatch
    from megatron_vlm_packing.rope import MRopeConfig

    hf_config = _qwen2_5_vl_config()
    vocab = 152000
    namespace = run(block_with("PackingCollator("), {"MRopeConfig": MRopeConfig, "my_collate": None,
                                                     "hf_config": hf_config, "model_vocab_size": vocab,
                                                     "dataset": []})
    collator = namespace["collator"]
    assert namespace["micro_batches"].collate_fn is collator
    ids = torch.tensor([[151652, 151655, 151655, 151655, 151655, 151653, 11, 12, 13, 0],
                        [21, 22, 23, 24, 0, 0, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100),
             "pixel_values": torch.randn(16, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    micro_batch = collator.__class__(**{**collator.__dict__, "collate": None})(batch)
    assert isinstance(micro_batch, MicroBatch) and micro_batch.position_ids.shape == (3, 1, 16)
    assert micro_batch.checked_vocab_size == vocab


def test_register_adapter_example_registers_the_adapter():
    from torch import nn

    from megatron_vlm_packing.models.adapter import adapter_for, unregister_adapter

    class MyVLM(nn.Module):
        pass

    namespace = run(block_with("register_adapter(MyVLM"), {"MyVLM": MyVLM})
    try:
        adapter = adapter_for(MyVLM())
        assert type(adapter) is namespace["MyVLMAdapter"] and adapter.consumes == frozenset({"images"})
        assert adapter.needs.full_input_ids
    finally:
        unregister_adapter(MyVLM)


def test_planner_example_yields_micro_batches():
    from megatron_vlm_packing.planner import SampleMetadata

    metadata = [SampleMetadata(text_tokens=200 + 97 * i, image_grids=((1, 8, 8),) if i % 3 == 0 else ())
                for i in range(64)]
    namespace = run(block_with("PackedBatchSampler("), {
        "torch": torch, "metadata": metadata, "dp_size": 2, "dp_rank": 0, "dataset": list(range(64)),
        "collate_and_pack": lambda samples: samples})
    first = next(iter(namespace["loader"]))
    assert first and all(0 <= i < 64 for i in first)


def test_bridge_example_builds_the_state_form_step():
    from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason
    from megatron_vlm_packing.patches import undo_bridge_patches

    if bridge_unavailable_reason() is not None:
        pytest.skip(bridge_unavailable_reason())

    try:
        namespace = run(block_with("apply_bridge_patches()"), {})
    finally:
        undo_bridge_patches()
    assert callable(namespace["forward_step"])


def test_bridge_omni_example_builds_the_state_form_step():
    """The block for Bridge's Qwen3-Omni collate output runs as written (its arguments are the ones
    tests/bridge/test_bridge_omni_batches.py trains with)."""
    from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason

    if bridge_unavailable_reason() is not None:
        pytest.skip(bridge_unavailable_reason())
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    applied_before = patch.is_applied()
    try:
        namespace = run(block_with("apply_bridge_qwen3_omni_packed()", "qwen3_omni_collate_fn"), {})
    finally:
        if not applied_before:
            patch.undo_bridge_qwen3_omni_packed()
    assert callable(namespace["forward_step"])


def test_saving_a_collator_micro_batch_as_documented_gives_a_file_check_reads(tmp_path, monkeypatch, capsys):
    """A saved MicroBatch (the README once said to save own_storages(micro_batch)) is refused by `check`."""
    from megatron_vlm_packing.cli import main
    from megatron_vlm_packing.packing.collate import PackingCollator

    ids = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0]])
    mask = (ids != 0).long()
    micro_batch = PackingCollator(cp_size=2)({"input_ids": ids, "attention_mask": mask,
                                              "labels": torch.where(mask.bool(), ids, -100)})
    monkeypatch.chdir(tmp_path)
    run(block_with("own_storages(micro_batch)"), {"torch": torch, "micro_batch": micro_batch})
    assert main(["check", "batch.pt", "--cp", "2"]) == 0, capsys.readouterr()


def test_register_forward_step_example_trains_one_step(single_process_megatron):
    """The model-building example with tiny stand-ins for the user's towers, language model and Qwen2-VL
    config (its placeholder ids: 151655 image, 151656 video; the audio id 151646 is the example's)."""
    transformers = pytest.importorskip("transformers")
    from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples
    from megatron_vlm_packing.models.audio import TinyAudioTower
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.models.vision import TinyVisionTower
    from megatron_vlm_packing.patches import undo_all

    data = SyntheticVLMConfig(vocab_size=151700, image_token_id=151655, video_token_id=151656,
                              vision_start_id=151652, vision_end_id=151653, audio_token_id=151646,
                              audio_start_id=151647, audio_end_id=151648, max_text=8, max_images=1,
                              grid_choices=(2,), max_videos=1, max_audios=1)
    hf_config = transformers.Qwen2VLConfig(
        text_config={"rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}})
    torch.manual_seed(0)
    lm = TinyGPTConfig(vocab_size=data.vocab_size, position_embedding_type="mrope", mrope_section=(1, 1, 2))
    stand_ins = {
        "language_model": build_tiny_gpt(lm, scatter_embedding_sequence_parallel=False),
        "vision_tower": TinyVisionTower(patch_features=data.patch_features, width=16, out_hidden=lm.hidden_size,
                                        heads=2),
        "audio_tower": TinyAudioTower(mel_bins=data.mel_bins, width=16, out_hidden=lm.hidden_size,
                                      n_window=data.audio_n_window),
        "hf_config": hf_config,
        "micro_batches": [collate(synthetic_samples(3, seed=s, cfg=data)) for s in (1, 2)],
    }
    try:
        namespace = run(block_with("PackedVLM(language_model"), stand_ins)
    finally:
        undo_all()
    losses = namespace["losses"]
    assert len(losses) == 2 and all(float(report["lm loss"][1]) > 0 for report in losses), losses
