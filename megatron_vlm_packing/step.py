"""The forward step users register: `make_forward_step(...) -> forward_step(data_iterator, model)`.

Works with Megatron-LM's `pretrain`, `megatron.core.pipeline_parallel.get_forward_backward_func`
and (with `with_state=True`) Megatron-Bridge's `(state, data_iterator, model)` form. A chain of
small stages, each testable alone:

    read_micro_batch -> to_device -> pack (or pad densely) -> select CP tokens -> call model -> loss

Process groups are looked up here, at the edge; everything below takes ints.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch

from megatron_vlm_packing.packing import pack_batch, padded_length, pad_or_truncate_rows, shift_labels_within_rows
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.parallel.cp import cp_partition_index, dense_cp_partition_index

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    cp_size: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False

    @classmethod
    def from_megatron(cls, config) -> "ParallelLayout":
        from megatron.core import parallel_state as ps

        return cls(tp_size=ps.get_tensor_model_parallel_world_size(), cp_size=ps.get_context_parallel_world_size(),
                   cp_rank=ps.get_context_parallel_rank(), sequence_parallel=bool(config.sequence_parallel))


def loss_func(loss_mask: torch.Tensor, stats: dict, output_tensor):
    """Contract item 9: `(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens], ...})`.

    Per-token averaging stays exact across micro-batches, DP and CP ranks (Megatron sums both
    parts). A model returning `(losses, loss_mask)` has its own mask honoured. The extra entry
    "packing efficiency" = [real tokens, physical tokens] logs as their ratio.
    """
    if isinstance(output_tensor, tuple):
        output_tensor, loss_mask = output_tensor
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}
    report["packing efficiency"] = torch.tensor([float(stats["real_tokens"]), float(stats["physical_tokens"])],
                                                device=loss_sum.device)
    if "padded_tokens" in stats:  # what right-padded rows would have cost, for comparison
        report["padding efficiency"] = torch.tensor([float(stats["real_tokens"]), float(stats["padded_tokens"])],
                                                    device=loss_sum.device)
    return loss_sum, num_tokens, report


def read_micro_batch(data_iterator: Iterator, *, broadcast_from_tp_rank0: bool) -> dict:
    """Every rank reads its (deterministic) iterator, or TP rank 0 reads and broadcasts the batch."""
    if not broadcast_from_tp_rank0:
        return next(data_iterator)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    holder = [next(data_iterator) if ps.get_tensor_model_parallel_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=ps.get_tensor_model_parallel_src_rank(),
                               group=ps.get_tensor_model_parallel_group())
    return holder[0]


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def batch_rows_tokens(batch: dict) -> int:
    """Slots the batch's right-padded rows occupy (what padding instead of packing would cost)."""
    ids = batch.get("input_ids", batch.get("tokens"))
    return ids.numel()


def packed_inputs(batch: dict, layout: ParallelLayout, *, label_style: str, pad_to, fp8: bool, mrope) -> dict:
    """Pack and select this CP rank's tokens; `input_ids` stay full for the model to merge vision."""
    packed = pack_batch(batch, tp_size=layout.tp_size, cp_size=layout.cp_size,
                        sequence_parallel=layout.sequence_parallel, fp8=fp8, pad_to=pad_to,
                        label_style=label_style, mrope=mrope)
    index = None
    if layout.cp_size > 1:
        index = cp_partition_index(packed.packed_seq_params.cu_seqlens_q_padded, layout.cp_size, layout.cp_rank)
    local = (lambda x: x) if index is None else (lambda x: x.index_select(-1, index))
    # mRoPE positions [3, 1, T] stay full length, like input_ids: the packed rotary returns the full
    # frequency table and THD attention takes each document's CP chunks from it (rope/rotary.py).
    positions = packed.position_ids if packed.position_ids.dim() == 3 else local(packed.position_ids)
    return dict(input_ids=packed.input_ids, position_ids=positions, labels=local(packed.labels),
                loss_mask=local(packed.loss_mask), padding_mask=local(packed.padding_mask),
                packed_seq_params=packed.packed_seq_params, rope_cu_seqlens=packed.rope_cu_seqlens,
                cp_index=index, real_tokens=packed.num_real_tokens, physical_tokens=packed.num_physical_tokens,
                padded_tokens=batch_rows_tokens(batch))


