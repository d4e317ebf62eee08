"""Megatron-Core LLaVAModel under TP=2 + sequence parallelism, packed through `make_forward_step` vs
the single-process model on the batched micro-batches (tests/llava/llava_workers.py; one launch of 2
processes shared with tests/perf/test_llava_sync_budget.py). Same metric and bounds as the PP=2 / CP=2
suite (test_llava_parity.py): token_mult_prob_error over every token with a loss, and the worst
relative error over every parameter gradient, TP shards gathered. The hostile micro-batches
(`testing.llava_reference.HOSTILE_MICRO_BATCHES`) are checked first for what they exercise, as the
step's packer plans them under TP=2 + SP."""

import pytest

from megatron_vlm_packing.testing.llava_reference import IMG, REPEATED, hostile_batches
from tests.llava.exact import assert_equals_batched
from tests.llava.llava_workers import launch


@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_packed_equals_batched_under_tp2_sp(style):
    result = launch()
    r = result[f"TP=2+SP, {style} labels"]
    assert_equals_batched(r, result["params"])
    assert [rows for rows, _ in r["shapes"]] == [1, 1], r  # one THD pack per micro-batch


def test_a_pack_without_the_sp_shard_factor_is_refused():
    control = launch()["TP=2+SP, control: no shard factor"]
    assert control["expanded total"] % 2 == 1, control  # odd: it cannot split over 2 TP ranks
    assert "not this LLaVAModel's" in control["planned"], control
    assert "not a multiple of LLaVA's shard factor 2" in control["read from ids"], control


def test_the_hostile_micro_batches_exercise_what_they_claim():
    plans = launch()["TP=2+SP, hostile"]["plans"]
    documents = [d for plan in plans for d in plan["documents"]]
    # every expanded total odd before LLaVA's shard factor (2 at TP=2 + SP): its pad slot is always planned
    assert all(p["total_multiple"] == 2 and p["unaligned_total"] % 2 == 1 for p in plans), plans
    assert [p["total"] for p in plans] == [p["unaligned_total"] + 1 for p in plans], plans
    assert {len(d) for d in documents} >= {1, 2, 3, 4}, documents
    # an empty row between a 1-token document and an image-only one: the pad slot LLaVA zeroes crosses it
    assert plans[0]["empty_rows"] == 1 and len(plans[0]["documents"][0]) == 1, plans[0]
    assert plans[0]["documents"][1] == [IMG], plans[0]
    assert [len(d) for d in plans[3]["documents"]] == [1] and plans[3]["total"] == 2, plans[3]  # a rank of pad only
    assert [d for d in documents if set(d) == {IMG}] and plans[0]["documents"][-1][-1] == IMG, plans[0]
    assert [d for d in documents if d[-1] == IMG and set(d) != {IMG}], documents  # text, then an image last
    assert all(IMG not in d for d in plans[1]["documents"]), plans[1]  # no image at all
    repeated = plans[REPEATED]["documents"]
    assert repeated[0] == repeated[1] and IMG in repeated[0], repeated
    data = hostile_batches("hf", 11)
    assert data[-1] is data[0] and plans[-1] == plans[0], plans  # a micro-batch fed twice
    for style in ("megatron", "hf"):  # a micro-batch with no token with a loss, in both label styles
        assert launch()["TP=2+SP, hostile"][f"{style} labels"]["tokens_per_micro_batch"][4] == 0


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_hostile_micro_batches_equal_batched_under_tp2_sp(style, pack):
    result = launch()
    hostile = result["TP=2+SP, hostile"]
    r = hostile[f"{style} labels" if pack else f"pack=False, {style} labels"]
    assert_equals_batched(r, result["params"], min_tokens=15)
    if pack:  # one THD pack per micro-batch, of the planned expanded length
        assert r["shapes"] == [(1, p["total"]) for p in hostile["plans"]], r
    else:  # LLaVA's own rows
        assert [rows for rows, _ in r["shapes"]] == [len(p["documents"]) + p["empty_rows"] for p in hostile["plans"]], r
