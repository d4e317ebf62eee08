"""Megatron-Core LLaVAModel under TP=2 x CP=2 + SP (LLaVA's shard factor 8, expanded documents in
multiples of 4), packed through `make_forward_step` vs the single-process model on the batched
micro-batches, fixed and hostile (tests/llava/llava_tp_cp_workers.py; one launch of 4 processes). Same
metric and bounds as the TP=2 + SP suite (test_llava_tp_sp.py)."""

import pytest

from tests.llava.exact import assert_equals_batched
from tests.llava.llava_tp_cp_workers import launch_tp2_cp2


def test_the_hostile_micro_batches_exercise_the_cp_and_shard_padding():
    plans = launch_tp2_cp2()["hostile plans"]
    assert all((p["segment_multiple"], p["total_multiple"]) == (4, 8) for p in plans), plans
    # documents of 1 token in 4 slots (CP rank 1's two chunks of them are pad slots only), and alone in 8
    short = [p["expanded_physical"][i] for p in plans for i, d in enumerate(p["documents"]) if len(d) == 1]
    assert {4, 8} <= set(short), plans
    # totals off the shard factor 8 before it (its pad slots planned) and on it (none planned)
    assert {p["unaligned_total"] % 8 == 0 for p in plans} == {True, False}, plans
    assert all(p["total"] % 8 == 0 and p["total"] - p["unaligned_total"] < 8 for p in plans), plans


@pytest.mark.parametrize("data", ["fixed", "hostile"])
@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_packed_equals_batched_under_tp2_cp2_sp(data, style):
    result = launch_tp2_cp2()
    r = result[f"{data}, {style} labels"]
    assert_equals_batched(r, result["params"])
