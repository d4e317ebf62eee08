"""The parity probe in a training loop: every N-th micro-batch of a forward step is probed.

`with_parity_probe(forward_step, every=N)` wraps any `forward_step(data_iterator, model)` that
reads one collated batch per call from its iterator. `model_losses(model)` is the default way to
get per-token losses from a model: its registered adapter for a `MicroBatch`, else GPTModel's
keywords.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron_vlm_packing.packing.bounds import checked_int
from megatron_vlm_packing.validate.probe import ProbeResult, is_tolerance, parity_probe

_VISION = ("pixel_values", "image_grid_thw")


def model_losses(model: torch.nn.Module) -> Callable:
    """`forward(micro_batch) -> per-token losses` for `model` (called with labels).

    A `MicroBatch` goes through the model's registered adapter; a `PackedBatch` through
    Megatron-Core GPTModel's keywords (plus its images when it has any).
    """
    def forward(micro_batch):
        if hasattr(micro_batch, "stats"):  # a MicroBatch: the adapter knows the model's keywords
            from megatron_vlm_packing.models.adapter import adapter_for

            return adapter_for(model).forward(model, micro_batch)
        passthrough = getattr(micro_batch, "passthrough", None) or {}
        vision = {k: passthrough[k] for k in _VISION if passthrough.get(k) is not None}
        return model(input_ids=micro_batch.input_ids, position_ids=micro_batch.position_ids, attention_mask=None,
                     labels=micro_batch.labels, packed_seq_params=micro_batch.packed_seq_params, **vision)

    return forward


def check_probe_layout() -> None:
    """The probe runs samples alone on this rank's model: one pipeline stage, no context parallelism."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return
    pp, cp = ps.get_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size()
    if pp > 1 or cp > 1:
        raise ValueError(f"the parity probe needs one pipeline stage and cp = 1 (got pp={pp}, cp={cp}): probe a "
                         f"single-stage copy of the run, or validate the packs with validate_packed_batch")


def probe_model(model: torch.nn.Module, batch: dict, *, model_forward: Callable | None = None,
                **probe_kwargs) -> ProbeResult:
    """`parity_probe` on `model` in eval mode (dropout off), its training mode restored after."""
    check_probe_layout()
    was_training = model.training
    model.eval()
    try:
        return parity_probe(model_forward or model_losses(model), batch, **probe_kwargs)
    finally:
        model.train(was_training)


FP32_TOLERANCE = 1e-4
HALF_TOLERANCE = 5e-2  # bf16 / fp16: kernels differ between a pack and each sample alone (probe.parity_probe)


