"""The packed-vs-alone parity suite, runnable under any TP/CP/PP on CPU (gloo) or GPU.

`run_parity_cases(rank, world_size, cases)` is a `run_distributed` target: for every case it
1. builds a TP=CP=PP=1 tiny GPT and runs each sample alone (batch 1, unpadded): per-token losses
   and the gradient of their sum (the truth);
2. builds the case's parallel model, loads the same weights (sharded), runs the same micro-batches
   through the shipped `make_forward_step` and `loss_func` (directly or through Megatron's
   `get_forward_backward_func`), gathers losses and gradients back;
3. reports the worst |dloss|, |dlogit| and relative gradient error over all ranks.
A `corruption` makes one deliberate packing mistake, so tests can prove the check catches it.
A `dense` case feeds the right-padded rows as they are ([B, S], BSHD attention, the dense CP
zigzag per row): causal attention makes real tokens exact there too, and it exercises the dense
CP path (Megatron's own rotary CP slicing under the CPU shim, the reference BSHD all-gather).

Micro-batch lengths are drawn from the case's seed, with a length-1 sample, a row with no real
tokens and a full row always present.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_vlm_packing.models.adapter import adapter_for
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.packing import shift_labels_within_rows
from megatron_vlm_packing.packing.localize import localize
from megatron_vlm_packing.packing.micro_batch import MicroBatch, declare_boundaries
from megatron_vlm_packing.parallel.cp import cp_partition_index, dense_cp_partition_index
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.step import make_forward_step
from megatron_vlm_packing.runtime.launcher import initialize_parallel
from megatron_vlm_packing.testing.parity import full_gradients, gather_in_order, max_relative_error, variable_batch

NUM_MICRO_BATCHES = 2
ROWS = 5
ROW_LENGTH = 12  # a multiple of 2*cp for dense CP cases
CORRUPTIONS = ("uniform_cu_seqlens", "boundary_off_by_one", "labels_shifted_after_packing", "wrong_cp_rank")


@dataclass(frozen=True)
class ParityCase:
    name: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    sp: bool = False
    schedule: bool = False  # through get_forward_backward_func (required when pp > 1)
    dense: bool = False  # right-padded rows as they are, no packing
    ddp: bool = False  # Megatron's DistributedDataParallel + finalize_model_grads reduce the grads (schedule only)
    corruption: str | None = None
    seed: int = 1234

    @property
    def world_needed(self) -> int:
        return self.tp * self.cp * self.pp


def micro_batch_lengths(seed: int) -> list[list[int]]:
    """[NUM_MICRO_BATCHES][ROWS] real lengths in [2, ROW_LENGTH], plus the edge cases every case needs."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(2, ROW_LENGTH + 1, (ROWS,), generator=g).tolist() for _ in range(NUM_MICRO_BATCHES)]
    out[0][1], out[0][2] = 1, 0  # a length-1 sample (no target) and a row with no real tokens
    out[-1][0] = ROW_LENGTH  # a full row
    return out


def micro_batches(vocab_size: int, seed: int) -> list[dict]:
    """HF-style batches (labels = input ids, -100 at pads; shifted per sample by pack_batch)."""
    out = []
    for i, lengths in enumerate(micro_batch_lengths(seed)):
        batch = variable_batch(lengths, ROW_LENGTH, vocab_size=vocab_size, seed=seed + i)
        batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
        out.append(batch)
    return out


def reference_alone(cfg: TinyGPTConfig, batches: list[dict], seed: int):
    """Single-process truth: per-token losses (list per micro-batch, real targets only) and grads."""
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    model = build_tiny_gpt(cfg)
    losses, logits = [], []
    for batch in batches:
        keep = batch["attention_mask"].bool()
        labels = shift_labels_within_rows(batch["labels"], keep)
        per_batch, per_batch_logits = [], []
        for row, n in enumerate(keep.sum(1).tolist()):
            if n == 0:
                continue
            ids, lab = batch["input_ids"][row:row + 1, :n], labels[row:row + 1, :n]
            loss = model(ids, torch.arange(n)[None], None, labels=lab)  # [1, n]
            valid = lab != -100
            (loss * valid).sum().backward()
            per_batch.append(loss.detach()[valid])
            with torch.no_grad():
                per_batch_logits.append(model(ids, torch.arange(n)[None], None)[0])  # [n, V]
        losses.append(torch.cat(per_batch))
        logits.append(torch.cat(per_batch_logits))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return losses, grads, state, logits


