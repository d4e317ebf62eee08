"""The gloo launcher and `initialize_parallel`: layouts, seeding, failures and hangs reach the caller."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_vlm_packing.testing import initialize_parallel, run_distributed


def _probe_layouts(rank, world_size):
    """One launch, several checks: every layout that fits 2 processes, seeding, bad sizes."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    out = {"cuda_visible": torch.cuda.is_available()}
    for tp, cp, pp in ((2, 1, 1), (1, 2, 1), (1, 1, 2), (1, 1, 1)):
        initialize_parallel(tp=tp, cp=cp, pp=pp, seed=7)
        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                 ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size())
        weights = torch.rand(4)  # the CPU RNG is seeded identically on every rank
        with get_cuda_rng_tracker().fork():
            tp_draw = torch.rand(4)  # the TP tracker differs per TP rank, like Megatron's CUDA one
        gathered = [torch.empty(8) for _ in range(world_size)]
        dist.all_gather(gathered, torch.cat([weights, tp_draw]))
        out[(tp, cp, pp)] = dict(sizes=sizes, same_weights=torch.equal(gathered[0][:4], gathered[1][:4]),
                                 same_tp_draw=torch.equal(gathered[0][4:], gathered[1][4:]))
    initialize_parallel(seed=7)
    again = torch.rand(4)
    initialize_parallel(seed=7)
    out["reseeded_equal"] = torch.equal(again, torch.rand(4))
    for bad in (dict(tp=3), dict(cp=0)):
        try:
            initialize_parallel(**bad)
            out[f"bad {bad}"] = "accepted"
        except ValueError as err:
            out[f"bad {bad}"] = str(err)
    return out


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("boom from rank 1")
    dist.barrier()  # rank 0 then fails in a collective: the launcher must name rank 1 as the cause


def _sleep(rank, world_size):
    time.sleep(120)


def test_layouts_seeding_and_bad_sizes_under_two_processes():
    out = run_distributed(_probe_layouts, 2)
    assert out["cuda_visible"] is False
    assert out[(2, 1, 1)] == dict(sizes=(2, 1, 1, 1), same_weights=True, same_tp_draw=False)
    assert out[(1, 2, 1)]["sizes"] == (1, 2, 1, 1) and out[(1, 2, 1)]["same_tp_draw"]
    assert out[(1, 1, 2)]["sizes"] == (1, 1, 2, 1)
    assert out[(1, 1, 1)]["sizes"] == (1, 1, 1, 2)
    assert out["reseeded_equal"]
    assert "does not divide the world size 2" in out["bad {'tp': 3}"]
    assert "cp must be >= 1, got 0" in out["bad {'cp': 0}"]


def test_a_failing_rank_fails_the_caller_with_its_traceback():
    with pytest.raises(RuntimeError) as info:
        run_distributed(_raise_on_rank_1, 2, timeout_s=120)
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed") and "boom from rank 1" in message  # the cause first
    assert "_raise_on_rank_1" in message  # the child's traceback, not just its last line


def test_a_hanging_run_is_killed_after_the_timeout():
    with pytest.raises(TimeoutError, match="still running after 4 s"):
        run_distributed(_sleep, 1, timeout_s=4)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        run_distributed(_sleep, 0)
