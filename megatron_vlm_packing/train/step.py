"""The forward step users register: `make_forward_step(...) -> forward_step(data_iterator, model)`.

Works with Megatron-LM's `pretrain`, `megatron.core.pipeline_parallel.get_forward_backward_func`
and (with `with_state=True`) Megatron-Bridge's `(state, data_iterator, model)` form. A chain of
small named stages, each testable alone:

    read_micro_batch                      (the iterator's item: a collated dict or a packed MicroBatch)
      -> micro_batch_for_model            (`build.py`: full-length MicroBatch on the model's device:
           to_device -> adapter.build_micro_batch | build_micro_batch (pack_batch | pad_batch),
           or, for a MicroBatch packed in the DataLoader, check_loader_vocab (`loader_vocab.py`)
           -> adapter.micro_batch_from_loader)
      -> transform (optional)
      -> prepare_for_model                (check_unpacked_loss_weights -> adapter.check -> localize:
                                           the one CP selection)
      -> adapter.forward -> loss_func     (-> probe_parity every N-th micro-batch, when asked)

An iterator may yield an already-packed `MicroBatch` (`packing.collate.PackingCollator`, or
`models.llava_pack.LlavaPackingCollator`, in the DataLoader's workers): it is checked against the
layout and moved (non-blocking), not re-packed.

The model's adapter (`models.adapter.adapter_for`, through DDP / Float16Module wrappers, or the
`adapter=` given) declares what the model consumes and in which form; nothing is chosen by
reading a forward's signature, and an input the adapter does not consume is a ValueError naming
it (bug class 10). Process groups are looked up here, at the edge; everything below takes ints.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from megatron_vlm_packing.models.adapter import ModelAdapter, adapter_for, check_unpacked_ids, unwrap_model
from megatron_vlm_packing.packing.collate import own_storages
from megatron_vlm_packing.packing.localize import localize
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.packing.row_fields import check_flags
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.train.build import BuiltMicroBatch, StepOptions, micro_batch_for_model
from megatron_vlm_packing.train.build import (  # noqa: F401 (importable from here, as before)
    build_micro_batch, extra_keys_of, resolve_mrope, to_device,
)
from megatron_vlm_packing.train.loader_vocab import check_loader_vocab  # noqa: F401 (as before)
from megatron_vlm_packing.train.loss import loss_func
from megatron_vlm_packing.train.pipeline_shapes import check_for_pipeline
from megatron_vlm_packing.train.unpacked_checks import (  # noqa: F401 (importable from here, as before)
    check_packed_documents, check_unpacked_dense_positions, check_unpacked_fields, check_unpacked_labels,
    check_unpacked_loss_weights, check_unpacked_packed_positions)
from megatron_vlm_packing.validate.step_probe import StepProbe


def _iterator(data_iterator) -> Iterator:
    """`data_iterator` itself, if it is an iterator. None (a pipeline stage given no data) or an iterable
    such as a list was a TypeError from `next()`; an iterable is not wrapped with `iter()`, which
    would restart it and yield its first batch on every step."""
    if not hasattr(type(data_iterator), "__next__"):  # what next() needs (some iterators lack __iter__)
        raise ValueError(f"data_iterator must be an iterator (next() gives each micro-batch), got "
                         f"{type(data_iterator).__name__}; pass iter(...) of your batches or a DataLoader's iterator")
    return data_iterator


def read_micro_batch(data_iterator: Iterator, *, broadcast_from_tp_rank0: bool) -> dict | MicroBatch:
    """The iterator's next item: every rank reads its (deterministic) iterator, or TP rank 0 reads and
    broadcasts it. Returns a collated batch dict or a packed `MicroBatch`; anything else is a ValueError.
    An exhausted iterator's StopIteration propagates unchanged, as from Megatron-LM's and Megatron-Bridge's
    own steps (`next(data_iterator)`): a loop may catch it to end an epoch."""
    if not broadcast_from_tp_rank0:
        batch = next(_iterator(data_iterator))
    else:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        # Only TP rank 0 reads: the other ranks' iterators may be None (Megatron-LM's convention).
        reader = ps.get_tensor_model_parallel_rank() == 0
        read = next(_iterator(data_iterator)) if reader else None
        # Pickle writes a tensor's whole storage with it: each view of a collated micro-batch's one buffer
        # would carry all of it (the buffer about ten times over). Sent as tensors of their own; kept as read.
        holder = [own_storages(read) if isinstance(read, MicroBatch) else read]
        dist.broadcast_object_list(holder, src=ps.get_tensor_model_parallel_src_rank(),
                                   group=ps.get_tensor_model_parallel_group())
        batch = read if reader else holder[0]
    # Any mapping, as pack_batch and the collators take: a Hugging Face processor's BatchFeature is a UserDict.
    if not isinstance(batch, (Mapping, MicroBatch)):
        raise ValueError(f"the data iterator must yield a dict of tensors (a collated batch) or a packed "
                         f"MicroBatch, got {type(batch).__name__}")
    return batch


def prepare_for_model(micro_batch: MicroBatch, adapter: ModelAdapter, layout: ParallelLayout) -> MicroBatch:
    """Refuse loss weights and labels no packer checked, other sequence fields that are no tensors, positions no
    packer made and packed boundaries that are not the plan's (`train.unpacked_checks.check_unpacked_fields`: one
    host sync for all) and what the model cannot take
    (`adapter.check`), then cut the full-length micro-batch to this CP rank as the adapter declares (`localize`);
    returns the rank-local micro-batch."""
    vocab_size, checks_ids = getattr(adapter, "vocab_size", None), getattr(adapter, "checks_unpacked_ids", False)
    unembedded = getattr(adapter, "unembedded_token_id", None)  # LLaVA's image token: never embedded, not screened
    # one host sync for all, if any runs (the ids too, when the adapter checks them); boundaries it found equal to
    # the plan's become the plan's own tensors
    micro_batch = check_unpacked_fields(micro_batch, vocab_size, ids=checks_ids, unembedded_token_id=unembedded)
    adapter.check(micro_batch)  # names a bad id after its other refusals (reading the ids again: the error path only)
    if checks_ids:  # declared but not made by check(): no read for clean ids
        check_unpacked_ids(micro_batch, vocab_size, unembedded_token_id=unembedded)
    return localize(micro_batch, layout, adapter.needs)


def probe_parity(probe: StepProbe, model: nn.Module, adapter: ModelAdapter, layout: ParallelLayout,
                 built: BuiltMicroBatch, micro_batch: MicroBatch) -> None:
    """Run the parity probe on `micro_batch` (the step's, after `transform`): the same build and model
    call for the pack and for each sample of `built.batch` alone (`validate.StepProbe`), each sample with its own
    media by the packer's counts (`built.micro_batch`'s, untouched by `transform`)."""
    probe(model, built.batch, micro_batch, pack=built.repack, split_by=built.micro_batch,
          forward=lambda mb: adapter.forward(model, prepare_for_model(mb, adapter, layout)))


class _Adapters:
    """The adapter of each model the step is called with, built once per model object."""

    def __init__(self, given):
        if given is not None and not isinstance(given, ModelAdapter) and not callable(given):
            raise ValueError(f"adapter must be a ModelAdapter or a factory model -> ModelAdapter, got {given!r}")
        self.given, self.built = given, {}

    def __call__(self, model: nn.Module) -> ModelAdapter:
        key = id(model)
        if key not in self.built:
            if self.given is None:
                adapter = adapter_for(model)
            elif isinstance(self.given, ModelAdapter):
                adapter = self.given
            else:  # a factory (`__init__` refused anything else)
                adapter = self.given(unwrap_model(model))
            if not isinstance(adapter, ModelAdapter):
                raise ValueError(f"the adapter factory returned {type(adapter).__name__}, not a ModelAdapter")
            self.built[key] = (model, adapter)  # the model is held so its id is never reused
        return self.built[key][1]


def _config_of(model: nn.Module):
    """The (unwrapped) model's Megatron config; a model without one was an AttributeError in the step."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None or not hasattr(config, "sequence_parallel"):
        raise ValueError(f"{type(unwrap_model(model)).__name__} has no Megatron TransformerConfig at .config "
                         f"(got {type(config).__name__}): the step reads the parallel layout from it")
    return config


