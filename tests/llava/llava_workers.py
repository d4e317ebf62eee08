"""One launch of 2 processes for the LLaVA checks added after the PP=2 / CP=2 suite
(`testing.llava_parity.run_llava_parity`):

- TP=2 + SP parity: Megatron-Core LLaVAModel, every part TP-sharded and the language model
  sequence-parallel, packed through `make_forward_step` + `get_forward_backward_func`, against the
  single-process model on the batched micro-batches (both label styles), with a deliberate-mistake
  control (a pack not padded to LLaVA's SP shard factor is refused, on both of the patch's paths);
- the same under TP=2 + SP on hostile micro-batches (`llava_reference.HOSTILE_MICRO_BATCHES`: documents of
  1 token, an empty row, image-only documents, ones ending on an image, none with an image, a repeated sample,
  none with a loss, one fed twice; each expanding to an odd total), packed and with pack=False, with what each
  one exercises as the step's packer plans it;
- `make_forward_step(pack=False)` (LLaVA's own batched rows through the step, to compare padded with
  packed) against the same reference, on one process and under TP=2 + SP;
- host syncs of a packed forward + backward through the step at CP=2 and at TP=2 + SP, counted per
  source (tests/perf/test_llava_sync_budget.py holds the assertions);
- ids no packer checked under TP=2 + SP, one outside the vocabulary (which the vocab-parallel embedding
  masks to a zero embedding on every rank) and a clean copy (tests/llava/test_llava_hand_built_ids.py).

`launch()` runs it once per test session; both test files read the same result.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace

import torch
from torch import nn

from megatron_vlm_packing.testing.distributed import run_distributed

UPSTREAM = "megatron/core/"  # Megatron-Core's own code (LLaVAModel._preprocess_data, TP embedding)


@functools.cache
def launch() -> dict:
    return run_distributed(run_llava_checks, 2, timeout_s=900)


class _PartitionKernel(nn.Module):
    """TE's `thd_get_partitioned_indices` on the CPU (a module, so that the sync counter can leave it out:
    on a GPU it is a TE kernel that reads nothing back)."""

    def forward(self, cu_seqlens_padded, total, cp_size, cp_rank):
        from megatron_vlm_packing.parallel.cp import cp_partition_index

        return cp_partition_index(cu_seqlens_padded, cp_size, cp_rank)


def _count_kernel_apart(kernel: _PartitionKernel) -> None:
    """Inside `llava_cp_without_te`: route LLaVA's CP partition through `kernel` (when the stand-in is ours)."""
    from megatron.core.models.multimodal import llava_model

    if llava_model.HAVE_TEX and getattr(llava_model.tex, "__name__", "") == "_Tex":
        llava_model.tex = type("_CountedTex", (), {"thd_get_partitioned_indices": staticmethod(kernel)})


def _split(syncs) -> dict:
    """Counts of `syncs` by source: Megatron-Core's own code, and ours (the step, packer, adapter, patch)."""
    ours = [e for e in syncs.events if UPSTREAM not in e.where]
    return dict(ours=len(ours), upstream=syncs.total - len(ours),
                ours_in=sorted({e.where.rsplit("/", 1)[-1].split(":")[0] for e in ours}), report=syncs.report())


def _counted(model, step, item, exclude):
    """(loss, grads, syncs) of one forward + backward of `item` through `step`."""
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    model.zero_grad(set_to_none=True)
    with count_host_syncs(exclude=exclude) as syncs:
        output, loss_fn = step(iter([item]), model)
        loss = loss_fn(output)[0]
        loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return loss.detach(), grads, syncs


def batched_syncs(model, batch):
    """LLaVA's own batched forward + backward (right-padded rows, no packing) on one process, counted."""
    from megatron_vlm_packing.testing.llava_parity import batched_targets
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    labels, loss_mask = batched_targets(batch, "hf")
    ids = batch["input_ids"]
    exclude = [layer.self_attention.core_attention
               for stack in (model.language_model.decoder, model.vision_model.decoder) for layer in stack.layers]
    with count_host_syncs(exclude=exclude) as syncs:
        losses, mask = model(batch["images"], ids, torch.arange(ids.shape[1])[None].expand_as(ids), None,
                             labels=labels, loss_mask=loss_mask, num_image_tiles=batch["num_image_tiles"])
        (losses * mask).sum().backward()
    return syncs


