"""Kept import path: the forward step and the loss live in `megatron_vlm_packing.train`."""

from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.train.loss import loss_func
from megatron_vlm_packing.train.build import StepOptions, build_micro_batch, to_device
from megatron_vlm_packing.train.step import make_forward_step, prepare_for_model, read_micro_batch

__all__ = ["ParallelLayout", "StepOptions", "build_micro_batch", "loss_func", "make_forward_step",
           "prepare_for_model", "read_micro_batch", "to_device"]
