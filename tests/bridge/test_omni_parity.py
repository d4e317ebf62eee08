"""Megatron-Bridge's Qwen3-Omni thinker trained packed (images + videos + audio in one pack) vs each
sample alone, at TP=1, TP2+SP, CP2, TP2xCP2xSP, in one 4-process launch.

The truth is Bridge's own unpatched dense path on one sample at a time (TP=CP=1, batch 1, unpadded,
positions from `rope.get_rope_index`, identical to transformers'). The packed runs go through the
shipped step (`make_forward_step` -> `pack_batch` -> adapter check -> `localize` -> adapter forward ->
`loss_func`) under Megatron's `get_forward_backward_func`, with the patch applied; per-token losses,
the loss sum and every parameter gradient are compared, the vision and audio encoders included
(each TP rank's own copy).
The same launch checks bug class 5 at CP=2: a dense call after a packed one gives bit-identical
output to the dense call before it, and the check bites (a leaked `is_thd_format` changes it).
The audio comparisons bite too: at TP=1 the same pack with every clip another sample's
(`testing.probe_controls.foreign_media("audio")`) must move the losses and the audio encoder's gradients far
past the bounds, and every audio gradient but the attention key bias's (exactly 0) must stand at >= 10x the
1e-6 floor of the relative error (the smallest, a query bias's, 8.7e-5). With transformers' own draw of the
tiny audio encoder the losses hardly read a clip (the foreign clips moved them by 5.7e-6:
tests/bridge/test_omni_audio_signal.py); `build_tiny_omni` redraws its downsampling layers at He scale.
So must the same pack with every audio placeholder one position late in its own sample
(`testing.probe_controls.shifted_positions`: an index miscounting the clips).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.bridge

LAYOUTS = ((1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True))  # (tp, cp, sp)
SEED = 3
NUM_SAMPLES = 5
GRAD_FLOOR = 1e-6  # of the relative gradient error's denominator
ZERO_GRAD_AUDIO = ("self_attn.k_proj.bias",)  # exact gradient 0: softmax ignores a per-query constant


def _cfg(tp=1, cp=1, sp=False):
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig

    return TinyOmniConfig(tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)


def _samples():
    from megatron_vlm_packing.bridge.build_omni import omni_samples

    return omni_samples(_cfg(), NUM_SAMPLES, seed=SEED)


def reference(samples):
    """Bridge's dense path, one sample at a time: per-token losses at targets, grads, weights.

    The samples are shared out over the launch's ranks (each a TP=CP=1 replica with the same weights)
    and the per-sample gradients summed, so the truth costs one process's share, not all of it."""
    from megatron_vlm_packing.bridge.truth import alone_losses, build_family
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    initialize_parallel(seed=SEED)
    cfg = _cfg()
    model = build_family("qwen3_omni", cfg, seed=SEED)  # with bridge.truth.dense_audio_shim
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = {}
    for i in range(rank, len(samples), world):
        out = alone_losses(model, "qwen3_omni", samples[i], cfg)  # Bridge's dense path, [targets]
        losses[i] = out.detach()
        out.sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        grads[name] = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grads[name])  # sum over the samples of every rank
    every = [None] * world
    dist.all_gather_object(every, losses)
    merged = {i: loss for part in every for i, loss in part.items()}
    return torch.cat([merged[i] for i in range(len(samples))]), grads, state


def micro_batch(batch, cfg):
    """The packed `MicroBatch` of a collated Omni batch (the shipped `pack_batch`), aligned for cfg."""
    from megatron_vlm_packing import pack_batch

    return pack_batch(batch, tp_size=cfg.tensor_parallel, cp_size=cfg.context_parallel,
                      sequence_parallel=cfg.sequence_parallel, label_style="hf", mrope=cfg.mrope_config())


def run_packed(model, mb, layout):
    """adapter_for -> check -> localize -> forward; returns (local per-token loss, local mb)."""
    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.packing.localize import localize

    adapter = adapter_for(model)
    adapter.check(mb)
    local = localize(mb, layout, adapter.needs)
    return adapter.forward(model, local), local


