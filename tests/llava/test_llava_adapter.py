"""LLaVAAdapter's guard: a packed micro-batch is refused while LLaVAModel would hand attention the
collapsed boundaries (the boundary patch not applied); dense rows need no patch."""

import pytest
import torch

from megatron_vlm_packing.models.llava import LLaVAAdapter, LlavaSpace
from megatron_vlm_packing.models.llava_pack import pack_llava_batch, pad_llava_batch
from megatron_vlm_packing.patches import llava_boundaries

IMG = 127


class _Recorder:
    """Stands in for the model: records the call (the adapter's refusal comes before it)."""

    def __call__(self, *args, **kwargs):
        self.kwargs = kwargs
        return torch.zeros(1), None


def test_packed_needs_the_boundary_patch_dense_does_not():
    ids = torch.tensor([[5, 6, 7], [IMG, 8, 9]])
    batch = {"input_ids": ids, "labels": ids + 1, "images": torch.zeros(1, 3, 2, 2)}
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG)
    adapter = LLaVAAdapter.__new__(LLaVAAdapter)  # the forward reads only the space (no model needed)
    adapter.model_name, adapter.space = "LLaVAModel", space
    packed, dense, model = pack_llava_batch(batch, space), pad_llava_batch(batch, space), _Recorder()
    was_active = llava_boundaries.packed_boundaries_expanded()
    llava_boundaries.undo_llava_packed_boundaries()
    try:
        if not llava_boundaries.upstream_remaps_packed_boundaries():
            with pytest.raises(ValueError, match="call megatron_vlm_packing.patches.apply_llava_packed_boundaries"):
                adapter.forward(model, packed)
        adapter.forward(model, dense)
        assert model.kwargs["packed_seq_params"] is None
        llava_boundaries.apply_llava_packed_boundaries()
        adapter.forward(model, packed)
        assert model.kwargs["packed_seq_params"].llava_plan is packed.plan  # the patch expands from it
    finally:
        if not was_active:
            llava_boundaries.undo_llava_packed_boundaries()
