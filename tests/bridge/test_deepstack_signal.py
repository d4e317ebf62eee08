"""Every deepstack level of the tiny Bridge Qwen3-VL (dense, MoE) and Qwen3-Omni thinker reaches a trained token.

Bridge adds deepstack level k to the hidden states of the vision placeholders after language layer k, and nowhere
else: only the layers after it carry it to a token with a loss (placeholders have none). With the tiny models' 2
language layers and 2 levels (`TinyModelConfig.deepstack_visual_indexes = (0, 1)`), the last level was added after
the last layer: zeroing it moved no loss (exactly 0) and its merger's 6 parameters had exact gradient 0 in the
packed run and in the reference alike, so the parity suites compared 0 with 0 there and a pack that routed that
level to the wrong tokens (or dropped it) passed every check. The real models put levels in layers 0..2 of 28-36.
`TinyModelConfig.num_layers` is now 3: a layer follows every level. Measured on 4 samples (Omni: 5) through the
shipped step, packed, TP=1, the largest per-token loss change with level 0 / level 1 zeroed (and the largest
gradient of its merger): Qwen3-VL 0.13 / 0.041 (7.5 / 2.2), Qwen3-VL MoE 0.086 / 0.088 (7.0 / 4.1), Omni thinker
0.23 / 0.12 (5.7 / 2.6); at 2 layers level 1 moved 0 and its merger's gradient was 0 in all three.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.bridge

SEED = 3
FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni")


def _cfg(family: str, **fields):
    if family == "qwen3_omni":
        from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig

        return TinyOmniConfig(**fields)
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig

    return TinyBridgeConfig(family=family, **fields)


def deepstack_mergers(model) -> torch.nn.ModuleList:
    """The vision tower's per-level deepstack mergers (Qwen3-VL's `deepstack_merger_list`, Omni's `merger_list`)."""
    if hasattr(model, "thinker"):
        return model.thinker.visual.merger_list
    return model.vision_model.decoder.deepstack_merger_list


def _packed_losses(model, batch) -> tuple[torch.Tensor, dict]:
    """Per-token losses (tokens with a loss) of `batch` packed through the shipped step, and every gradient."""
    from megatron_vlm_packing import make_forward_step

    model.zero_grad(set_to_none=True)
    output, loss = make_forward_step(pack=True, label_style="hf")(iter([batch]), model)
    mask = loss.args[0].bool()
    output[mask].sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return output.detach()[mask], grads


def _level_zeroed(model, batch, level: int) -> torch.Tensor:
    merger = deepstack_mergers(model)[level]
    handle = merger.register_forward_hook(lambda module, args, out: torch.zeros_like(out))
    try:
        return _packed_losses(model, batch)[0]
    finally:
        handle.remove()


@pytest.fixture(scope="module")
def measured(single_process_megatron):
    """{(family, num_layers): (per-level max |dloss| with that level zeroed, max |grad| of each level's merger)}."""
    from megatron_vlm_packing.bridge.truth import build_family, collate_for, family_samples
    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import (
        apply_bridge_qwen3_omni_packed, undo_bridge_qwen3_omni_packed)

    apply_bridge_patches()
    apply_bridge_qwen3_omni_packed()
    out = {}
    try:
        for family in FAMILIES:
            for layers in (None, 2):
                cfg = _cfg(family) if layers is None else _cfg(family, num_layers=layers)
                model = build_family(family, cfg, seed=SEED)
                batch = collate_for(family, family_samples(family, cfg, 5 if family == "qwen3_omni" else 4, seed=SEED))
                clean, grads = _packed_losses(model, batch)
                levels = len(cfg.deepstack_visual_indexes)
                moved = [(_level_zeroed(model, batch, k) - clean).abs().max().item() for k in range(levels)]
                prefix = {n for n, _ in model.named_parameters()}
                merger_grads = []
                for k in range(levels):
                    names = [n for n in prefix if f"merger_list.{k}." in n]
                    merger_grads.append(max(grads[n].abs().max().item() if n in grads else 0.0 for n in names))
                out[(family, layers or cfg.num_layers)] = (moved, merger_grads)
    finally:
        undo_bridge_qwen3_omni_packed()
        undo_bridge_patches()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_deepstack_level_moves_the_losses_and_gets_a_gradient(measured, family):
    from megatron_vlm_packing.bridge.tiny import TinyModelConfig

    assert TinyModelConfig().num_layers > len(TinyModelConfig().deepstack_visual_indexes)
    moved, merger_grads = measured[(family, TinyModelConfig().num_layers)]
    assert min(moved) > 1e-2, moved  # the suites' loss bounds are <= 1e-4 per token
    assert min(merger_grads) > 1e-4, merger_grads


@pytest.mark.parametrize("family", FAMILIES)
def test_with_two_layers_the_last_level_reached_nothing(measured, family):
    """The cause, kept visible: the last level added after the last layer moves no loss, its merger gets exactly 0."""
    moved, merger_grads = measured[(family, 2)]
    assert moved[0] > 1e-2 and moved[-1] == 0.0, moved
    assert merger_grads[-1] == 0.0, merger_grads