def train_step(model, batch, transform=None):
    """One micro-batch through the shipped step and Megatron's schedule (forward + backward); `transform` as
    `make_forward_step` takes it (a control's wrong pack).

    Returns (report [loss_sum, tokens], per-token losses [1, Tl], the localized micro-batch)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.bridge.omni_adapter import Qwen3OmniAdapter

    class Recording(Qwen3OmniAdapter):  # the registry's adapter, keeping what the model returned
        seen = []

        def forward(self, model, micro_batch):
            out = super().forward(model, micro_batch)
            self.seen.append((out.detach(), micro_batch))
            return out

    adapter = Recording(model)
    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(pack=True, label_style="hf", adapter=adapter, transform=transform),
        data_iterator=iter([batch]), model=[model], num_microbatches=1, seq_length=0, micro_batch_size=1,
        forward_only=False)
    out, local = adapter.seen[0]
    return reports[0]["lm loss"], out, local


def grad_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, GRAD_FLOOR): relative, with a floor for grads that are exactly zero in
    exact arithmetic (e.g. attention key biases) and rounding noise here."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(GRAD_FLOOR)).item()


def audio_grads_near_floor(ref_grads) -> list[str]:
    """Audio encoder parameters (but those exactly 0) whose reference gradient is within 10x the floor: their
    relative error would be judged against the floor, not their own scale (the smallest: q_proj.bias, 8.7e-5)."""
    return [n for n, g in ref_grads.items() if ".audio_model." in n and not n.endswith(ZERO_GRAD_AUDIO)
            and g.abs().max() < 10 * GRAD_FLOOR]


def audio_control(model, samples, ref, transform) -> dict:
    """TP=1: the same pack made wrong by `transform` (a `testing.probe_controls` one), through the same step: worst
    |dloss| per token and the audio encoder's worst relative gradient error vs each sample alone (`model` fresh,
    no grads yet)."""
    from megatron_vlm_packing.bridge.build_omni import collate_omni
    from megatron_vlm_packing.testing.parity import full_gradients

    ref_losses, ref_grads, _ = ref
    _, out, local = train_step(model, collate_omni(samples), transform=transform)
    grads = full_gradients(model)
    audio = [grad_error(g, ref_grads[n]) for n, g in grads.items() if ".audio_model." in n]
    return dict(max_dloss=(out[local.loss_mask.bool()] - ref_losses).abs().max().item(), audio_grad_err=max(audio),
                audio_params_off=sum(e > 1e-2 for e in audio))


def audio_controls(cfg, state, samples, ref) -> dict:
    """TP=1, each on a fresh model: every clip another sample's (`foreign_media("audio")`), and every audio
    placeholder's positions one step later (`shifted_positions`: an index miscounting the clips)."""
    from megatron_vlm_packing.bridge.build_omni import build_tiny_omni
    from megatron_vlm_packing.testing.parity import load_full_state
    from megatron_vlm_packing.testing.probe_controls import foreign_media, shifted_positions

    controls = {"foreign_audio": foreign_media("audio"),
                "shifted_audio_positions": shifted_positions(cfg.token_ids["audio_token_id"])}
    out = {}
    for name, transform in controls.items():
        fresh = build_tiny_omni(cfg, seed=SEED)
        load_full_state(fresh, state, tp_rank=0, tp_size=1)
        out[name] = audio_control(fresh, samples, ref, transform)
    return out