def load_sharded(model: torch.nn.Module, state: dict, tp_rank: int, tp_size: int) -> None:
    """Copy full reference weights into a (TP-sharded, PP-stage) model."""
    from megatron_vlm_packing.testing.parity import global_name

    with torch.no_grad():
        for name, param in model.named_parameters():
            full = state[global_name(model, name)]
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
            param.copy_(full)


def _with_cu_seqlens(params, cu: torch.Tensor, cu_padded: torch.Tensor):
    longest = int((cu_padded[1:] - cu_padded[:-1]).max())  # shifted documents may be longer
    return replace(params, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                   cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(longest, params.max_seqlen_q),
                   max_seqlen_kv=max(longest, params.max_seqlen_kv))


def corrupt(case: ParityCase, mb: MicroBatch) -> MicroBatch:
    """Apply the case's one deliberate mistake to a full-length packed micro-batch. Boundaries are broken through
    `declare_boundaries`: the step refuses boundaries other than the plan's, and these cases show that the parity
    check itself catches them."""
    params, total = mb.packed_seq_params, mb.stats.physical_tokens
    if case.corruption == "uniform_cu_seqlens":  # rows relaid at a fixed stride: boundaries ignore samples
        cu = torch.tensor(list(range(0, total, ROW_LENGTH)) + [total], dtype=torch.int32,
                          device=mb.input_ids.device)
        return declare_boundaries(mb, _with_cu_seqlens(params, cu, cu))
    if case.corruption == "boundary_off_by_one":
        shift = torch.zeros_like(params.cu_seqlens_q)
        shift[1:-1] = 1
        return declare_boundaries(mb, _with_cu_seqlens(params, params.cu_seqlens_q + shift,
                                                       params.cu_seqlens_q_padded + shift))
    if case.corruption == "labels_shifted_after_packing":  # the hand-rolled packer's mistake
        ids = mb.input_ids
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        labels = torch.where(mb.padding_mask, -100, labels)
        return replace(mb, labels=labels, loss_mask=(labels != -100).float())
    if case.corruption == "wrong_cp_rank":  # rank r gets the labels of rank cp-1-r
        cu_padded = params.cu_seqlens_q_padded
        labels, loss_mask = mb.labels.clone(), mb.loss_mask.clone()
        for rank in range(case.cp):
            mine, theirs = (cp_partition_index(cu_padded, case.cp, r) for r in (rank, case.cp - 1 - rank))
            labels[:, mine], loss_mask[:, mine] = mb.labels[:, theirs], mb.loss_mask[:, theirs]
        return replace(mb, labels=labels, loss_mask=loss_mask)
    return mb


def cp_order(mb: MicroBatch, cp_size: int) -> torch.Tensor:
    """[T] (packed) or [L] (dense rows): every CP rank's partition index concatenated in rank order."""
    if mb.is_packed:
        cu_padded = mb.packed_seq_params.cu_seqlens_q_padded
        return torch.cat([cp_partition_index(cu_padded, cp_size, r) for r in range(cp_size)])
    length = mb.input_ids.shape[-1]
    return torch.cat([dense_cp_partition_index(length, cp_size, r) for r in range(cp_size)])


def make_step(case: ParityCase, seen: list):
    """The shipped forward step; its micro-batches (full length, after the case's corruption) go to `seen`."""
    def observe(mb: MicroBatch) -> MicroBatch:
        mb = corrupt(case, mb)
        seen.append(mb)
        return mb

    return make_forward_step(pack=not case.dense, pad_to=64 if case.pp > 1 else None, transform=observe)


