"""`run_distributed` target for tests/step/test_pipeline_shapes.py (module-level so the fork server can pickle it).

A tiny Megatron-Core GPTModel split over two pipeline stages (gloo). Refusals are asked of the shipped step on
each stage directly: they come before the model runs, so no stage sends or waits for anything. Accepted setups run
through Megatron's own `get_forward_backward_func` (a later stage's model cannot run without what it receives)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import torch.distributed as dist

from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.runtime import initialize_parallel
from megatron_vlm_packing.testing.parity import variable_batch
from megatron_vlm_packing.train.step import make_forward_step

LENGTHS = [7, 5, 9]  # one pack of 21 real tokens (no alignment at TP = CP = 1)
ROW = 12


def bridge_state(seq_length: int, micro_batch_size: int = 1) -> SimpleNamespace:
    """The fields of Megatron-Bridge's GlobalState its training loop reads the schedule's numbers from."""
    return SimpleNamespace(cfg=SimpleNamespace(model=SimpleNamespace(seq_length=seq_length),
                                               train=SimpleNamespace(micro_batch_size=micro_batch_size),
                                               dataset=SimpleNamespace(dataloader_type="single")))


def refusal(step, batch, model) -> str | None:
    """The step's ValueError message on this stage (None: accepted)."""
    try:
        step(iter([dict(batch)]), model)
    except ValueError as error:
        return str(error)
    return None


def through_schedule(step, batch, model, seq_length: int) -> list[float] | None:
    """[loss sum, tokens] of two micro-batches through Megatron's schedule (last stage), None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    reports = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([dict(batch), dict(batch)]), model=[model], num_microbatches=2,
        seq_length=seq_length, micro_batch_size=1, forward_only=True)
    return [float(sum(r["lm loss"][i] for r in reports)) for i in (0, 1)] if reports else None


def run_pipeline_shapes(rank: int, world_size: int) -> dict:
    """Every stage's refusals (case -> message or None) and the accepted runs' losses, gathered to rank 0."""
    from megatron.core import parallel_state as ps

    initialize_parallel(pp=2, seed=1)
    cfg = TinyGPTConfig(pipeline_parallel=2)
    model = build_tiny_gpt(cfg, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    batch = variable_batch(LENGTHS, ROW, vocab_size=cfg.vocab_size, seed=3)
    with_state = partial(make_forward_step, with_state=True)
    said = {
        "pack_own_length": refusal(make_forward_step(), batch, model),
        "dense_own_length": refusal(make_forward_step(pack=False), batch, model),
        "bridge_longer": refusal(partial(with_state(), bridge_state(32)), batch, model),
        "bridge_shorter": refusal(partial(with_state(), bridge_state(16)), batch, model),
        "bridge_pad_to_differs": refusal(partial(with_state(pad_to=32), bridge_state(40)), batch, model),
        "bridge_dense_differs": refusal(partial(with_state(pack=False, seq_length=12), bridge_state(16, 3)),
                                        batch, model),
        "bridge_rows_differ": refusal(partial(with_state(pad_to=32), bridge_state(32, 4)), batch, model),
    }
    losses = {"pad_to": through_schedule(make_forward_step(pad_to=32), batch, model, 32),
              "bridge_pad_to": through_schedule(partial(with_state(pad_to=32), bridge_state(32)), batch, model, 32)}
    model.config.variable_seq_lengths = True
    losses["variable"] = through_schedule(make_forward_step(), batch, model, 0)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, dict(said=said, losses=losses))
    return dict(said=[g["said"] for g in gathered], losses=gathered[-1]["losses"])