def dense_inputs(batch: dict, layout: ParallelLayout, *, label_style: str, seq_length, fp8: bool) -> dict:
    """Packing off: right-padded rows of one aligned length, the dense CP zigzag per row."""
    ids = batch.get("input_ids", batch.get("tokens"))
    keep = batch["attention_mask"].bool() if batch.get("attention_mask") is not None else torch.ones_like(ids, dtype=torch.bool)
    labels = shift_labels_within_rows(batch["labels"], keep) if label_style == "hf" else batch["labels"]
    multiple = PackMultiples.for_parallel(tp_size=layout.tp_size, cp_size=layout.cp_size,
                                          sequence_parallel=layout.sequence_parallel, fp8=fp8).total
    length = padded_length(ids.shape[1], multiple, seq_length=seq_length)
    ids, labels = pad_or_truncate_rows(ids, length), pad_or_truncate_rows(labels, length, pad_value=-100)
    keep = pad_or_truncate_rows(keep, length, pad_value=False)
    loss_mask = (keep & (labels != -100)).float()
    positions = torch.arange(length, device=ids.device).expand_as(ids)
    index = None
    if layout.cp_size > 1:
        index = dense_cp_partition_index(length, layout.cp_size, layout.cp_rank, device=ids.device)
    local = (lambda x: x) if index is None else (lambda x: x.index_select(-1, index))
    return dict(input_ids=ids, position_ids=local(positions), labels=local(labels), loss_mask=local(loss_mask),
                padding_mask=local(~keep), packed_seq_params=None, rope_cu_seqlens=None, cp_index=index,
                real_tokens=int(keep.sum()), physical_tokens=ids.numel(), padded_tokens=ids.numel())


def call_model(model, inputs: dict, vision: dict):
    """Call `model` with only the keywords its forward accepts.

    A model that takes `cp_index` (PackedVLM) gets the full `input_ids`; a plain GPTModel gets
    this CP rank's ids. The padding mask goes as `moe_padding_mask` to models that take it
    (Megatron-Bridge's name), else as `padding_mask` (Megatron-Core's MoE router keyword).
    """
    target = model
    while hasattr(target, "module"):  # look through DDP / Float16Module wrappers
        target = target.module
    params = inspect.signature(type(target).forward).parameters
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    ids = inputs["input_ids"]
    if "cp_index" not in params and inputs["cp_index"] is not None:
        ids = ids.index_select(-1, inputs["cp_index"])
    candidates = dict(input_ids=ids, position_ids=inputs["position_ids"], attention_mask=None,
                      labels=inputs["labels"], packed_seq_params=inputs["packed_seq_params"],
                      cp_index=inputs["cp_index"], rope_cu_seqlens=inputs["rope_cu_seqlens"], **vision)
    pad_key = "moe_padding_mask" if "moe_padding_mask" in params else "padding_mask"
    candidates[pad_key] = inputs["padding_mask"]
    kwargs = {k: v for k, v in candidates.items() if accepts_any or k in params}
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "attention_mask"}
    return model(**kwargs)


def make_forward_step(*, pack: bool = True, label_style: str = "hf", pad_to: int | None = None,
                      seq_length: int | None = None, fp8: bool = False, mrope=None,
                      broadcast_from_tp_rank0: bool = False, with_state: bool = False) -> Callable:
    """Build a Megatron forward step.

    Args:
        pack: real-length THD packing (True) or dense right-padded rows (False).
        label_style: "hf" (unshifted labels, shifted inside each sample) or "megatron".
        pad_to: fixed packed length (static shapes: PP > 1, EP > 1, CUDA graphs).
        seq_length: fixed dense row length when `pack=False`.
        mrope: `rope.MRopeConfig` or a callable giving [3, B, S] positions per sample alone.
        broadcast_from_tp_rank0: TP rank 0 reads the iterator and broadcasts (Megatron-LM style).
        with_state: return the `(state, data_iterator, model)` form (Megatron-Bridge).

    Returns:
        `forward_step(data_iterator, model) -> (output_tensor, loss_func)`.
    """
    def forward_step(data_iterator, model):
        config = getattr(model, "config", None) or model.module.config
        layout = ParallelLayout.from_megatron(config)
        batch = read_micro_batch(data_iterator, broadcast_from_tp_rank0=broadcast_from_tp_rank0)
        batch = to_device(batch, next(model.parameters()).device)
        if pack:
            inputs = packed_inputs(batch, layout, label_style=label_style, pad_to=pad_to, fp8=fp8, mrope=mrope)
        else:
            inputs = dense_inputs(batch, layout, label_style=label_style, seq_length=seq_length, fp8=fp8)
        vision = {k: batch[k] for k in VISION_KEYS if batch.get(k) is not None}
        output = call_model(model, inputs, vision)
        stats = {k: inputs[k] for k in ("real_tokens", "physical_tokens", "padded_tokens")}
        return output, partial(loss_func, inputs["loss_mask"], stats)

    if with_state:
        def forward_step_with_state(state: Any, data_iterator, model):
            return forward_step(data_iterator, model)

        return forward_step_with_state
    return forward_step
