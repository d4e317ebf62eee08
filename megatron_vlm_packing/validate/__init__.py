"""Check any packer's output: `validate_packed_batch` (contract items and bug classes, with the
offending documents and numbers) and a sampled packed-vs-alone parity probe."""

from megatron_vlm_packing.validate.inputs import SAVED_KEYS, PackedInputs, SourceRows, build_inputs
from megatron_vlm_packing.validate.probe import ParityProbeError, ProbeResult, parity_probe, split_rows
from megatron_vlm_packing.validate.report import CHECKS, Check, ValidationReport, Violation
from megatron_vlm_packing.validate.step_probe import (
    StepProbe, default_tolerance, model_losses, probe_model, with_parity_probe,
)
from megatron_vlm_packing.validate.validate import run_checks, validate_packed_batch

__all__ = [
    "CHECKS", "Check", "PackedInputs", "ParityProbeError", "ProbeResult", "SAVED_KEYS", "SourceRows", "StepProbe",
    "ValidationReport", "Violation", "build_inputs", "default_tolerance", "model_losses", "parity_probe", "probe_model",
    "run_checks", "split_rows", "validate_packed_batch", "with_parity_probe",
]
