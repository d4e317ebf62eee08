"""Bridge parity under pipeline parallelism: packed micro-batches through Megatron-Core's schedule.

`run_bridge_pp_parity(rank, world_size, cases)` is a `testing.run_distributed` target. A case is
(family, tp, pp, sp[, options]) with family "qwen3_vl", "qwen3_vl_moe", "qwen25_vl" or "qwen3_omni"
and options "cp2" (context parallel 2 too), "variable" (real packed lengths, `variable_seq_lengths`),
"control" (a deliberate mistake the comparison must catch), "tied" (tied word embeddings, in Megatron's
DDP with `finalize_model_grads`), "refused" (what the adapter says).

- Truth: the TP = PP = 1 model of the family (Bridge's own, built by its provider) running every
  sample alone, dense and unpadded, on Bridge's own path (`bridge.truth`); the samples are shared
  out over the launch's ranks and the gradients summed.
- Packed: the model at the case's layout (each rank builds its pipeline stage: vision tower and
  embedding on the first, output layer on the last), the truth's weights loaded, and several
  micro-batches of packed samples through the shipped `make_forward_step` (every stage reads the
  same micro-batches: later stages need the boundaries, positions and labels) and
  `get_forward_backward_func` (1F1B: several micro-batches in flight), with a fixed packed length
  `pad_to` (static p2p shapes) or at real lengths. With `calculate_per_token_loss` the schedule
  neither averages nor scales, so the gradients are those of the sum of every token's loss, the truth's.
- Compared: the loss sum and token count of the last stage, and every parameter gradient on every
  stage (TP shards gathered, CP parts summed, named by global layer index); every truth parameter must
  be compared on some rank, the vision (and audio) towers included.

Bridge asserts that Qwen3-VL's deepstack levels all feed layers of the first stage
(`Qwen3VLModel.__init__`; Qwen3-Omni at its first image), so the PP models have `PP_LAYERS` language
layers (2 per stage for the 2 deepstack levels of the tiny configs).

    python -m megatron_vlm_packing.bridge.parity_pp [--wide] [family ...]   # the README's PP table
                                                        # (--wide: PP2 x TP2 x CP2 x SP, 8 processes)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SEED = 5
PP_LAYERS = 4
MICRO_BATCHES = 3
SAMPLES_PER_MICRO_BATCH = 2


def tiny_config(family: str, *, tp: int = 1, cp: int = 1, pp: int = 1, sp: bool = False, tied: bool = False):
    """The tiny config of `family` with PP_LAYERS language layers, at the given layout."""
    layout = dict(num_layers=PP_LAYERS, tensor_parallel=tp, context_parallel=cp, pipeline_parallel=pp,
                  sequence_parallel=sp, tie_embeddings=tied)
    if family == "qwen3_omni":
        from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig

        return TinyOmniConfig(**layout)
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig

    return TinyBridgeConfig(family=family, **layout)


def micro_batches(family: str, samples: list[dict]) -> list[dict]:
    """MICRO_BATCHES collated batches of SAMPLES_PER_MICRO_BATCH consecutive samples each."""
    from megatron_vlm_packing.bridge.truth import collate_for

    n = SAMPLES_PER_MICRO_BATCH
    return [collate_for(family, samples[i:i + n]) for i in range(0, len(samples), n)]


def fixed_length(batches: list[dict], cfg, multiple: int = 16) -> int:
    """The packed length every micro-batch is padded to: the longest pack, rounded up to `multiple`."""
    from megatron_vlm_packing import pack_batch

    longest = max(pack_batch(b, tp_size=cfg.tensor_parallel, cp_size=cfg.context_parallel,
                             sequence_parallel=cfg.sequence_parallel, label_style="hf",
                             mrope=cfg.mrope_config()).input_ids.shape[1] for b in batches)
    return -(-longest // multiple) * multiple


def truth(family: str, samples: list[dict], *, tied: bool = False):
    """(loss sum [] float64, token count, grads by name, weights by name) of every sample alone on the
    TP = PP = 1 model; samples shared out over the ranks, the sums all-reduced."""
    from megatron_vlm_packing.bridge.truth import alone_losses, build_family
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    initialize_parallel(seed=SEED)
    model = build_family(family, tiny_config(family, tied=tied), seed=SEED)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    total, tokens = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for sample in samples[dist.get_rank()::dist.get_world_size()]:
        losses = alone_losses(model, family, sample, tiny_config(family))  # [targets] losses, sample alone
        losses.sum().backward()
        total += losses.detach().sum().double()
        tokens += losses.numel()
    grads = {}
    for name, param in model.named_parameters():
        grads[name] = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grads[name])
    both = torch.stack([total, tokens])
    dist.all_reduce(both)
    if tied:  # a later stage's output layer holds its own copy of the shared word embeddings
        for name in [n for n in state if n.endswith("embedding.word_embeddings.weight")]:
            alias = name.replace("embedding.word_embeddings.weight", "output_layer.weight")
            state[alias], grads[alias] = state[name], grads[name]
    return both[0], int(both[1]), grads, state


def one_document_on_later_stages(micro_batch):
    """Deliberate mistake (a control): later pipeline stages attend across the whole pack as one
    document, as a stage that ignored the boundaries would; the first stage keeps them. Declared
    (`declare_boundaries`): the step refuses boundaries other than the plan's, and the control shows that the
    parity check catches them."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_vlm_packing.packing.micro_batch import declare_boundaries

    if ps.is_pipeline_first_stage():
        return micro_batch
    total = micro_batch.input_ids.shape[-1]
    cu = torch.tensor([0, total], dtype=torch.int32, device=micro_batch.input_ids.device)
    one = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=total, max_seqlen_kv=total)
    return declare_boundaries(micro_batch, one)


