"""Megatron-Core LLaVAModel under TP=2 + sequence parallelism, packed through `make_forward_step` vs
the single-process model on the batched micro-batches (tests/llava/llava_workers.py; one launch of 2
processes shared with tests/perf/test_llava_sync_budget.py). Same metric and bounds as the PP=2 / CP=2
suite (test_llava_parity.py): token_mult_prob_error over every token with a loss, and the worst
relative error over every parameter gradient, TP shards gathered."""

import pytest

from tests.llava.llava_workers import launch

EXACT = 1.000001  # token_mult_prob_error: exp(mean |dlogp|), 1.0 = identical (fp32 on CPU)
GRAD = 1e-5


@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_packed_equals_batched_under_tp2_sp(style):
    result = launch()
    r = result[f"TP=2+SP, {style} labels"]
    assert 1.0 <= r["token_mult_prob_error"] <= EXACT and r["tokens_compared"] >= 10, r
    assert r["max_rel_grad_err"] < GRAD, r
    assert r["params_missing"] == [] and r["params_checked"] == result["params"], r
    assert [rows for rows, _ in r["shapes"]] == [1, 1], r  # one THD pack per micro-batch


def test_a_pack_without_the_sp_shard_factor_is_refused():
    control = launch()["TP=2+SP, control: no shard factor"]
    assert control["expanded total"] % 2 == 1, control  # odd: it cannot split over 2 TP ranks
    assert "not this LLaVAModel's" in control["planned"], control
    assert "not a multiple of LLaVA's shard factor 2" in control["read from ids"], control
