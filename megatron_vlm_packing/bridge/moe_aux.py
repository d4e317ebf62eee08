"""Bridge's MoE models under packing (Qwen3-VL MoE, an MoE Qwen3-Omni thinker): the router's load-balancing
loss must not count pad slots.

`run_bridge_moe_aux_loss(rank, world_size, cases)` is a `run_distributed` target. For each (family, tp, cp, sp)
it builds the tiny model as Bridge's provider does, with the router's aux loss on, and records
the aux loss Megatron-Core attaches for the same real tokens (images and videos included) packed through the
shipped step three ways: with only the layout's alignment pads, padded to a fixed length (`pad_to`, many pad
slots), and as dense right-padded rows (`pack=False`). With `patches.apply_bridge_patches()` they agree; the
adapter's refusal without the pads patch is
recorded too.
"""

from __future__ import annotations

import torch

PAD_TO = 256  # the tiny batches hold 83 (Qwen3-VL) and 53 (Omni) real tokens
SEED = 3


def _with_aux_loss(provider):
    """The provider's MoE router with its load-balancing loss on (the parity suites run it off)."""
    provider.moe_aux_loss_coeff = 1.0
    provider.moe_router_load_balancing_type = "aux_loss"
    return provider


def _moe_model_and_batch(family: str, tp: int, cp: int, sp: bool):
    """(model, collated batch, mrope config) of the tiny Qwen3-VL MoE or an MoE Qwen3-Omni thinker."""
    from megatron_vlm_packing.bridge.build import build_with_provider
    from megatron_vlm_packing.bridge.tiny import packed_core_attention

    layout = dict(tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    if family == "qwen3_vl_moe":
        from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
        from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, qwen3_vl_te_free_swaps, tiny_bridge_provider

        cfg = TinyBridgeConfig(family=family, **layout)
        provider = tiny_bridge_provider(cfg)
        swaps = qwen3_vl_te_free_swaps(packed_core_attention(cfg.attention_backend))
        batch = collate_qwen_vl(qwen_vl_samples(cfg, 4, seed=SEED))
    else:
        from megatron_vlm_packing.bridge.build_omni import (TinyOmniConfig, collate_omni, omni_samples,
                                                            omni_te_free_swaps, tiny_omni_provider)

        cfg = TinyOmniConfig(**layout)
        provider, swaps = tiny_omni_provider(cfg), omni_te_free_swaps(packed_core_attention(cfg.attention_backend))
        provider.num_moe_experts, provider.moe_router_topk = 4, 2  # the tiny thinker is dense otherwise
        provider.moe_ffn_hidden_size, provider.moe_token_dispatcher_type = provider.ffn_hidden_size, "allgather"
        samples = omni_samples(cfg, 4, seed=SEED)
        batch = collate_omni([samples[0], samples[3]])  # one clip in every row, as Bridge's dense audio path takes
    model = build_with_provider(_with_aux_loss(provider), swaps=swaps, seed=SEED).train()
    if family == "qwen3_omni":
        from megatron_vlm_packing.bridge.omni_dense_audio import dense_audio_shim

        dense_audio_shim(model.thinker.audio_model)  # Bridge's dense audio path cuts clips by the encoder's count
    return model, batch, cfg.mrope_config()


def _aux_loss(model, batch: dict, mrope, *, pad_to: int | None, cp: int, pack: bool = True) -> float:
    """The router's aux losses of one micro-batch (forward + backward) summed over the TP x CP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.testing.moe_parity import recorded_aux_losses

    step = make_forward_step(pack=pack, label_style="hf", pad_to=pad_to, with_state=cp > 1, mrope=mrope)
    with recorded_aux_losses() as values:
        args = (None, iter([dict(batch)]), model) if cp > 1 else (iter([dict(batch)]), model)
        output, loss_func = step(*args)
        loss_func(output)[0].backward()
    aux = torch.stack([v.sum() for v in values]).sum().reshape(1)
    dist.all_reduce(aux, group=ps.get_tensor_and_context_parallel_group())
    return float(aux)


def run_bridge_moe_aux_loss(rank: int, world_size: int, cases: list[tuple[str, int, int, bool]]) -> list[dict]:
    """Per (family, tp, cp, sp): the aux loss packed with alignment pads only ("aligned"), padded to `PAD_TO`
    ("padded"), as dense rows ("dense", Qwen3-VL: Bridge's dense Omni audio path needs a shim; "dense_refused" where
    the adapter refuses them: Omni's clips read each other under transformers 5.8, "clips_read_each_other"), and the
    adapter's refusal of a padded micro-batch with the pads patch undone."""
    from megatron_vlm_packing.patches import (apply_bridge_patches, apply_bridge_qwen3_omni_packed,
                                              undo_bridge_patches, undo_bridge_qwen3_omni_packed)
    from megatron_vlm_packing.patches.bridge_qwen3_vl_moe_pads import undo_bridge_qwen3_vl_moe_pads
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    results = []
    for family, tp, cp, sp in cases:
        initialize_parallel(tp=tp, cp=cp, seed=SEED)
        model, batch, mrope = _moe_model_and_batch(family, tp, cp, sp)
        result = dict(case=(family, tp, cp, sp), real=int(batch["attention_mask"].sum()))
        if family == "qwen3_omni":
            from megatron_vlm_packing.bridge.audio_windows import encoder_keeps_clips_apart

            result["clips_read_each_other"] = not encoder_keeps_clips_apart(model.thinker.audio_model)
        undo_bridge_patches()
        apply_bridge_patches()
        apply_bridge_qwen3_omni_packed()
        try:
            result["aligned"] = _aux_loss(model, batch, mrope, pad_to=None, cp=cp)
            result["padded"] = _aux_loss(model, batch, mrope, pad_to=PAD_TO, cp=cp)
            try:
                result["dense"] = _aux_loss(model, batch, mrope, pad_to=None, cp=cp, pack=False)  # right-padded rows
            except ValueError as err:  # Omni's 2 clips, where the encoder lets them read each other (transformers 5.8)
                result["dense_refused"] = str(err)
            undo_bridge_qwen3_vl_moe_pads()
            try:
                _aux_loss(model, batch, mrope, pad_to=PAD_TO, cp=cp)
                result["refused_without_patch"] = None
            except ValueError as err:
                result["refused_without_patch"] = str(err)
        finally:
            undo_bridge_qwen3_omni_packed()
            undo_bridge_patches()
        results.append(result)
    return results
