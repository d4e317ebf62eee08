"""Megatron-Core `LLaVAModel`, packed vs batched (Megatron-LM PR #3427's check, rebuilt on CPU).

`run_llava_parity(rank, world_size)` is a `run_distributed` target (2 processes). The reference is
the single-process model on the batched micro-batches (right-padded rows, LLaVA's own path). The
packed runs go through the shipped `make_forward_step` (LLaVAAdapter: `pack_llava_batch` -> check
-> localize -> forward -> `loss_func`) and `get_forward_backward_func` with PP=2 and with CP=2,
both label styles. Samples cover images at sample starts, back-to-back images, an image as a sample's last
token, text-only samples and the tile cycle [1, 2, 1, 3, 1]. Reported per case:
token_mult_prob_error = exp(mean |logp_packed - logp_batched|) over tokens with a loss, and the
worst relative error over every parameter gradient (vision tower and projection included). The
tiny model, its micro-batches and the batched reference live in `testing.llava_reference`.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from megatron_vlm_packing.testing.distributed import initialize_parallel
from megatron_vlm_packing.testing.llava_reference import (  # noqa: F401 (the model, data and reference re-exported)
    IMAGE_TOKEN, IMG, MAX_LENGTH, MICRO_BATCHES, TILE_CYCLE, T, batched_targets, batches, build_tiny_llava, collated,
    llava_cp_without_te, reference, reference_setup)
from megatron_vlm_packing.testing.parity import full_gradients, gather_cp_tokens, max_relative_error, token_mult_prob_error


def expanded_cu_seqlens_padded(adapter, mb) -> torch.Tensor:
    from megatron_vlm_packing.models.llava_expansion import remap_packed_seq_params

    s = adapter.space
    _, tiles = adapter.image_inputs(mb)
    return remap_packed_seq_params(mb.packed_seq_params, mb.input_ids, tiles, img_seq_len=s.img_seq_len,
                                   image_token_index=s.image_token_index, segment_multiple=s.segment_multiple,
                                   total_multiple=s.total_multiple, pad_to=s.pipeline_length).cu_seqlens_q_padded


class _Observed:
    """Each micro-batch the step built (to unpack the last stage's CP-local losses afterwards)."""

    def __init__(self):
        self.micro_batches = []

    def __call__(self, micro_batch):
        self.micro_batches.append(micro_batch)
        return micro_batch


def _observe_outputs(outputs: list, step):
    """The schedule's forward step, keeping the last stage's (losses, loss mask) outputs."""
    def forward_step(data_iterator, model):
        out, loss = step(data_iterator, model)
        if isinstance(out, tuple):
            outputs.append((out[0].detach(), out[1].detach()))
        return out, loss

    return forward_step


def packed_run(model, data: list[dict], label_style: str, *, forward_only: bool = False, **step_options):
    """Packed logprobs per micro-batch (last stage, else None) and this rank's full-shape grads (CP tokens
    gathered; TP shards too, under TP), through `make_forward_step(label_style=label_style, **step_options)`."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.train.step import make_forward_step

    model.zero_grad()
    outputs, observed = [], _Observed()
    step = make_forward_step(label_style=label_style, transform=observed, **step_options)
    with llava_cp_without_te():
        get_forward_backward_func()(
            forward_step_func=_observe_outputs(outputs, step), data_iterator=iter(data), model=[model],
            num_microbatches=len(data), seq_length=MAX_LENGTH, micro_batch_size=1, forward_only=forward_only)
    logps = []
    adapter = adapter_for(model)
    for (losses, mask), mb in zip(outputs, observed.micro_batches):
        cu_padded = expanded_cu_seqlens_padded(adapter, mb)
        losses = gather_cp_tokens(losses, cu_padded, ps.get_context_parallel_group())
        mask = gather_cp_tokens(mask, cu_padded, ps.get_context_parallel_group())
        logps.append(-losses[mask.bool()])
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(),
                           cp_group=ps.get_context_parallel_group())
    return logps or None, grads


def compare(ref_logps, ref_grads, logps, grads) -> dict:
    """token_mult_prob_error (tokens with a loss), worst relative grad error and the parameters
    checked (over all ranks: every reference parameter must be checked somewhere)."""
    mult, tokens = 0.0, 0  # ranks without the last stage report nothing
    if logps is not None:
        got, want = torch.cat(logps), torch.cat(ref_logps)
        mult = token_mult_prob_error(got, want) if got.shape == want.shape else float("inf")
        tokens = got.numel()
    worst = max((max_relative_error(g, ref_grads[n]) for n, g in grads.items()), default=0.0)
    result = torch.tensor([mult, worst, tokens], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(grads))
    checked = set().union(*map(set, names))
    return {"token_mult_prob_error": result[0].item(), "max_rel_grad_err": result[1].item(),
            "tokens_compared": int(result[2]),
            "params_checked": len(checked), "params_missing": sorted(set(ref_grads) - checked)}


def load_state(model, state: dict) -> None:
    from megatron_vlm_packing.testing.parity import global_name

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[global_name(model, name)])


def packed_direct(model, mb, *, tiles=None):
    """One patched LLaVA call on a packed micro-batch (no schedule): logprobs of tokens with a loss."""
    images = mb.vision.pixel_values if mb.vision is not None else torch.zeros(0)
    losses, mask = model(images, mb.input_ids, mb.position_ids, None, labels=mb.labels, loss_mask=mb.loss_mask,
                         num_image_tiles=tiles, packed_seq_params=mb.packed_seq_params)
    return -losses.detach()[mask.bool()]


def one_tile_checks(model, seed: int) -> dict:
    """`num_image_tiles` omitted everywhere (LLaVA's default, one tile per image): packed == batched."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch

    out = {}
    for style in ("megatron", "hf"):
        got, want = [], []
        for batch in batches(style, seed):
            batch = dict(batch, images=batch["images"][: batch["num_image_tiles"].numel()])
            batch.pop("num_image_tiles")
            labels, loss_mask = batched_targets(batch, style)
            ids = batch["input_ids"]
            losses, mask = model(batch["images"], ids, torch.arange(ids.shape[1])[None].expand_as(ids), None,
                                 labels=labels, loss_mask=loss_mask)
            want.append(-losses.detach()[mask.bool()])
            got.append(packed_direct(model, pack_llava_batch(batch, LlavaSpace.of(model), label_style=style)))
        got, want = torch.cat(got), torch.cat(want)
        out[f"tiles omitted, {style}"] = token_mult_prob_error(got, want) if got.shape == want.shape else float("inf")
    return out


def leak_checks(model, seed: int) -> dict:
    """A plain pack (no pad slot before image-opening documents), Megatron labels: the patch refuses
    it; upstream's forward (boundaries expanded by hand) loses one weighted token per such document."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_expansion import remap_packed_seq_params
    from megatron_vlm_packing.packing import pack_batch
    from megatron_vlm_packing.patches import llava_boundaries

    batch = batches("megatron", seed)[0]
    packed = pack_batch({k: batch[k] for k in ("input_ids", "labels", "attention_mask")})
    space = LlavaSpace.of(model)
    args = (batch["images"], packed.input_ids, packed.position_ids, None)
    kwargs = dict(labels=packed.labels, loss_mask=packed.loss_mask, num_image_tiles=batch["num_image_tiles"])
    try:
        model(*args, packed_seq_params=packed.packed_seq_params, **kwargs)
        refused = ""
    except ValueError as err:
        refused = str(err)
    expanded = remap_packed_seq_params(packed.packed_seq_params, packed.input_ids, batch["num_image_tiles"],
                                       img_seq_len=space.img_seq_len, image_token_index=space.image_token_index)
    llava_boundaries.undo_llava_packed_boundaries()
    try:
        _, mask = model(*args, packed_seq_params=expanded, **kwargs)
    finally:
        llava_boundaries.apply_llava_packed_boundaries()
    _, ref_mask = batched_targets(batch, "megatron")
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    _, want = model(batch["images"], ids, positions, None, labels=batch["labels"], loss_mask=ref_mask,
                    num_image_tiles=batch["num_image_tiles"])
    return {"leak refused": refused, "leak tokens lost upstream": int(want.sum() - mask.sum())}


@contextlib.contextmanager
def remap_on_first_stage_only():
    """Deliberate mistake (the patch before this fix): stages with pre_process=False keep the
    collapsed boundaries. The PP control must catch it."""
    from megatron_vlm_packing.patches import llava_boundaries

    full = llava_boundaries.expand_packed_call

    def first_stage_only(model, call):
        if model.pre_process:
            full(model, call)

    llava_boundaries.expand_packed_call = first_stage_only
    try:
        yield
    finally:
        llava_boundaries.expand_packed_call = full


def pp_control(model, data, ref_logps) -> float:
    """token_mult_prob_error with the first-stage-only mistake; inf when the last stage fails. One
    micro-batch, forward only: a last stage that fails leaves its peer waiting for nothing."""
    try:
        with remap_on_first_stage_only():
            logps, _ = packed_run(model, data[:1], "megatron", forward_only=True)
        error = 0.0
        if logps is not None:
            got, want = torch.cat(logps), ref_logps[0]
            error = token_mult_prob_error(got, want) if got.shape == want.shape else float("inf")
    except RuntimeError:  # rope over collapsed boundaries on the expanded input
        error = float("inf")
    worst = torch.tensor([error], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def upstream_direct(model, seed: int) -> float:
    """Control: upstream LLaVAModel (no patch) on a well-planned pack: boundaries stay collapsed."""
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.patches import llava_boundaries

    batch = batches("megatron", seed)[0]
    mb = pack_llava_batch(batch, LlavaSpace.of(model))
    labels, loss_mask = batched_targets(batch, "megatron")
    ids = batch["input_ids"]
    losses, mask = model(batch["images"], ids, torch.arange(ids.shape[1])[None].expand_as(ids), None,
                         labels=labels, loss_mask=loss_mask, num_image_tiles=batch["num_image_tiles"])
    llava_boundaries.undo_llava_packed_boundaries()
    try:
        got = packed_direct(model, mb, tiles=batch["num_image_tiles"])
    except RuntimeError:  # rope over collapsed boundaries: the document lengths do not add up
        return float("inf")
    finally:
        llava_boundaries.apply_llava_packed_boundaries()
    want = -losses[mask.bool()]
    return token_mult_prob_error(got, want) if got.shape == want.shape else float("inf")


def cp_plain_pack_refusal(model, seed: int) -> str:
    """Control: a pack aligned in collapsed space only (pack_batch(cp_size=2)) is refused by the patch."""
    from megatron_vlm_packing.packing import pack_batch

    batch = batches("hf", seed)[0]
    packed = pack_batch({k: batch[k] for k in ("input_ids", "labels", "attention_mask")}, cp_size=2,
                        label_style="hf")
    try:
        model(batch["images"], packed.input_ids, packed.position_ids, None, labels=packed.labels,
              loss_mask=packed.loss_mask, num_image_tiles=batch["num_image_tiles"],
              packed_seq_params=packed.packed_seq_params)
    except ValueError as err:
        return str(err)
    return ""


def lap_timer(result: dict):
    """`lap(name)`: seconds since the previous lap (or this call) into result["seconds"][name]."""
    clock = [time.perf_counter()]

    def lap(name: str) -> None:
        clock.append(time.perf_counter())
        result.setdefault("seconds", {})[name] = round(clock[-1] - clock[-2], 2)

    return lap


def run_llava_parity(rank: int, world_size: int, seed: int = 11) -> dict:
    """Every check in one launch of 2 processes; what rank 0 saw (reductions make it global)."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.patches import llava_boundaries

    result = {"patch_active": llava_boundaries.apply_llava_packed_boundaries()}
    lap = lap_timer(result)
    try:
        ref_model, state, refs = reference_setup(seed)
        result.update(img_seq_len=int(ref_model.img_seq_len), params=len(state))
        result["tiles"] = batches("megatron", seed)[0]["num_image_tiles"].tolist()
        lap("reference")
        with torch.no_grad():
            result.update(one_tile_checks(ref_model, seed))
            result.update(leak_checks(ref_model, seed))
            result["upstream, no patch"] = upstream_direct(ref_model, seed)
        lap("single-process checks")
        for name, layout in (("PP=2", dict(pp=2)), ("CP=2", dict(cp=2))):
            initialize_parallel(seed=seed, **layout)
            with llava_cp_without_te():
                model = build_tiny_llava(seed, stage=ps.get_pipeline_model_parallel_rank(), **layout)
            load_state(model, state)
            for style, (data, ref_logps, ref_grads) in refs.items():
                result[f"{name}, {style} labels"] = compare(ref_logps, ref_grads, *packed_run(model, data, style))
                lap(f"{name}, {style} labels")
            if name == "PP=2":
                result["PP=2, control: first stage only"] = pp_control(model, *refs["megatron"][:2])
            else:
                with llava_cp_without_te():
                    result["CP=2, control: plain pack"] = cp_plain_pack_refusal(model, seed)
    finally:
        llava_boundaries.undo_llava_packed_boundaries()
    return result
