"""Bridge parity: Megatron-Bridge's Qwen-VL models packed through our adapters vs each sample alone.

`run_bridge_parity(rank, world_size, cases)` is a `testing.run_distributed` target. For each family
the reference is the TP = CP = 1 model (Bridge's own, built by its provider) running every sample
alone as one dense unpadded row, with Bridge's own mRoPE positions. Each case then builds the model
at its layout, loads the reference weights (SwiGLU-aware TP shards), packs the micro-batch at real
lengths with images and videos through the shipped `make_forward_step` (the 3-argument Bridge form
for CP cases) and its loss function, with the adapter the registry finds for Bridge's model class;
every parameter gradient (vision tower included) is gathered back and compared.

A case is (family, tp, cp, sp[, "unpatched"]): "unpatched" runs without the Bridge patches (the
adapter's refusal bypassed) to show that a patch is necessary.

Shape legend: T = packed physical tokens, Tl = T / cp.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
from megatron_vlm_packing.bridge.smoke import alone_loss_sum
from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, build_tiny_bridge_model

SEED = 3

NUM_SAMPLES = 4


def _reference(family: str, samples: list[dict]):
    """(loss sum, grads, state) of the TP = CP = 1 model, every sample alone."""
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    initialize_parallel(seed=SEED)
    model = build_tiny_bridge_model(TinyBridgeConfig(family=family), seed=SEED)
    total = sum(alone_loss_sum(model, family, s) for s in samples)
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return total.detach(), grads, state


def micro_batch_of(batch: dict, mrope, layout):
    """The packed `MicroBatch` of `batch` for `layout` (full length; `localize` cuts it)."""
    from megatron_vlm_packing import pack_batch

    return pack_batch(batch, tp_size=layout.tp_size, cp_size=layout.cp_size,
                      sequence_parallel=layout.sequence_parallel, label_style="hf", mrope=mrope)


def _unchecked_adapter(model):
    """The family's adapter without its refusal of an unpatched layout ("unpatched" cases only)."""
    from megatron_vlm_packing.bridge import adapters
    from megatron_vlm_packing.bridge.tower_inputs import TowerWidths

    cls, mrope_of = ((adapters.Qwen25VLAdapter, adapters.qwen25_vl_mrope) if type(model).__name__ == "Qwen25VLModel"
                     else (adapters.Qwen3VLAdapter, adapters.qwen3_vl_mrope))
    adapter = object.__new__(cls)
    adapter.model_name, adapter.mrope = type(model).__name__, mrope_of(model)
    adapter.tower_widths = TowerWidths.of(adapter.model_name, getattr(model, "vision_model", None)
                                          or getattr(model, "visual", None))
    return adapter


def _packed_step(model, batch: dict, *, check: bool, with_state: bool = False):
    """Forward + backward of one packed micro-batch through the shipped `make_forward_step` and its
    loss function (the adapter found by the registry); the loss sum of this rank's tokens.

    With `check=False` ("unpatched") the adapter's refusal of an unpatched layout is bypassed.
    """
    from megatron_vlm_packing import make_forward_step

    step = make_forward_step(pack=True, label_style="hf", with_state=with_state,
                             adapter=None if check else _unchecked_adapter(model))
    args = (None, iter([batch]), model) if with_state else (iter([batch]), model)
    output, loss_func = step(*args)
    loss_sum, _, _ = loss_func(output)
    loss_sum.backward()
    return loss_sum.detach()


def _refusal(case: tuple) -> dict:
    """(family, tp, cp, sp, "refused"): the adapter must refuse this layout with a ValueError."""
    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    family, tp, cp, sp = case[:4]
    initialize_parallel(tp=tp, cp=cp, seed=SEED)
    model = build_tiny_bridge_model(TinyBridgeConfig(family=family, tensor_parallel=tp, context_parallel=cp,
                                                     sequence_parallel=sp), seed=SEED)
    try:
        adapter_for(model)
    except ValueError as err:
        return dict(case=case, refused=str(err))
    return dict(case=case, refused=None)