def _device_of(model: nn.Module) -> torch.device:
    """Where the model's parameters live; a model without any was a StopIteration out of the step."""
    parameter = next(model.parameters(), None)
    if parameter is None:
        raise ValueError(f"{type(unwrap_model(model)).__name__} has no parameters: the step moves each "
                         f"micro-batch to the model's device")
    return parameter.device


def _transformed(transform: Callable[[MicroBatch], MicroBatch], micro_batch: MicroBatch) -> MicroBatch:
    """`transform(micro_batch)`, which must be a MicroBatch (anything else was an AttributeError in the checks)."""
    result = transform(micro_batch)
    if not isinstance(result, MicroBatch):
        raise ValueError(f"transform must return a MicroBatch, got {type(result).__name__}")
    return result


def make_forward_step(*, pack: bool = True, label_style: str = "hf", pad_to: int | None = None,
                      seq_length: int | None = None, fp8: bool = False, mrope=None,
                      broadcast_from_tp_rank0: bool = False, with_state: bool = False, adapter=None,
                      transform: Callable[[MicroBatch], MicroBatch] | None = None,
                      parity_probe_every: int | None = None, parity_probe_tolerance: float | None = None,
                      megatron_lm_pad_id: int | None = None) -> Callable:
    """Build a Megatron forward step.

    Args:
        pack: real-length THD packing (True) or dense right-padded rows (False).
        label_style: "hf" (unshifted labels, shifted inside each sample) or "megatron".
        pad_to: fixed packed length (static shapes: PP > 1, EP > 1, CUDA graphs). At PP > 1 without the model
            config's `variable_seq_lengths` it must be the pipeline schedule's `seq_length`, and is required where
            the step cannot read that (`train.pipeline_shapes`: a ValueError naming both, before the model runs).
        seq_length: fixed dense row length when `pack=False` (shorter than a real row is a ValueError); at PP > 1
            the same rule as `pad_to`.
        mrope: `rope.MRopeConfig` or a callable giving [3, B, S] positions per sample alone; defaults
            to the model's own (`PackedVLM(mrope=...)`). A ValueError for a model with 1D rotary.
        broadcast_from_tp_rank0: TP rank 0 reads the iterator and broadcasts (Megatron-LM style).
        with_state: return the `(state, data_iterator, model)` form (Megatron-Bridge).
        adapter: a `ModelAdapter` (or a factory `model -> ModelAdapter`) overriding the registry.
        transform: applied to each full-length micro-batch before the checks and `localize` (to
            observe micro-batches, or for tests that make one deliberate mistake).
        parity_probe_every: every N-th micro-batch also runs packed and each sample alone without
            gradients (`validate.StepProbe`); the per-token loss difference is printed and, above
            `parity_probe_tolerance`, raises `validate.ParityProbeError` with the validator's report
            (None: 1e-4 for a float32 model, 5e-2 for bf16 / fp16 parameters, `validate.default_tolerance`).
            Needs cp = 1 and one pipeline stage.
        megatron_lm_pad_id: the Megatron-LM tokenizer's pad id (`get_tokenizer().pad`), to read LLaVA batches as
            Megatron-LM's examples/multimodal TaskEncoder collates them (with label_style="megatron";
            `models.llava_mlm_batch`); a ValueError for a model whose adapter does not take them.

    Returns:
        `forward_step(data_iterator, model) -> (output_tensor, loss_func)`.
    """
    options = StepOptions(pack=pack, label_style=label_style, pad_to=pad_to, seq_length=seq_length, fp8=fp8,
                          mrope=mrope, megatron_lm_pad_id=megatron_lm_pad_id)
    # Checked here, not at the first call: a truthy string ("False") would pick the other form or
    # reader, and a non-callable transform was a TypeError inside the step.
    check_flags(with_state=with_state, broadcast_from_tp_rank0=broadcast_from_tp_rank0)
    if transform is not None and not callable(transform):
        raise ValueError(f"transform must be a callable MicroBatch -> MicroBatch or None, got {transform!r}")
    adapters = _Adapters(adapter)
    if parity_probe_every is not None and not pack:  # else an AttributeError at the first probe (no boundaries)
        raise ValueError("parity_probe_every compares a pack with each sample alone: it needs pack=True (the step "
                         "was made with pack=False)")
    if parity_probe_every is None and parity_probe_tolerance is not None:  # else accepted (any value) and unused
        raise ValueError(f"parity_probe_tolerance={parity_probe_tolerance!r} is the parity probe's bound, but no probe "
                         f"runs: give parity_probe_every=N too, or drop parity_probe_tolerance")
    probe = None if parity_probe_every is None else StepProbe(parity_probe_every, tolerance=parity_probe_tolerance)

    def step(data_iterator, model, state):
        model_adapter, config = adapters(model), _config_of(model)
        layout = ParallelLayout.from_megatron(config)
        item = read_micro_batch(data_iterator, broadcast_from_tp_rank0=broadcast_from_tp_rank0)
        built = micro_batch_for_model(item, model_adapter, layout, options, _device_of(model),
                                      probing=probe is not None)
        micro_batch = built.micro_batch if transform is None else _transformed(transform, built.micro_batch)
        check_for_pipeline(micro_batch, model_adapter, layout, options, config, state)  # before the first send
        local = prepare_for_model(micro_batch, model_adapter, layout)
        output = model_adapter.forward(model, local)
        if probe is not None:
            probe_parity(probe, model, model_adapter, layout, built, micro_batch)
        return output, partial(loss_func, local.loss_mask, local.stats)

    if with_state:
        def forward_step_with_state(state: Any, data_iterator, model):
            return step(data_iterator, model, state)  # Bridge's state: its loop's seq_length (pipeline_shapes)

        return forward_step_with_state

    def forward_step(data_iterator, model):
        return step(data_iterator, model, None)

    return forward_step