def run_schedule(case: ParityCase, model, batches: list[dict], seen: list, outputs: list) -> None:
    """Forward + backward of every micro-batch through Megatron's `get_forward_backward_func`.

    With `case.ddp`, `model` is wrapped in Megatron's `DistributedDataParallel` and the schedule
    ends with `finalize_model_grads` (SP norm and DP x CP grad reductions, divided by the token count).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if case.ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads

        model.config.finalize_model_grads_func = finalize_model_grads
        model = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(), module=model)
    step = make_step(case, seen)

    def recording_step(data_iterator, model):
        output, loss = step(data_iterator, model)
        if ps.is_pipeline_last_stage():
            outputs.append(output.detach())
        return output, loss

    get_forward_backward_func()(forward_step_func=recording_step, data_iterator=iter(batches), model=[model],
                                num_microbatches=len(batches), seq_length=64 if case.pp > 1 else ROW_LENGTH,
                                micro_batch_size=1, forward_only=False)


def run_packed(case: ParityCase, cfg: TinyGPTConfig, batches: list[dict], state: dict):
    """Per-micro-batch [1, T/cp] losses (last stage, else None) and the gathered gradients (sums)."""
    from megatron.core import parallel_state as ps

    if case.ddp and not case.schedule:
        raise ValueError(f"case {case.name}: ddp=True needs schedule=True (finalize_model_grads runs there)")
    initialize_parallel(tp=case.tp, cp=case.cp, pp=case.pp, seed=case.seed)
    cfg = replace(cfg, tensor_parallel=case.tp, context_parallel=case.cp, pipeline_parallel=case.pp,
                  sequence_parallel=case.sp)
    model = build_tiny_gpt(cfg, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    load_sharded(model, state, ps.get_tensor_model_parallel_rank(), case.tp)
    seen, outputs = [], []
    if case.schedule:
        run_schedule(case, model, batches, seen, outputs)
    else:
        step = make_step(case, seen)
        for batch in batches:
            output, loss = step(iter([batch]), model)
            loss(output)[0].backward()
            outputs.append(output.detach())
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group(),
                           cp_group=ps.get_context_parallel_group(), reduced_by_megatron=case.ddp)
    if case.ddp:  # finalize_model_grads divided by the global target count: back to sums
        num_tokens = sum(mb.loss_mask.sum() for mb in seen)
        grads = {name: grad * num_tokens for name, grad in grads.items()}
    return seen, outputs, grads, model


NOT_CHECKED = -1.0  # all-reduced with MAX, then reported as None ("-" in the table), never as 0


def run_case(case: ParityCase, cfg: TinyGPTConfig) -> dict:
    """Worst |dloss|, relative grad error and |dlogit| (None where not checked: PP, corruptions)."""
    from megatron.core import parallel_state as ps

    batches = micro_batches(cfg.vocab_size, case.seed)
    ref_losses, ref_grads, state, ref_logits = reference_alone(cfg, batches, case.seed)
    mbs, outputs, grads, model = run_packed(case, cfg, batches, state)
    cp_group = ps.get_context_parallel_group()
    dloss = torch.zeros(())
    for mb, out, ref in zip(mbs, outputs, ref_losses):
        full = gather_in_order(out, cp_order(mb, case.cp), cp_group)  # [1, T] or [B, L]
        got = full[mb.loss_mask.bool()]
        dloss = torch.maximum(dloss, (got - ref).abs().max() if got.shape == ref.shape else torch.tensor(float("inf")))
    logit_err = torch.tensor(NOT_CHECKED)
    if ps.is_pipeline_last_stage() and case.pp == 1 and case.corruption is None:
        logit_err = packed_logits_error(model, mbs, ref_logits, case.cp)
    grad_err = torch.zeros(())
    for name, grad in grads.items():
        grad_err = torch.maximum(grad_err, torch.tensor(max_relative_error(grad, ref_grads[name])))
    worst = torch.stack([dloss, grad_err, logit_err])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dlogit = worst[2].item()
    return dict(case=case.name, max_dloss=worst[0].item(), max_rel_grad_err=worst[1].item(),
                max_dlogit=None if dlogit == NOT_CHECKED else dlogit, checked_params=len(grads))


def packed_logits_error(model, mbs: list[MicroBatch], ref_logits, cp_size: int) -> torch.Tensor:
    """Worst |logit| difference at real tokens: vocab shards gathered over TP, tokens over CP.

    Each recorded micro-batch is localized and run by the model's own adapter without labels.
    """
    from megatron.core import parallel_state as ps

    adapter = adapter_for(model)
    layout = ParallelLayout.from_megatron(model.config)
    tp_group = ps.get_tensor_model_parallel_group()
    worst = torch.zeros(())
    with torch.no_grad():
        for mb, ref in zip(mbs, ref_logits):
            local = adapter.forward(model, replace(localize(mb, layout, adapter.needs), labels=None))  # [B, L/cp, V/tp]
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            full = gather_in_order(torch.cat(parts, dim=-1), cp_order(mb, cp_size), ps.get_context_parallel_group())
            worst = torch.maximum(worst, (full[~mb.padding_mask] - ref).abs().max())
    return worst


def run_parity_cases(rank: int, world_size: int, cases: list[ParityCase], cfg: TinyGPTConfig | None = None):
    """`run_distributed` target: run every case, return a list of result dicts (rank 0)."""
    cfg = cfg or TinyGPTConfig()
    results = []
    for case in cases:
        if world_size % case.world_needed:
            raise ValueError(f"case {case.name} needs a multiple of {case.world_needed} processes, got {world_size}")
        try:
            results.append(run_case(case, cfg))
        except Exception as err:
            raise RuntimeError(f"parity case {case.name!r} failed: {err}") from err
    return results