def with_megatron_ddp(model):
    """`model` in Megatron's DistributedDataParallel, the schedule ending with `finalize_model_grads`
    (the tied word-embedding grads summed over the first and last stages, DP reductions, / tokens)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    model.config.finalize_model_grads_func = finalize_model_grads
    return DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)


def packed_through_schedule(model, batches: list[dict], pad_to: int | None, transform=None):
    """Forward + backward of every micro-batch through the shipped step and Megatron's schedule
    (`pad_to` None: real lengths, for a model config with `variable_seq_lengths`).

    Returns [loss sum, tokens] float64 summed over micro-batches on the last stage, zeros elsewhere.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vlm_packing import make_forward_step

    reports = get_forward_backward_func()(
        forward_step_func=make_forward_step(pack=True, label_style="hf", pad_to=pad_to, transform=transform),
        data_iterator=iter(batches), model=[model], num_microbatches=len(batches), seq_length=pad_to or 0,
        micro_batch_size=1, forward_only=False)
    out = torch.zeros(2, dtype=torch.float64)
    if ps.is_pipeline_last_stage():
        if len(reports) != len(batches):
            raise ValueError(f"the last stage reported {len(reports)} micro-batches, expected {len(batches)}")
        out = torch.stack([r["lm loss"] for r in reports]).sum(0).double()
    return out


