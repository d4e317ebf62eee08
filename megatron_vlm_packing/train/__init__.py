"""The training seam: the forward step (a chain of named stages) and the one loss function."""

from megatron_vlm_packing.train.loss import loss_func
from megatron_vlm_packing.train.build import StepOptions, build_micro_batch
from megatron_vlm_packing.train.step import make_forward_step, prepare_for_model

__all__ = ["StepOptions", "build_micro_batch", "loss_func", "make_forward_step", "prepare_for_model"]
