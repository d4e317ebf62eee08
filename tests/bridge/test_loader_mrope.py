"""A Bridge adapter's own `MRopeConfig` (`qwen25_vl_mrope(model)`, read from the model's config) is what the
step compares a loader micro-batch's recorded config with (`models.adapter.check_loader_mrope`): a collator
built with another tokens_per_second made other video time positions and is refused before the model runs."""

import dataclasses
import types

import pytest
import torch


def _qwen25_vl(tokens_per_second: float):
    """Bridge's Qwen25VLModel class with only the config its adapter reads (no weights are needed to refuse)."""
    from megatron_vlm_packing.bridge.imports import import_bridge_module
    from megatron_vlm_packing.patches.bridge_qwen25_vl_cp import QWEN25_VL_MODEL

    model = torch.nn.Module.__new__(import_bridge_module(QWEN25_VL_MODEL).Qwen25VLModel)
    torch.nn.Module.__init__(model)
    vision = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=tokens_per_second)
    model.config = types.SimpleNamespace(vision_config=vision, image_token_id=151655, video_token_id=151656,
                                         vision_start_token_id=151652, mrope_section=[16, 24, 24],
                                         tensor_model_parallel_size=1, context_parallel_size=1, sequence_parallel=False)
    return model


@pytest.mark.bridge
def test_a_collator_built_with_another_config_than_the_bridge_models_is_refused():
    from megatron_vlm_packing.bridge.adapters import Qwen25VLAdapter
    from megatron_vlm_packing.packing.collate import PackingCollator
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.train.build import StepOptions, micro_batch_for_model

    adapter = Qwen25VLAdapter(_qwen25_vl(2))
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    batch = {"input_ids": ids, "labels": ids, "attention_mask": (ids > 0).long()}
    options, layout, cpu = StepOptions(label_style="hf"), ParallelLayout(), torch.device("cpu")
    made_with = dataclasses.replace(adapter.mrope, tokens_per_second=1.0)
    with pytest.raises(ValueError, match=r"\(Qwen25VLModel's own, Qwen25VLAdapter.mrope\): tokens_per_second=1.0 "
                                         r"where the model's is 2"):
        micro_batch_for_model(PackingCollator(label_style="hf", mrope=made_with)(batch), adapter, layout, options, cpu)
    built = micro_batch_for_model(PackingCollator(label_style="hf", mrope=adapter.mrope)(batch), adapter, layout,
                                  options, cpu)
    assert built.micro_batch.mrope_config == adapter.mrope
