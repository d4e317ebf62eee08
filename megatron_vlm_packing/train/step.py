"""The forward step users register: `make_forward_step(...) -> forward_step(data_iterator, model)`.

Works with Megatron-LM's `pretrain`, `megatron.core.pipeline_parallel.get_forward_backward_func`
and (with `with_state=True`) Megatron-Bridge's `(state, data_iterator, model)` form. A chain of
small named stages, each testable alone:

    read_micro_batch                      (the iterator's item: a collated dict or a packed MicroBatch)
      -> micro_batch_for_model            (full-length MicroBatch on the model's device:
           to_device -> adapter.build_micro_batch | build_micro_batch (pack_batch | pad_batch),
           or, for a MicroBatch packed in the DataLoader, adapter.micro_batch_from_loader)
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

from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from megatron_vlm_packing.models.adapter import (
    ModelAdapter, adapter_for, check_loader_mrope, check_unpacked_ids, unwrap_model)
from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.collate import own_storages
from megatron_vlm_packing.packing.localize import localize
from megatron_vlm_packing.packing.micro_batch import IdsMark, MicroBatch
from megatron_vlm_packing.packing.row_fields import check_dense_tensors, check_flags, check_pack_arguments
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.train.loss import loss_func
from megatron_vlm_packing.train.unpacked_checks import (  # noqa: F401 (importable from here, as before)
    check_packed_documents, check_unpacked_dense_positions, check_unpacked_fields, check_unpacked_labels,
    check_unpacked_loss_weights, check_unpacked_packed_positions)
from megatron_vlm_packing.validate.step_probe import StepProbe


@dataclass(frozen=True)
class StepOptions:
    """How a collated batch becomes a micro-batch (the arguments of `make_forward_step`)."""

    pack: bool = True
    label_style: str = "hf"
    pad_to: int | None = None
    seq_length: int | None = None
    fp8: bool = False
    mrope: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.pack, bool):  # pack=None ran dense and pack="no" packed, silently
            raise ValueError(f"pack must be a bool, got {self.pack!r}")
        if self.pack and self.seq_length is not None:
            raise ValueError(f"seq_length={self.seq_length} is the dense row length (pack=False); "
                             f"with pack=True use pad_to for a fixed packed length")
        if not self.pack and self.pad_to is not None:
            raise ValueError(f"pad_to={self.pad_to} is the fixed packed length (pack=True); "
                             f"with pack=False use seq_length")
        self._check_values()

    def _check_values(self) -> None:
        """label_style, fp8, pad_to, seq_length and mrope as the packers take them, checked when the step is made,
        not at its first micro-batch (from the DataLoader, pad_to="8" was compared with the pack's length as it was)."""
        pad_to = check_pack_arguments(fp8=self.fp8, label_style=self.label_style, pad_to=self.pad_to, mrope=self.mrope)
        object.__setattr__(self, "pad_to", pad_to)  # an integer scalar as its int, as pack_batch reads it
        if self.seq_length is not None and (not is_int(self.seq_length) or self.seq_length < 1):
            raise ValueError(f"seq_length must be a positive int (the dense row length) or None, "
                             f"got {self.seq_length!r}")
        if self.seq_length is not None:
            object.__setattr__(self, "seq_length", int(self.seq_length))  # a numpy int as its int, as pad_to


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


def to_device(batch: Mapping, device: torch.device) -> dict:
    """Tensors of the batch on `device` (non-tensor values as they are), as a dict.

    Raises:
        ValueError: a sparse, nested or meta tensor (a meta tensor has no values to move: `.to()` was a
            NotImplementedError; the packers refuse the others), naming its key (`row_fields.check_dense_tensors`).
    """
    check_dense_tensors(batch)
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def resolve_mrope(options: StepOptions, adapter: ModelAdapter, batch: dict | None = None):
    """The mRoPE config positions are computed with: the step's, else the model's own (PackedVLM)
    unless the batch already carries [3, B, S] `position_ids` (then those are packed as given).

    Raises:
        ValueError: `mrope=` given for a model whose adapter says its rotary is 1D (the positions
            would be computed and then ignored, or fed to a 1D rotary).
    """
    rotary = getattr(adapter, "rotary", None)
    if options.mrope is not None and rotary == "1d":
        raise ValueError(f"make_forward_step(mrope=...) was given but {adapter.model_name}'s rotary is 1D "
                         f"({type(adapter).__name__}): drop mrope= or build an mRoPE model")
    if options.mrope is not None:
        return options.mrope
    given = (batch or {}).get("position_ids")
    if isinstance(given, torch.Tensor) and given.dim() == 3:
        return None
    return getattr(adapter, "mrope", None)


def build_micro_batch(batch: dict, layout: ParallelLayout, options: StepOptions, *, mrope=None,
                      media_token_ids: dict | None = None, extra_keys: tuple[str, ...] = (),
                      vocab_size: int | None = None) -> MicroBatch:
    """`pack_batch` (real-length THD) or `pad_batch` (dense rows), aligned for `layout`; full length.

    `media_token_ids` (image/video/audio_token_id, spatial_merge_size: the adapter's) let the
    packer count each sample's images, videos and clips; `extra_keys` are the per-token tensors the
    adapter consumes (`extra_keys_of`); `vocab_size` (the model's, `ModelAdapter.vocab_size`) makes ids
    and labels outside [0, vocab_size) a ValueError in the packer's read.
    """
    from megatron_vlm_packing.packing import pack_batch, pad_batch

    common = dict(tp_size=layout.tp_size, cp_size=layout.cp_size, sequence_parallel=layout.sequence_parallel,
                  fp8=options.fp8, label_style=options.label_style, mrope=mrope, **(media_token_ids or {}),
                  require_media_counts=False,  # the adapter's check refuses media it does not consume
                  extra_keys=tuple(extra_keys), vocab_size=vocab_size)
    if options.pack:
        return pack_batch(batch, pad_to=options.pad_to, **common)
    return pad_batch(batch, seq_length=options.seq_length, **common)


def extra_keys_of(adapter: ModelAdapter) -> tuple[str, ...]:
    """The per-token batch keys an adapter consumes ("extra:<key>" in `consumes`). Without them the
    packer refused such a key as unknown, so an adapter declaring one could never receive it from a
    collated batch (only from a PackingCollator given extra_keys=)."""
    return tuple(sorted(name[len("extra:"):] for name in adapter.consumes if name.startswith("extra:")))


def check_loader_vocab(micro_batch: MicroBatch, vocab_size: int | None, *,
                       unembedded_token_id: int | None = None) -> MicroBatch:
    """A micro-batch from the data iterator whose ids and labels its packer bound below no vocabulary, or a
    larger one than the model's (`MicroBatch.vocab_checked`: a `PackingCollator` has no model), checked
    against `vocab_size` where it arrives, in host memory: no device sync. A label >= the vocabulary reached
    Megatron's vocab-parallel cross entropy, which masks it (its loss silently the log-sum-exp of the
    logits); a real id >= it became a zero embedding at TP > 1 (every rank masks it).

    Returns the micro-batch marked checked for `vocab_size`, or as given when there is nothing to check, or
    when its tensors are on a device already (`check_unpacked_labels` and the adapter's id check read them
    there, one sync). `unembedded_token_id` (the adapter's: LLaVA's image token) is never embedded, so it is no
    bad id whatever its value (`pack_llava_batch` does not screen it either).

    Raises:
        ValueError: naming the first real id or label >= `vocab_size` (row, position in the micro-batch), its
            value, and that the collator can check it with `pack_options=dict(vocab_size=...)`.
    """
    ids, labels, pads = micro_batch.input_ids, micro_batch.labels, micro_batch.padding_mask
    tensors = (ids, labels, pads)
    if micro_batch.vocab_checked(vocab_size) or not all(isinstance(t, torch.Tensor) and t.is_cpu for t in tensors) \
            or ids.shape != labels.shape or pads.shape != ids.shape or pads.dtype != torch.bool:
        return micro_batch  # a hand-built mask of another dtype: the checks after the move read it as it is
    # numpy: these are host memory on a GPU run too (the worker's pinned buffer), so no device waits on them
    real = ~pads.numpy()
    if unembedded_token_id is not None:
        real &= ids.numpy() != unembedded_token_id
    bad_ids, bad_labels = real & (ids.numpy() >= vocab_size), labels.numpy() >= vocab_size
    if bad_ids.any() or bad_labels.any():
        from megatron_vlm_packing.packing.checks import as_rows, check_ids, check_label_values

        hint = (f"; the data iterator's micro-batch was packed without the model's vocabulary: give "
                f"PackingCollator pack_options=dict(vocab_size={vocab_size}) (LlavaPackingCollator: "
                f"space=LlavaSpace.of(model); pack_batch / pad_batch: vocab_size={vocab_size}) to refuse it in the "
                f"DataLoader worker")
        try:
            check_ids(as_rows(ids), as_rows(torch.from_numpy(real)), vocab_size, "input_ids")
            check_label_values(as_rows(labels), torch.ones_like(as_rows(labels), dtype=torch.bool), vocab_size)
        except ValueError as error:
            raise ValueError(f"{error}{hint}") from None
    _refuse_pad_ids_outside(ids.numpy(), pads.numpy(), vocab_size)
    return replace(micro_batch, checked_vocab_size=vocab_size, checked_ids=_ids_mark_below(micro_batch, vocab_size))


def _refuse_pad_ids_outside(ids: np.ndarray, pads: np.ndarray, vocab_size: int) -> None:
    """A ValueError naming the first pad slot whose id lies outside [0, vocab_size): the model embeds pad slots
    too (an index error at TP=1, a device-side assert on a GPU). ids, pads: [1, T] or [B, S], host memory."""
    bad = pads & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        place = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"input_ids pad slot {place} holds {int(ids[place])} (the pad_token_id), no token id of the "
                         f"model (vocab_size={vocab_size}): every pad slot is embedded (an index error at TP=1, a "
                         f"device-side assert on a GPU); give the collator a pad_token_id in [0, {vocab_size}), and "
                         f"pack_options=dict(vocab_size={vocab_size}) to refuse it in the DataLoader worker")