def _compare(loss_tokens: torch.Tensor, reference, grads: dict, towers: tuple[str, ...]) -> dict:
    """|dloss|, token counts and worst relative grad errors over every rank; names compared anywhere."""
    ref_loss, ref_tokens, ref_grads, _ = reference
    # Relative to each tensor's own scale, floored at 1e-6 of the model's largest gradient: gradients
    # that are zero in exact arithmetic (attention key biases: softmax ignores a per-query constant;
    # Omni's audio k_proj bias is 3e-11 here) carry only rounding noise.
    floor = 1e-6 * max(g.abs().max().item() for g in ref_grads.values())
    errors = {n: ((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(floor)).item()
              for n, g in grads.items()}
    tower = [e for n, e in errors.items() if n.startswith(towers)]
    worst = torch.tensor([abs(loss_tokens[0].item() - ref_loss.item()) if loss_tokens[1] else 0.0,
                          loss_tokens[1].item(), max(errors.values(), default=0.0), max(tower, default=0.0)],
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    names, worst_names = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(grads))
    mine = sorted(errors, key=errors.get)[-3:]
    dist.all_gather_object(worst_names, [(errors[n], n, ref_grads[n].abs().max().item()) for n in mine])
    compared = set().union(*map(set, names))
    return dict(abs_dloss=worst[0].item(), tokens=int(worst[1]), ref_tokens=ref_tokens, loss=ref_loss.item(),
                max_rel_grad_err=worst[2].item(), max_rel_tower_grad_err=worst[3].item(),
                params=len(compared), tower_params=sum(n.startswith(towers) for n in compared),
                missing=sorted(set(ref_grads) - compared),
                worst_params=sorted(w for part in worst_names for w in part)[-3:])


def pp_case(case: tuple, samples: list[dict], reference) -> dict:
    """One case: (family, tp, pp, sp[, "cp2"][, "variable"][, "control"][, "tied"]). "cp2": context
    parallel 2 as well; "variable": real packed lengths, p2p shapes exchanged per micro-batch
    (`variable_seq_lengths`) instead of a fixed `pad_to`; "control": `one_document_on_later_stages` (the
    comparison must fail); "tied": tied word embeddings, trained in Megatron's DDP with
    `finalize_model_grads` (the gradients read from `main_grad`, times the token count)."""
    import time

    start = time.perf_counter()
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.bridge.truth import TOWERS, build_family
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.parity import full_gradients, load_full_state

    family, tp, pp, sp = case[:4]
    cp, variable, tied = (2 if "cp2" in case[4:] else 1), "variable" in case[4:], "tied" in case[4:]
    initialize_parallel(tp=tp, cp=cp, pp=pp, seed=SEED)
    cfg = tiny_config(family, tp=tp, cp=cp, pp=pp, sp=sp, tied=tied)
    model = build_family(family, cfg, seed=SEED + 1)  # other weights: load_full_state must set them all
    load_full_state(model, reference[3], tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp)
    model.config.variable_seq_lengths = variable
    batches = micro_batches(family, samples)
    transform = one_document_on_later_stages if "control" in case[4:] else None
    loss_tokens = packed_through_schedule(with_megatron_ddp(model) if tied else model, batches,
                                          None if variable else fixed_length(batches, cfg), transform)
    cp_group = ps.get_context_parallel_group()
    dist.all_reduce(loss_tokens, group=cp_group)  # each CP rank holds its tokens' part
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(), cp_group=cp_group,
                           reduced_by_megatron=tied)
    if tied:  # finalize_model_grads divided by the token count (over DP too: every DP rank ran the same data)
        grads = {name: grad * reference[1] for name, grad in grads.items()}
    result = _compare(loss_tokens, reference, grads, TOWERS[family])
    result.update(case=case, stage=f"{type(model).__name__} x {pp} stages", micro_batches=len(batches),
                  seconds=round(time.perf_counter() - start, 1))
    return result


def refusal(case: tuple) -> dict:
    """(family, tp, pp, sp, "refused"): the family with 2 language layers (1 per stage, fewer than its 2
    deepstack levels) is built per stage; what `adapter_for` says on each pipeline stage."""
    from dataclasses import replace

    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.bridge.truth import build_family
    from megatron_vlm_packing.models.adapter import adapter_for
    from megatron_vlm_packing.testing.distributed import initialize_parallel

    family, tp, pp, sp = case[:4]
    initialize_parallel(tp=tp, pp=pp, seed=SEED)
    model = build_family(family, replace(tiny_config(family, tp=tp, pp=pp, sp=sp), num_layers=2), seed=SEED)
    try:
        adapter_for(model)
        message = None
    except ValueError as err:
        message = str(err)
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, (ps.get_pipeline_model_parallel_rank(), message))
    return dict(case=case, refused=dict(sorted(set(said))))


