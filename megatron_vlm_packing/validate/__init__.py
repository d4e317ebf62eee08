"""Check any packer's output: `validate_packed_batch` (contract items and bug classes, with the
offending documents and numbers) and a sampled packed-vs-alone parity probe.

Names are imported on first use (`lazy.lazy_exports`): `check --help` reads `saved_keys` alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_vlm_packing.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers read; at run time `__getattr__` imports each name on first use
    from megatron_vlm_packing.validate.inputs import build_inputs
    from megatron_vlm_packing.validate.packed_inputs import PackedInputs, SourceRows
    from megatron_vlm_packing.validate.probe import ParityProbeError, ProbeResult, parity_probe, split_rows
    from megatron_vlm_packing.validate.report import CHECKS, Check, ValidationReport, Violation
    from megatron_vlm_packing.validate.saved_keys import SAVED_KEYS
    from megatron_vlm_packing.validate.step_probe import (
        StepProbe, default_tolerance, model_losses, probe_model, with_parity_probe,
    )
    from megatron_vlm_packing.validate.validate import run_checks, validate_packed_batch

_SOURCES = {
    "build_inputs": "megatron_vlm_packing.validate.inputs",
    **dict.fromkeys(("PackedInputs", "SourceRows"), "megatron_vlm_packing.validate.packed_inputs"),
    **dict.fromkeys(("ParityProbeError", "ProbeResult", "parity_probe", "split_rows"),
                    "megatron_vlm_packing.validate.probe"),
    **dict.fromkeys(("CHECKS", "Check", "ValidationReport", "Violation"), "megatron_vlm_packing.validate.report"),
    "SAVED_KEYS": "megatron_vlm_packing.validate.saved_keys",
    **dict.fromkeys(("StepProbe", "default_tolerance", "model_losses", "probe_model", "with_parity_probe"),
                    "megatron_vlm_packing.validate.step_probe"),
    **dict.fromkeys(("run_checks", "validate_packed_batch"), "megatron_vlm_packing.validate.validate"),
}

__all__ = [
    "CHECKS", "Check", "PackedInputs", "ParityProbeError", "ProbeResult", "SAVED_KEYS", "SourceRows", "StepProbe",
    "ValidationReport", "Violation", "build_inputs", "default_tolerance", "model_losses", "parity_probe", "probe_model",
    "run_checks", "split_rows", "validate_packed_batch", "with_parity_probe",
]

__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
