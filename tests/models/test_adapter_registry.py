"""The adapter registry: found by class through wrappers, overridable, refusing unconsumed inputs."""

import pytest
import torch
from torch import nn

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.models.adapter import (
    ModelAdapter, adapter_for, register_adapter, unregister_adapter, unwrap_model,
)


class ToyLM(nn.Module):
    def forward(self, input_ids):
        return input_ids


class ToyLMChild(ToyLM):
    pass


class Wrapper(nn.Module):  # the shape of DDP / Float16Module: the model sits at .module
    def __init__(self, module):
        super().__init__()
        self.module = module


class ToyAdapter(ModelAdapter):
    def forward(self, model, micro_batch):
        return model(micro_batch.input_ids)


class VisionAdapter(ToyAdapter):
    consumes = frozenset({"images"})


@pytest.fixture
def registered():
    register_adapter(ToyLM, ToyAdapter)
    yield
    unregister_adapter(ToyLM)


def test_found_through_wrappers_and_for_subclasses(registered):
    model = Wrapper(Wrapper(ToyLMChild()))
    assert isinstance(unwrap_model(model), ToyLMChild)
    adapter = adapter_for(model)
    assert isinstance(adapter, ToyAdapter) and adapter.model_name == "ToyLMChild"


def test_unknown_model_names_itself_and_how_to_register():
    with pytest.raises(ValueError, match=r"no model adapter for .*ToyLM; .*register_adapter"):
        adapter_for(ToyLM())


def test_registration_by_qualified_name_overrides(registered):
    register_adapter(f"{ToyLMChild.__module__}.ToyLMChild", VisionAdapter)
    try:
        assert isinstance(adapter_for(ToyLMChild()), VisionAdapter)
        assert type(adapter_for(ToyLM())) is ToyAdapter
    finally:
        unregister_adapter(f"{ToyLMChild.__module__}.ToyLMChild")


def text_batch():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return {"input_ids": ids, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}


def test_check_refuses_inputs_the_adapter_does_not_consume(registered):
    from dataclasses import replace

    from megatron_vlm_packing.packing.micro_batch import VisionInputs

    mb = pack_batch(text_batch(), label_style="hf")
    adapter = adapter_for(ToyLM())
    adapter.check(mb)  # text only: fine
    with_images = replace(mb, vision=VisionInputs(pixel_values=torch.zeros(4, 3),
                                                  image_grid_thw=torch.tensor([[1, 2, 2]])))
    with pytest.raises(ValueError, match=r"carries \['images'\] but ToyLM's adapter \(ToyAdapter\) consumes only"):
        adapter.check(with_images)
    VisionAdapter(ToyLM()).check(with_images)


def test_check_refuses_packing_for_a_model_without_packed_seq_params():
    class DenseOnly(ToyAdapter):
        takes_packed_seq_params = False

    with pytest.raises(ValueError, match="cannot take packed_seq_params"):
        DenseOnly(ToyLM()).check(pack_batch(text_batch(), label_style="hf"))


def test_factory_must_be_callable():
    with pytest.raises(ValueError, match="must be callable"):
        register_adapter(ToyLM, 3)


def test_model_type_must_be_a_class_or_a_name():
    # A model instance (or None) was an AttributeError on __qualname__ / __module__.
    for bad in (ToyLM(), None, 3):
        with pytest.raises(ValueError, match="model_type must be a model class or its qualified name"):
            register_adapter(bad, ToyAdapter)


def test_a_class_that_is_no_adapter_and_names_that_match_no_class_are_refused():
    # int / dict were registered and adapter_for(model) was a TypeError ("int() argument must be ...")
    for bad in (int, dict, ToyLM):
        with pytest.raises(ValueError, match=rf"factory for .*ToyLM is the class {bad.__qualname__}, not a ModelAdapter"):
            register_adapter(ToyLM, bad)
    # "" or a bare class name never matched a model: adapter_for fell back silently to another adapter
    for bad in ("", "  ", "ToyLM", "a.b c"):
        with pytest.raises(ValueError, match=r"model_type must be a model class or its qualified name"):
            register_adapter(bad, ToyAdapter)
    for bad in (ToyLM(), None, 3):  # unregister_adapter: an AttributeError on __qualname__ / __module__
        with pytest.raises(ValueError, match=r"model_type must be a model class or its qualified name"):
            unregister_adapter(bad)


def test_a_factory_returning_no_adapter_is_named_by_adapter_for():
    """A callable factory returning a non-adapter was handed back by adapter_for (1 as 'the adapter')."""
    register_adapter(ToyLM, lambda model: 1)
    try:
        with pytest.raises(ValueError, match=r"the adapter factory for .*ToyLM returned int 1, not a ModelAdapter"):
            adapter_for(Wrapper(ToyLM()))
    finally:
        unregister_adapter(ToyLM)