def _run_case(case: tuple, samples: list[dict], reference) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.parity import full_gradients, load_full_state, max_relative_error

    family, tp, cp, sp = case[:4]
    unpatched = "unpatched" in case[4:]
    ref_loss, ref_grads, state = reference
    initialize_parallel(tp=tp, cp=cp, seed=SEED)
    cfg = TinyBridgeConfig(family=family, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    undo_bridge_patches()
    if not unpatched:
        apply_bridge_patches()
    try:
        model = build_tiny_bridge_model(cfg, seed=SEED + 1)  # other weights: load_full_state must set them all
        load_full_state(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
        loss = _packed_step(model, collate_qwen_vl(samples), check=not unpatched, with_state=cp > 1)
    finally:
        undo_bridge_patches()
    dist.all_reduce(loss, group=ps.get_context_parallel_group())
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(), cp_group=ps.get_context_parallel_group())
    errors = {n: max_relative_error(g, ref_grads[n]) for n, g in grads.items()}
    vision = [n for n in errors if n.startswith(("vision_model.", "visual."))]
    worst = torch.tensor([abs(loss - ref_loss).item(), max(errors.values()), max(errors[n] for n in vision),
                          sum(errors[n] > 1e-3 for n in vision)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(case=case, loss=ref_loss.item(), model=f"{type(model).__module__}.{type(model).__name__}", abs_dloss=worst[0].item(), max_rel_grad_err=worst[1].item(),
                max_rel_vision_grad_err=worst[2].item(), vision_params_off=int(worst[3]),
                params=len(errors), vision_params=len(vision), missing=sorted(set(ref_grads) - set(grads)))


def run_bridge_parity(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """Every case of `cases` (grouped by family, one reference per family); results in order."""
    import sys

    results, references = [], {}
    for case in cases:
        family = case[0]
        if "refused" in case[4:]:
            results.append(_refusal(case))
            continue
        samples = qwen_vl_samples(TinyBridgeConfig(family=family), NUM_SAMPLES, seed=SEED)
        if family not in references:
            references[family] = _reference(family, samples)
        results.append(_run_case(case, samples, references[family]))
    for result in results:  # Bridge's models came from its leaf modules: no TE, no package chain
        result.update(transformer_engine_imported="transformer_engine" in sys.modules,
                      bridge_package_imported="megatron.bridge" in sys.modules)
    return results


ALL_CASES = [
    (family, tp, cp, sp) for family in ("qwen3_vl", "qwen3_vl_moe", "qwen25_vl")
    for tp, cp, sp in ((1, 1, False), (2, 1, True), (1, 2, False), (2, 2, True))
] + [("qwen3_vl", 2, 1, True, "unpatched")]


def parity_table(results: list[dict]) -> str:
    """Markdown rows: family, layout, |dloss|, worst relative gradient error (all / vision)."""
    rows = ["| model (Bridge 0.6.2) | layout | max abs dloss | max rel grad err | max rel vision grad err "
            "| vision params off (> 1e-3) |", "|---|---|---|---|---|---|"]
    for r in results:
        family, tp, cp, sp = r["case"][:4]
        layout = " x ".join(p for p in (f"TP={tp}" if tp > 1 else "", f"CP={cp}" if cp > 1 else "") if p) or "TP=1"
        layout += " + SP" if sp else ""
        layout += ", unpatched" if "unpatched" in r["case"][4:] else ""
        rows.append(f"| {family} | {layout} | {r['abs_dloss']:.2e} | {r['max_rel_grad_err']:.2e} | "
                    f"{r['max_rel_vision_grad_err']:.2e} | {r['vision_params_off']} of {r['vision_params']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from megatron_vlm_packing.testing.distributed import run_distributed

    print(parity_table(run_distributed(run_bridge_parity, 4, ALL_CASES)))
