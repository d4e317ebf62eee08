"""One micro-batch through the shipped step, with what the Bridge batch-format tests compare."""

from __future__ import annotations


def run_step(model, batch: dict, **options) -> dict:
    """One micro-batch through `make_forward_step(**options)`, backward of its loss sum: the pack's per-token
    losses at its targets (in pack order), the loss sum and target count, the micro-batch and every gradient.
    `with_state=True` in `options` calls the step in Bridge's (state, data_iterator, model) form."""
    from megatron_vlm_packing.train.step import make_forward_step

    seen = []
    model.zero_grad(set_to_none=True)
    step = make_forward_step(transform=lambda mb: seen.append(mb) or mb, **options)
    args = (iter([batch]), model) if not options.get("with_state") else (None, iter([batch]), model)
    output, loss_fn = step(*args)
    loss_sum, count, _ = loss_fn(output)
    loss_sum.backward()
    mb = seen[0]
    targets = mb.loss_mask.reshape(output.shape) != 0
    return dict(losses=output.detach()[targets], sum=loss_sum.item(), count=int(count), micro_batch=mb,
                grads={n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