def run_bridge_pp_parity(rank: int, world_size: int, cases: list[tuple]) -> list[dict]:
    """Every case (one truth per family); the patches Bridge needs applied for the launch."""
    from megatron_vlm_packing.bridge.truth import family_samples
    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import (
        apply_bridge_qwen3_omni_packed, undo_bridge_qwen3_omni_packed,
    )

    import time

    results, truths, seconds = [], {}, {}
    apply_bridge_patches()
    apply_bridge_qwen3_omni_packed()  # packed only: the truth's dense calls run Bridge's own code
    try:
        for case in cases:
            family = case[0]
            if "refused" in case[4:]:
                results.append(refusal(case))
                continue
            samples = family_samples(family, tiny_config(family), MICRO_BATCHES * SAMPLES_PER_MICRO_BATCH, seed=SEED)
            key = (family, "tied" in case[4:])
            if key not in truths:
                start = time.perf_counter()
                truths[key] = truth(family, samples, tied=key[1])
                seconds[family] = round(time.perf_counter() - start, 1)
            results.append(pp_case(case, samples, truths[key]))
    finally:
        undo_bridge_qwen3_omni_packed()
        undo_bridge_patches()
    for result in results:
        result["truth_seconds"] = seconds.get(result["case"][0])
    return results


FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen25_vl", "qwen3_omni")
ALL_CASES = ([(family, tp, 2, tp > 1) for family in FAMILIES for tp in (1, 2)]
             + [(family, 1, 2, False, "cp2") for family in FAMILIES]
             + [("qwen3_vl", 1, 2, False, "variable"), ("qwen3_vl_moe", 1, 2, False, "variable"),
                ("qwen3_omni", 2, 2, True, "variable"),
                ("qwen3_vl", 1, 2, False, "control")]
             + [(family, 1, 2, False, "tied") for family in ("qwen3_vl", "qwen25_vl", "qwen3_omni")])


def pp_parity_table(results: list[dict]) -> str:
    """Markdown rows: family, layout, |dloss|, worst relative gradient error (all / towers)."""
    rows = ["| model (Bridge 0.6.2) | layout | micro-batches | max abs dloss | max rel grad err "
            "| max rel tower grad err | params compared |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in results if "refused" not in r):
        family, tp, pp, sp = r["case"][:4]
        extras = r["case"][4:]
        layout = f"PP={pp}" + (f" x TP={tp}" if tp > 1 else "") + (" x CP=2" if "cp2" in extras else "")
        layout += (" + SP" if sp else "") + (", real lengths (variable_seq_lengths)" if "variable" in extras else "")
        layout += ", control: later stages ignore the boundaries" if "control" in extras else ""
        layout += ", tied embeddings (DDP + finalize_model_grads)" if "tied" in extras else ""
        rows.append(f"| {family} | {layout} | {r['micro_batches']} | {r['abs_dloss']:.2e} | "
                    f"{r['max_rel_grad_err']:.2e} | {r['max_rel_tower_grad_err']:.2e} | {r['params']} |")
    return "\n".join(rows)


WIDE_CASES = [(family, 2, 2, True, "cp2") for family in FAMILIES]  # PP2 x TP2 x CP2 x SP: 8 processes

if __name__ == "__main__":
    import sys

    from megatron_vlm_packing.testing.distributed import run_distributed

    wide = "--wide" in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    chosen = [c for c in (WIDE_CASES if wide else ALL_CASES) if not names or c[0] in names]
    print(pp_parity_table(run_distributed(run_bridge_pp_parity, 8 if wide else 4, chosen)))