def packed_case(samples, ref, tp, cp, sp):
    """Worst |dloss| per token and relative grad error of one layout vs the reference."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.bridge.build_omni import build_tiny_omni, collate_omni
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.parity import (
        full_gradients, gather_cp_tokens, load_full_state,
    )

    ref_losses, ref_grads, state = ref
    initialize_parallel(tp=tp, cp=cp, seed=SEED)
    cfg = _cfg(tp, cp, sp)
    model = build_tiny_omni(cfg, seed=SEED)
    load_full_state(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    layout = ParallelLayout(tp_size=tp, cp_size=cp, cp_rank=ps.get_context_parallel_rank(), sequence_parallel=sp)
    control = {}
    if tp == 1 and cp == 1:
        refusal_checks(model, micro_batch(collate_omni(samples), cfg), samples)
        control = audio_controls(cfg, state, samples, ref)
    report, out, local = train_step(model, collate_omni(samples))
    cp_group = ps.get_context_parallel_group()
    cu_padded = local.packed_seq_params.cu_seqlens_q_padded
    full = gather_cp_tokens(torch.stack([out, local.loss_mask], -1), cu_padded, cp_group)  # [1, T, 2]
    packed_losses = full[..., 0][full[..., 1].bool()]
    dist.all_reduce(report, group=cp_group)
    mb = micro_batch(collate_omni(samples), cfg)
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(), cp_group=cp_group)
    grad_err = max(grad_error(g, ref_grads[n]) for n, g in grads.items())
    nonzero_grad_err = max(grad_error(g, ref_grads[n]) for n, g in grads.items() if not n.endswith(ZERO_GRAD_AUDIO))
    towers = {k: sum(1 for n in grads if f".{k}." in n and grads[n].abs().sum() > 0) for k in ("visual", "audio_model")}
    dloss_sum = abs(report[0].item() - ref_losses.sum().item())
    assert int(report[1]) == ref_losses.numel(), (report, ref_losses.numel())
    worst = torch.tensor([(packed_losses - ref_losses).abs().max().item(), grad_err, dloss_sum, nonzero_grad_err])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if cp > 1 and tp > 1:
        rotary_state_check(model, samples, cfg, layout, mb)
    return dict(layout=f"tp={tp} cp={cp} sp={sp}", max_dloss=worst[0].item(), max_rel_grad_err=worst[1].item(),
                dloss_sum=worst[2].item(), max_rel_grad_err_but_zero_grads=worst[3].item(),
                tokens=int(packed_losses.numel()), ref_tokens=int(ref_losses.numel()), vision_params=towers["visual"],
                audio_params=towers["audio_model"], physical=mb.stats.physical_tokens, real=mb.stats.real_tokens,
                audio_grads_near_floor=audio_grads_near_floor(ref_grads), controls=control)


def dense_micro_batch(samples, cfg):
    """Right-padded dense rows (the shipped `pad_batch`), aligned for cfg's layout; rows a multiple of
    2 * cp * tp long, which Bridge's dense deepstack split asserts."""
    from megatron_vlm_packing import pad_batch
    from megatron_vlm_packing.bridge.build_omni import collate_omni

    batch = collate_omni(samples)
    multiple = 2 * cfg.context_parallel * cfg.tensor_parallel
    row = -(-batch["input_ids"].shape[1] // multiple) * multiple
    return pad_batch(batch, tp_size=cfg.tensor_parallel, cp_size=cfg.context_parallel,
                     sequence_parallel=cfg.sequence_parallel, seq_length=row, label_style="hf", mrope=cfg.mrope_config())


def _raises(fn, *words):
    try:
        fn()
    except ValueError as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"ValueError without {missing}: {err}"
        return
    raise AssertionError(f"no ValueError (expected one naming {words})")


def refusal_checks(model, mb, samples):
    """Bad input and a missing patch are ValueErrors naming what is wrong (no collectives here)."""
    from dataclasses import replace

    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    patch.undo_bridge_qwen3_omni_packed()
    try:
        _raises(lambda: adapter_for(model).check(mb), "apply_bridge_qwen3_omni_packed")
    finally:
        assert patch.apply_bridge_qwen3_omni_packed()
    adapter = adapter_for(model)
    assert adapter.mrope == _cfg().mrope_config(), adapter.mrope
    _raises(lambda: adapter.check(replace(mb, position_ids=mb.position_ids[0])), "[3, 1, T]")
    ids = mb.input_ids.clone()
    first_image = int(torch.nonzero(ids[0] == model.thinker.image_token_id)[0])
    ids[0, first_image] = 1  # one image placeholder fewer than the encoder's features
    _raises(lambda: adapter.forward(model, replace(mb, input_ids=ids)), "image placeholder", "produced")
    _raises(lambda: model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                          packed_seq_params=mb.packed_seq_params, labels=mb.labels, pixel_value=1), "pixel_value")
    _raises(lambda: model(input_ids=mb.input_ids, position_ids=None, packed_seq_params=mb.packed_seq_params),
            "position_ids")
    _raises(lambda: adapter.check(dense_micro_batch(samples[:1], _cfg())), "_get_feat_extract_output_lengths")


