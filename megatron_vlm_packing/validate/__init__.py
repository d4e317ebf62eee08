"""Check any packer's output: `validate_packed_batch` (contract items and bug classes, with the
offending documents and numbers) and a sampled packed-vs-alone parity probe."""

from megatron_vlm_packing.validate.inputs import SAVED_KEYS, PackedInputs, SourceRows, build_inputs
from megatron_vlm_packing.validate.report import CHECKS, Check, ValidationReport, Violation
from megatron_vlm_packing.validate.validate import run_checks, validate_packed_batch

__all__ = [
    "CHECKS", "Check", "PackedInputs", "SAVED_KEYS", "SourceRows", "ValidationReport", "Violation",
    "build_inputs", "run_checks", "validate_packed_batch",
]
