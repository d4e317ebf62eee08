"""LLaVAModel's forward takes no padding_mask (megatron-core 0.16.1 and 0.19.2), so an MoE language model would
route a pack's pad slots (one before each image-opening document, the layout's alignment) and count them in its
load-balancing loss, z-loss, capacity or expert bias, silently. The adapter refuses such a micro-batch, naming the
settings; a router that counts nothing, a dense model, or a micro-batch without pad slots runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_vlm_packing.models.llava import router_pad_counters
from megatron_vlm_packing.testing.llava_reference import IMG, T, build_tiny_llava, collated
from megatron_vlm_packing.testing.step_models import step_loss


def _moe(**fields):
    return SimpleNamespace(num_moe_experts=4, **fields)


@pytest.mark.parametrize("config, found", [
    (SimpleNamespace(num_moe_experts=None, moe_aux_loss_coeff=1.0), ()),  # dense
    (None, ()),
    (_moe(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0), ()),
    (_moe(moe_router_load_balancing_type="none", moe_aux_loss_coeff=1.0), ()),
    (_moe(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01),
     ("moe_router_load_balancing_type='aux_loss' with moe_aux_loss_coeff=0.01",)),
    (_moe(moe_router_load_balancing_type=["seq_aux_loss", "global_aux_loss"], moe_aux_loss_coeff=[0.0, 0.1]),
     ("moe_router_load_balancing_type='global_aux_loss' with moe_aux_loss_coeff=0.1",)),
    (_moe(moe_router_load_balancing_type="sinkhorn"), ("moe_router_load_balancing_type='sinkhorn'",)),
    (_moe(moe_router_load_balancing_type="none", moe_z_loss_coeff=1e-3, moe_expert_capacity_factor=1.0,
          moe_router_enable_expert_bias=True),
     ("moe_z_loss_coeff=0.001", "moe_expert_capacity_factor=1.0", "moe_router_enable_expert_bias=True")),
])
def test_router_pad_counters_name_every_setting_that_counts_tokens(config, found):
    assert router_pad_counters(config) == found


@pytest.fixture
def moe_llava(single_process_megatron):
    """The tiny LLaVA whose language config says MoE with an aux loss: the adapter refuses before any forward,
    so the dense layers never run as experts."""
    from megatron_vlm_packing.patches import apply_llava_packed_boundaries, undo_llava_packed_boundaries

    apply_llava_packed_boundaries()
    model = build_tiny_llava(0)
    config = model.language_model.config
    saved = {name: getattr(config, name) for name in ("num_moe_experts", "moe_router_load_balancing_type",
                                                      "moe_aux_loss_coeff")}
    yield model, config
    for name, value in saved.items():
        setattr(config, name, value)
    undo_llava_packed_boundaries()


def test_the_step_refuses_routed_pads_and_runs_without_them(moe_llava):
    model, config = moe_llava
    batch = collated(((T, T, T), (IMG, IMG, T, T), (T, IMG, T, T, IMG)), label_style="hf", seed=4)
    config.num_moe_experts, config.moe_router_load_balancing_type, config.moe_aux_loss_coeff = 4, "aux_loss", 0.01
    with pytest.raises(ValueError, match=r"takes no padding_mask, so its MoE router would route the micro-batch's "
                                         r"\d+ pad slots and count them \(moe_router_load_balancing_type='aux_loss' "
                                         r"with moe_aux_loss_coeff=0.01\)"):
        step_loss(model, batch, pack=True)
    config.moe_aux_loss_coeff = 0.0  # a router that counts nothing: the pads change nothing
    config.num_moe_experts = None  # (the tiny model's layers are dense: run it as it is built)
    assert step_loss(model, batch, pack=True) is not None