def sync_row(model, batch, kernel, batched=None, *, padded: bool = False) -> dict:
    """Syncs (by source) in the step packing and with a LlavaPackingCollator micro-batch, and in LLaVA's
    own batched forward: on `model` itself, or `batched` when given (counted on one process for CP:
    megatron-core 0.16.1 runs batched CP only with megatron.training installed); with `padded`, also
    through the step with pack=False (the first call builds the adapter: counted after the others)."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator
    from megatron_vlm_packing.train.step import make_forward_step

    exclude = [layer.self_attention.core_attention  # the reference attention stands in for TE's
               for stack in (model.language_model.decoder, model.vision_model.decoder) for layer in stack.layers]
    exclude.append(kernel)
    step = make_forward_step(label_style="hf")
    row = {}
    for name, item in (("in_step", batch), ("loader", LlavaPackingCollator(space=LlavaSpace.of(model))(batch))):
        if name == "in_step":
            _counted(model, step, item, exclude)  # warm-up: the adapter is built on the first call
        loss, grads, syncs = _counted(model, step, item, exclude)
        row[name] = dict(_split(syncs), loss=loss.item(), grads=grads)
    row["batched"] = _split(batched if batched is not None else batched_syncs(model, batch))
    if padded:  # make_forward_step(pack=False): LLaVA's own rows through the step
        row["padded"] = _split(_counted(model, make_forward_step(label_style="hf", pack=False), batch, exclude)[2])
    row["loss_diff"] = abs(row["in_step"]["loss"] - row["loader"]["loss"])
    row["grad_diff"] = (row["in_step"].pop("grads") - row["loader"].pop("grads")).abs().max().item()
    return row


def step_run(model, data: list[dict], label_style: str, *, pack: bool = True, **step_options):
    """Logprobs per micro-batch, full (TP-gathered) grads, and the loss-mask shape of each model output,
    through the shipped step (`make_forward_step(**step_options)`), packed or (pack=False) in LLaVA's own
    batched rows."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vlm_packing.testing.llava_parity import MAX_LENGTH
    from megatron_vlm_packing.testing.parity import full_gradients
    from megatron_vlm_packing.train.step import make_forward_step

    model.zero_grad()
    outputs, step = [], make_forward_step(label_style=label_style, pack=pack, **step_options)

    def forward_step(data_iterator, model):
        out, loss = step(data_iterator, model)
        outputs.append((out[0].detach(), out[1].detach()))
        return out, loss

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(data), model=[model],
                                num_microbatches=len(data), seq_length=MAX_LENGTH, micro_batch_size=1)
    logps = [-losses[mask.bool()] for losses, mask in outputs]
    shapes = [tuple(mask.shape) for _, mask in outputs]
    return logps, full_gradients(model, tp_group=ps.get_tensor_model_parallel_group()), shapes


def compared(refs: tuple, run: tuple) -> dict:
    """`llava_parity.compare` of a `step_run` against the batched reference, with the output shapes and
    the tokens with a loss in each micro-batch (the reference's)."""
    from megatron_vlm_packing.testing.llava_parity import compare

    _, ref_logps, ref_grads = refs
    logps, grads, shapes = run
    return dict(compare(ref_logps, ref_grads, logps, grads), shapes=shapes,
                tokens_per_micro_batch=[int(logp.numel()) for logp in ref_logps])


def sp_shard_controls(model, seed: int) -> dict:
    """Deliberate mistakes: a pack planned without LLaVA's SP shard factor (total multiple 1, expanded
    total odd) is refused, not scattered unevenly over the TP ranks, on both of the patch's paths: the
    plan's host ints (what the step passes) and the boundaries read from the ids (a direct call)."""
    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    from megatron_vlm_packing.testing.llava_parity import batches, packed_direct

    batch = batches("hf", seed)[1]
    mb = pack_llava_batch(batch, replace(LlavaSpace.of(model), total_multiple=1), label_style="hf")
    out = {"expanded total": mb.plan.total + sum(mb.plan.expansion)}
    for name, call in (("planned", lambda: adapter_for(model).forward(model, mb)),
                       ("read from ids", lambda: packed_direct(model, mb, tiles=batch["num_image_tiles"]))):
        try:
            call()
            out[name] = "accepted"
        except ValueError as err:
            out[name] = str(err)
    return out


def hand_built_ids(model, seed: int) -> dict:
    """What the step does with a micro-batch whose first real text id a transform set to an id outside the
    vocabulary ("refused: <its message>" or "trained: loss <value>"), packed and dense, and with a clean copy of the
    packer's ids ("trained as the packer's" when the loss is the packer's)."""
    from megatron_vlm_packing.testing.llava_parity import batches
    from megatron_vlm_packing.testing.step_models import step_loss

    batch, image, out = batches("hf", seed)[1], model.image_token_index, {}

    def own_ids(value):
        def transform(mb):
            ids = mb.input_ids.clone()
            if value is not None:
                row, position = (int(i) for i in torch.nonzero((ids != image) & ~mb.padding_mask)[0])
                ids[row, position] = value
            return replace(mb, input_ids=ids)
        return transform

    vocab = model.language_model.vocab_size
    for value, pack in itertools.product((vocab, vocab + 1000, -1), (True, False)):
        try:
            loss = step_loss(model, batch, label_style="hf", pack=pack, transform=own_ids(value))
            out[f"{value}, pack={pack}"] = f"trained: loss {loss}"
        except ValueError as err:
            out[f"{value}, pack={pack}"] = f"refused: {err}"
    same = abs(step_loss(model, batch, label_style="hf", transform=own_ids(None)) -
               step_loss(model, batch, label_style="hf")) <= 1e-6
    out["clean copy"] = "trained as the packer's" if same else "another loss"
    return out


