"""The one loss function: every forward step, parity suite and the demo reduce losses here.

Contract item 9: `(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens], ...})`, so that
Megatron's schedules (which add `num_tokens` over micro-batches and divide the gradients by the
total in `finalize_model_grads`) average exactly per token across micro-batches, DP and CP ranks,
whatever the packing.

Per-token weights: a float loss mask keeps its values, `loss_sum = sum(w * loss)`. Megatron counts
tokens in an int tensor, so `num_tokens` is the number of tokens with a nonzero weight: a weight
scales its token's contribution relative to weight 1 (for a 0/1 mask this is exactly
`(sum(mask * loss), sum(mask))`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_vlm_packing.packing.micro_batch import BatchStats


def _stat(stats, name: str, legacy: str | None = None):
    if isinstance(stats, BatchStats):
        return getattr(stats, name)
    if isinstance(stats, Mapping):
        return stats.get(name, stats.get(legacy) if legacy else None)
    raise ValueError(f"stats must be a BatchStats or a mapping, got {type(stats).__name__}")


def loss_func(loss_mask: torch.Tensor, stats, output_tensor):
    """Reduce per-token losses to Megatron's `(loss_sum, num_tokens, report)`.

    Args:
        loss_mask: [B, S] / [1, T] float, this rank's per-token weights (0 = no target).
        stats: `BatchStats` (or a mapping with real_tokens, physical_tokens, optional
            row_tokens / padded_tokens) for the efficiency reports.
        output_tensor: per-token losses shaped like `loss_mask`, or `(losses, loss_mask)` from a
            model that returns its own mask (honoured instead of ours).

    Returns:
        loss_sum: [] float, sum(w * loss); num_tokens: [] int, tokens with w != 0;
        report: "lm loss" [loss_sum, num_tokens], "packing efficiency" [real, physical] tokens,
        and "padding efficiency" [real, row slots] when the row slots are known.

    Raises:
        ValueError: losses and mask of different sizes (a CP-local mask against full losses).
    """
    if isinstance(output_tensor, tuple):
        if len(output_tensor) != 2:  # was "too many values to unpack", naming nothing
            raise ValueError(f"a model returning a tuple must return (losses, loss_mask), got {len(output_tensor)} items")
        output_tensor, loss_mask = output_tensor
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).to(device=losses.device, dtype=torch.float32)
    if losses.numel() != mask.numel():
        raise ValueError(f"the model returned {losses.numel()} per-token losses but the loss mask has "
                         f"{mask.numel()} entries")
    # A slot of weight 0 adds exactly 0, whatever its loss: THD attention kernels need not define their
    # output at pad slots between documents, and NaN * 0 is NaN (losses * mask alone would poison the sum).
    loss_sum = torch.where(mask != 0, losses * mask, 0.0).sum()
    num_tokens = (mask != 0).sum().to(torch.int)
    device = loss_sum.device
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}
    real, physical = _stat(stats, "real_tokens"), _stat(stats, "physical_tokens")
    if real is None or physical is None:  # a mapping without them was a TypeError from float(None)
        raise ValueError(f"stats must give real_tokens and physical_tokens, got real_tokens={real!r}, "
                         f"physical_tokens={physical!r}")
    report["packing efficiency"] = torch.tensor([float(real), float(physical)], device=device)
    rows = _stat(stats, "row_tokens", "padded_tokens")
    if rows is not None:  # what right-padded rows would have cost, for comparison
        report["padding efficiency"] = torch.tensor([float(real), float(rows)], device=device)
    return loss_sum, num_tokens, report