def rotary_state_check(model, samples, cfg, layout, packed_mb):
    """Bug class 5: a dense call after a packed one equals the dense call before it, bit for bit."""
    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.packing.localize import localize

    adapter = adapter_for(model)
    dense = localize(dense_micro_batch([samples[1]], cfg), layout, adapter.needs)
    rotary = model.thinker.language_model.rotary_pos_emb
    with torch.no_grad():
        before = adapter.forward(model, dense)
        run_packed(model, packed_mb, layout)
        flag_after_packed = rotary.is_thd_format
        after = adapter.forward(model, dense)
        rotary.is_thd_format = True  # a flag leaked by someone else: the patched dense call sets its own
        try:
            after_leak = adapter.forward(model, dense)
            bites = _leak_changes_bridge_dense(model, dense, before)
        finally:
            rotary.is_thd_format = False
    assert not flag_after_packed, "is_thd_format leaked out of the packed call"
    assert torch.equal(before, after), f"dense output changed after a packed call: {(before - after).abs().max()}"
    assert torch.equal(before, after_leak), "a leaked is_thd_format changed the patched dense call"
    assert bites, "a leaked is_thd_format did not change Bridge's own dense CP output: the check cannot fail"


def _leak_changes_bridge_dense(model, dense, before) -> bool:
    """Bridge's original forward (no per-call flag) with the leaked flag: output differs, or it fails."""
    from megatron_vlm_packing.bridge.omni_adapter import media_kwargs
    from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import _OWNED

    try:
        out = _OWNED.original("forward")(model.thinker, input_ids=dense.input_ids,
                                         position_ids=dense.position_ids, labels=dense.labels,
                                         loss_mask=dense.loss_mask, **media_kwargs(dense))
    except (RuntimeError, ValueError):
        return True
    return not torch.equal(out, before)


def omni_parity(rank: int, world_size: int, layouts):
    """`run_distributed` target: every layout, then the bug class 5 check at the last CP layout."""
    from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import apply_bridge_qwen3_omni_packed

    assert apply_bridge_qwen3_omni_packed()
    samples = _samples()
    ref = reference(samples)
    return [packed_case(samples, ref, *layout) for layout in layouts]


def test_packed_omni_matches_each_sample_alone():
    from megatron_vlm_packing.testing.distributed import run_distributed

    results = run_distributed(omni_parity, 4, LAYOUTS, timeout_s=900)
    for r in results:
        print(r)
    for r in results:
        assert r["tokens"] == r["ref_tokens"], r
        assert r["max_dloss"] < 1e-5 and r["dloss_sum"] < 1e-3, r  # a sum of ~300 in fp32
        assert r["max_rel_grad_err"] < 1e-4, r
        assert r["vision_params"] > 10 and r["audio_params"] > 10, r
        assert r["audio_grads_near_floor"] == [], r  # the relative error reads them, not the floor
    control = results[0]["controls"]["foreign_audio"]  # TP=1: another sample's clips must show in losses and grads
    assert control["max_dloss"] > 1e-2 and control["audio_grad_err"] > 1e-1, control  # measured 0.19, 2.25
    assert control["audio_params_off"] > 20, control  # measured 28 of 29 (at transformers' draw: 6)
    shifted = results[0]["controls"]["shifted_audio_positions"]  # the clips placed one step late in their samples
    assert shifted["max_dloss"] > 1e-2 and shifted["audio_grad_err"] > 1e-1, shifted  # measured 0.066, 0.97