def hostile_references(ref_model, seed: int) -> dict:
    """{label style: (`hostile_batches`, *the batched reference)} on the single-process model."""
    from megatron_vlm_packing.testing.llava_reference import hostile_batches, reference

    return {style: (hostile_batches(style, seed), *reference(ref_model, hostile_batches(style, seed), style))
            for style in ("megatron", "hf")}


def hostile_plans(model, data: list[dict]) -> list[dict]:
    """What each hostile micro-batch exercises, as `model`'s packer plans it: its documents' collapsed ids
    (real tokens), its empty rows (no document), expanded real and physical lengths, the multiples, and the
    expanded total without and with LLaVA's shard factor."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch

    space, plans = LlavaSpace.of(model), []
    for batch in data:
        plan = pack_llava_batch(batch, space, label_style="hf").plan
        unaligned = pack_llava_batch(batch, replace(space, total_multiple=1), label_style="hf").plan
        rows = [ids[:n].tolist() for ids, n in zip(batch["input_ids"], batch["attention_mask"].sum(1))]
        plans.append(dict(documents=[rows[b] for b in plan.segment_rows], empty_rows=len(rows) - plan.num_segments,
                          expanded_real=plan.expanded_real, expanded_physical=plan.expanded_physical,
                          segment_multiple=space.segment_multiple, total_multiple=space.total_multiple,
                          unaligned_total=sum(unaligned.expanded_physical), total=sum(plan.expanded_physical)))
    return plans


def hostile_parity(model, hostile: dict) -> dict:
    """The hostile micro-batches through the step (packed, and LLaVA's own rows with pack=False) against
    the batched reference, both label styles, and what they exercise (`hostile_plans`)."""
    out = {"plans": hostile_plans(model, hostile["hf"][0])}
    for (style, ref), pack in itertools.product(hostile.items(), (True, False)):
        out[f"{style} labels" if pack else f"pack=False, {style} labels"] = compared(
            ref, step_run(model, ref[0], style, pack=pack))
    return out


def run_llava_checks(rank: int, world_size: int, seed: int = 11) -> dict:
    """Every check in one launch (2 processes); what rank 0 saw (reductions make the parity global)."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.patches import (
        apply_llava_packed_boundaries, apply_thd_rotary, undo_llava_packed_boundaries, undo_thd_rotary,
    )
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.llava_parity import (
        batches, build_tiny_llava, lap_timer, llava_cp_without_te, reference_setup,
    )
    from megatron_vlm_packing.testing.parity import load_full_state

    result = {"patches": (apply_llava_packed_boundaries(), apply_thd_rotary())}
    lap = lap_timer(result)
    kernel = _PartitionKernel()
    try:
        ref_model, state, refs = reference_setup(seed)
        result["params"] = len(state)
        hostile = hostile_references(ref_model, seed)
        batched = batched_syncs(ref_model, batches("hf", seed)[0])
        lap("reference")
        for style, ref in refs.items():
            result[f"pack=False, {style} labels"] = compared(ref, step_run(ref_model, ref[0], style, pack=False))
        lap("pack=False")
        initialize_parallel(tp=2, seed=seed)
        with llava_cp_without_te():
            model = build_tiny_llava(seed, tp=2, sp=True)
            load_full_state(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=2)
            for (style, ref), pack in itertools.product(refs.items(), (True, False)):
                name = f"TP=2+SP, {style} labels" if pack else f"TP=2+SP, pack=False, {style} labels"
                result[name] = compared(ref, step_run(model, ref[0], style, pack=pack))
            lap("TP=2+SP parity")
            result["TP=2+SP, hostile"] = hostile_parity(model, hostile)
            lap("TP=2+SP hostile")
            result["TP=2+SP, control: no shard factor"] = sp_shard_controls(model, seed)
            result["syncs TP=2+SP"] = sync_row(model, batches("hf", seed)[0], kernel, padded=True)
            result["TP=2+SP, hand-built ids"] = hand_built_ids(model, seed)
        lap("TP=2+SP syncs")
        initialize_parallel(cp=2, seed=seed)
        with llava_cp_without_te():
            _count_kernel_apart(kernel)
            model = build_tiny_llava(seed, cp=2)
            result["syncs CP=2"] = sync_row(model, batches("hf", seed)[0], kernel, batched)
        lap("CP=2 syncs")
    finally:
        undo_thd_rotary()
        undo_llava_packed_boundaries()
    return result