def _ids_mark_below(micro_batch: MicroBatch, vocab_size: int) -> IdsMark | None:
    """The packer's `checked_ids` (LLaVA's, which may bound no vocabulary) now bounded by `vocab_size`, which
    `check_loader_vocab` just checked its real ids below (the same id excepted); else as it was."""
    mark = micro_batch.checked_ids
    if mark is None or mark.input_ids is not micro_batch.input_ids:
        return mark
    return mark._replace(vocab_size=vocab_size)


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


@dataclass(frozen=True)
class BuiltMicroBatch:
    """What `micro_batch_for_model` returns.

    Attributes:
        micro_batch: the full-length micro-batch, on the model's device.
        batch: the collated batch it was packed from, on the device (None: packed in the DataLoader).
        repack: `batch -> MicroBatch` packing a collated batch the same way (what the parity probe
            packs each sample alone with); None when the DataLoader or the adapter packed.
    """

    micro_batch: MicroBatch
    batch: dict | None = None
    repack: Callable[[dict], MicroBatch] | None = None


def micro_batch_for_model(item: dict | MicroBatch, adapter: ModelAdapter, layout: ParallelLayout,
                          options: StepOptions, device: torch.device, *, probing: bool = False) -> BuiltMicroBatch:
    """The model's full-length micro-batch from what the data iterator yielded.

    Args:
        item: a collated batch dict (moved to `device`, then built by the adapter's own
            `build_micro_batch`, else `pack_batch` / `pad_batch`), or a `MicroBatch` packed in the
            DataLoader (checked for the layout by the adapter and moved, not re-packed).
        probing: the parity probe will re-pack the batch sample by sample.

    Raises:
        ValueError: probing a micro-batch the probe cannot re-pack (loader- or adapter-built),
            `mrope=` for a model whose rotary is 1D, or a loader micro-batch whose mRoPE positions
            another config made (`check_loader_mrope`).
    """
    if isinstance(item, MicroBatch):  # packed in the DataLoader: only moved here
        if probing:
            raise ValueError("parity_probe_every needs collated batches (it re-packs each sample alone); "
                             "the data iterator yielded micro-batches packed in the DataLoader")
        mrope = resolve_mrope(options, adapter)  # refuses mrope= for a 1D model here too
        source = "make_forward_step(mrope=...)" if options.mrope is not None \
            else f"{adapter.model_name}'s own, {type(adapter).__name__}.mrope"
        check_loader_mrope(item, mrope, source)
        item = check_loader_vocab(item, getattr(adapter, "vocab_size", None),
                                  unembedded_token_id=getattr(adapter, "unembedded_token_id", None))
        return BuiltMicroBatch(adapter.micro_batch_from_loader(item, layout, options, device))
    batch = to_device(item, device)
    mrope_used = resolve_mrope(options, adapter, batch)
    micro_batch = adapter.build_micro_batch(batch, layout, options)
    if micro_batch is not None:
        if probing:
            raise ValueError(f"parity_probe_every: {type(adapter).__name__} builds its own micro-batches "
                             f"(e.g. in LLaVA's expanded space), which the probe cannot split per sample")
        return BuiltMicroBatch(micro_batch, batch)
    repack = partial(build_micro_batch, layout=layout, options=options, mrope=mrope_used,
                     media_token_ids=getattr(adapter, "media_token_ids", None), extra_keys=extra_keys_of(adapter),
                     vocab_size=getattr(adapter, "vocab_size", None))
    return BuiltMicroBatch(repack(batch), batch, repack)