def default_tolerance(model: torch.nn.Module) -> float:
    """The probe's default bound for `model`: 1e-4 when its parameters are float32 (or it has none), 5e-2
    when they are bf16 / fp16 (as Megatron's Float16Module makes them), where 1e-4 would stop a sound
    run on rounding alone."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return FP32_TOLERANCE if dtype in (torch.float32, torch.float64) else HALF_TOLERANCE


def _tolerance_for(tolerance: float | None, model: torch.nn.Module) -> float:
    """The bound a probe of `model` uses: `tolerance` when given, else `default_tolerance(model)`."""
    return default_tolerance(model) if tolerance is None else tolerance


def _checked_tolerance(tolerance, name: str) -> float | None:
    if tolerance is not None and not is_tolerance(tolerance):
        raise ValueError(f"{name} must be a finite number >= 0 or None (1e-4 for a float32 model, 5e-2 for bf16 / "
                         f"fp16), got {tolerance!r}")
    return tolerance


def _check_callable(value, name: str, what: str) -> None:
    """`value` is callable or None: else a TypeError when the first probe calls it, after the step ran."""
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be {what}, or None, got {value!r}")


def _check_probe_kwargs(probe_kwargs: dict) -> None:
    """`with_parity_probe`'s extra keywords name `parity_probe` / `pack_batch` settings: else a TypeError (an
    unexpected keyword) at the first probed call."""
    import inspect

    from megatron_vlm_packing.packing.batch import check_pack_options

    # with_parity_probe passes these itself; split_by is one micro-batch's, never every call's
    own = {"forward", "batch", "tolerance", "pack_kwargs", "split_by"}
    probe_keywords = tuple(name for name in inspect.signature(parity_probe).parameters if name not in own)
    check_pack_options(probe_kwargs, "with_parity_probe", also_for="parity_probe", also=probe_keywords)


class StepProbe:
    """The probe as a forward step runs it: counts micro-batches and probes every `every`-th.

    Called by the step with the collated batch, the full-length micro-batch it built, how it calls
    the model on a micro-batch and how it builds one (so each sample alone is built the same way), and
    `split_by`: the micro-batch as the packer built it (before any `transform`), whose per-sample media
    counts give each sample its own images, videos and audio clips.
    `tolerance` None: `default_tolerance(model)`.
    """

    def __init__(self, every: int, *, tolerance: float | None = None, on_result: Callable | None = print):
        every = checked_int(every, "parity_probe_every", least=1)
        tolerance = _checked_tolerance(tolerance, "parity_probe_tolerance")
        _check_callable(on_result, "on_result", "a callable taking each ProbeResult")
        self.every, self.tolerance, self.on_result, self.calls = every, tolerance, on_result, 0

    def __call__(self, model: torch.nn.Module, batch: dict, micro_batch, *, forward: Callable,
                 pack: Callable, split_by=None) -> ProbeResult | None:
        call, self.calls = self.calls, self.calls + 1
        if call % self.every:
            return None
        result = probe_model(model, batch, model_forward=forward, packed=micro_batch, pack=pack, split_by=split_by,
                             tolerance=_tolerance_for(self.tolerance, model))
        if self.on_result is not None:
            self.on_result(result)
        return result


class _Recorder:
    """An iterator that remembers the last item it yielded."""

    def __init__(self, inner: Iterator):
        self.inner, self.last = inner, None

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.inner)
        return self.last


def with_parity_probe(forward_step: Callable, *, every: int, tolerance: float | None = None,
                      model_forward: Callable | None = None, on_result: Callable[[ProbeResult], None] | None = print,
                      **probe_kwargs) -> Callable:
    """Wrap `forward_step(data_iterator, model)`: every `every`-th call (micro-batch), the batch it read
    is probed (packed vs each sample alone, no gradients); `ParityProbeError` above `tolerance` (None:
    `default_tolerance(model)`, 1e-4 for a float32 model, 5e-2 for bf16 / fp16).

    Args:
        every: probe calls 0, every, 2*every, ... (with M micro-batches per step: every every/M steps).
        on_result: receives each passing `ProbeResult` (default: print it).
        **probe_kwargs: `parity_probe` settings matching the step's packing (label_style, mrope,
            tp_size, sequence_parallel, image_token_id, ...).

    Every rank must read its own batch (the probe's forward uses the TP group on every TP rank).
    """
    if not callable(forward_step):
        raise ValueError(f"with_parity_probe wraps a forward_step(data_iterator, model), got {forward_step!r}")
    every = checked_int(every, "every", least=1)
    tolerance = _checked_tolerance(tolerance, "tolerance")
    _check_callable(on_result, "on_result", "a callable taking each ProbeResult")
    _check_callable(model_forward, "model_forward", "a callable micro_batch -> per-token losses")
    _check_probe_kwargs(probe_kwargs)
    calls = [0]

    def probed_step(data_iterator, model):
        recorder = _Recorder(data_iterator)
        output = forward_step(recorder, model)
        call, calls[0] = calls[0], calls[0] + 1
        if call % every == 0:
            if recorder.last is None:
                raise ValueError("the wrapped forward step read no batch on this rank (TP broadcast?): the parity "
                                 "probe needs every rank to read its own batch")
            result = probe_model(model, recorder.last, model_forward=model_forward,
                                 tolerance=_tolerance_for(tolerance, model), **probe_kwargs)
            if on_result is not None:
                on_result(result)
        return output

    return probed_step
