"""One launch of 4 processes: Megatron-Core LLaVAModel under TP=2 x CP=2 + sequence parallelism, where
LLaVA's shard factor is tp * cp * 2 = 8 and every expanded document divides by 2 * cp = 4.

The fixed micro-batches (`llava_reference.MICRO_BATCHES`) and the hostile ones (`HOSTILE_MICRO_BATCHES`)
go through `make_forward_step` + `get_forward_backward_func` (`llava_parity.packed_run`: CP tokens and TP
shards gathered) against the single-process model on the batched micro-batches, both label styles, with
what each hostile micro-batch exercises as the step's packer plans it (`llava_workers.hostile_plans`).
`launch_tp2_cp2()` runs it once per test session.
"""

from __future__ import annotations

import functools

from megatron_vlm_packing.testing.distributed import run_distributed


@functools.cache
def launch_tp2_cp2() -> dict:
    return run_distributed(run_tp2_cp2_checks, 4, timeout_s=900)


def run_tp2_cp2_checks(rank: int, world_size: int, seed: int = 11) -> dict:
    """Every check in one launch (4 processes); what rank 0 saw (reductions make the parity global)."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.patches import (
        apply_llava_packed_boundaries, apply_thd_rotary, undo_llava_packed_boundaries, undo_thd_rotary,
    )
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.llava_parity import (
        build_tiny_llava, compare, lap_timer, llava_cp_without_te, packed_run, reference_setup,
    )
    from megatron_vlm_packing.testing.parity import load_full_state
    from tests.llava.llava_workers import hostile_plans, hostile_references

    result = {"patches": (apply_llava_packed_boundaries(), apply_thd_rotary())}
    lap = lap_timer(result)
    try:
        ref_model, state, refs = reference_setup(seed)
        hostile = hostile_references(ref_model, seed)
        result["params"] = len(state)
        lap("reference")
        initialize_parallel(tp=2, cp=2, seed=seed)
        with llava_cp_without_te():
            model = build_tiny_llava(seed, tp=2, cp=2, sp=True)
        load_full_state(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=2)
        result["hostile plans"] = hostile_plans(model, hostile["hf"][0])
        for name, cases in (("fixed", refs), ("hostile", hostile)):
            for style, (data, ref_logps, ref_grads) in cases.items():
                result[f"{name}, {style} labels"] = compare(ref_logps, ref_grads, *packed_run(model, data, style))
            lap(name)
    finally:
        undo_thd_rotary()
        undo_llava_packed_boundaries()
    return result