def probe_parity(probe: StepProbe, model: nn.Module, adapter: ModelAdapter, layout: ParallelLayout,
                 built: BuiltMicroBatch, micro_batch: MicroBatch) -> None:
    """Run the parity probe on `micro_batch` (the step's, after `transform`): the same build and model
    call for the pack and for each sample of `built.batch` alone (`validate.StepProbe`)."""
    probe(model, built.batch, micro_batch, pack=built.repack,
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
                      parity_probe_every: int | None = None, parity_probe_tolerance: float | None = None) -> Callable:
    """Build a Megatron forward step.

    Args:
        pack: real-length THD packing (True) or dense right-padded rows (False).
        label_style: "hf" (unshifted labels, shifted inside each sample) or "megatron".
        pad_to: fixed packed length (static shapes: PP > 1, EP > 1, CUDA graphs).
        seq_length: fixed dense row length when `pack=False` (shorter than a real row is a ValueError).
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

    Returns:
        `forward_step(data_iterator, model) -> (output_tensor, loss_func)`.
    """
    options = StepOptions(pack=pack, label_style=label_style, pad_to=pad_to, seq_length=seq_length, fp8=fp8,
                          mrope=mrope)
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

    def forward_step(data_iterator, model):
        model_adapter = adapters(model)
        layout = ParallelLayout.from_megatron(_config_of(model))
        item = read_micro_batch(data_iterator, broadcast_from_tp_rank0=broadcast_from_tp_rank0)
        built = micro_batch_for_model(item, model_adapter, layout, options, _device_of(model),
                                      probing=probe is not None)
        micro_batch = built.micro_batch if transform is None else _transformed(transform, built.micro_batch)
        local = prepare_for_model(micro_batch, model_adapter, layout)
        output = model_adapter.forward(model, local)
        if probe is not None:
            probe_parity(probe, model, model_adapter, layout, built, micro_batch)
        return output, partial(loss_func, local.loss_mask, local.stats)

    if with_state:
        def forward_step_with_state(state: Any, data_iterator, model):
            return forward_step(data_iterator, model)

        return forward_step_with_state
    return forward_step
