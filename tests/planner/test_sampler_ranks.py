"""`PackedBatchSampler.check_same_plan_across_ranks`: data-parallel ranks that built their samplers from a table in
another order, or under another config, each planned a different epoch and took their share of it, so samples
were trained twice or never, silently. The check all-gathers each rank's layout and place and raises on every
rank naming the field, its values and the ranks holding each. Two real CPU processes (gloo)."""

import re

import numpy as np
import pytest
import torch.distributed as dist

from megatron_vlm_packing.packing import PackMultiples
from megatron_vlm_packing.planner import BinLayout, PackedBatchSampler, PlannerConfig, SampleTable
from megatron_vlm_packing.runtime import run_distributed

_TOKENS = np.random.default_rng(0).integers(1, 90, 57)


def _config(capacity=128, **kw):
    layout = BinLayout(capacity=capacity, multiples=PackMultiples.for_parallel(cp_size=2))
    return PlannerConfig(**{"layout": layout, "dp_size": 2, "micro_batches_per_rank": 2, "window_steps": 2,
                            "seed": 5, **kw})


def _sampler_of(case: str, rank: int) -> PackedBatchSampler:
    """Rank 0 builds the reference sampler; rank 1 builds the one `case` names."""
    tokens = _TOKENS[::-1].copy() if case == "order" and rank == 1 else _TOKENS
    kw = {"capacity": dict(capacity=256), "seed": dict(seed=6), "balance": dict(balance=False),
          "dp_size": dict(dp_size=1), "fails_on_one_rank": dict(expanded_tokens=_refusing_tokens)}.get(case, {})
    config = _config(**kw) if rank == 1 or case == "dp_size" else _config()
    dp_rank = 0 if case in ("same_dp_rank", "dp_size") else rank
    sampler = PackedBatchSampler(SampleTable(text_tokens=tokens), config, dp_rank=dp_rank)
    if case == "position" and rank == 1:  # resumed from a state saved one micro-batch later than rank 0's
        next(iter(sampler))
        state = sampler.state_dict()
        sampler = PackedBatchSampler(SampleTable(text_tokens=tokens), config, dp_rank=dp_rank)
        sampler.load_state_dict(state)
    return sampler


_CASES = ("same", "same_in_a_group", "order", "capacity", "seed", "balance", "position", "same_dp_rank", "dp_size",
          "fails_on_one_rank")


def _refusing_tokens(table):
    """A token count hook that refuses this rank's table (e.g. a malformed sample only its copy holds)."""
    raise ValueError("sample 3 has a grid the merge does not divide")


def _check_every_case(rank, world_size):
    """Each case on both ranks: None where the check passed, else its ValueError's message; every rank's
    outcomes gathered (rank 0 returns them)."""
    group = dist.new_group([0, 1])
    outcomes = {}
    for case in _CASES:
        sampler = _sampler_of(case, rank)
        try:
            sampler.check_same_plan_across_ranks(group if case == "same_in_a_group" else None)
            outcomes[case] = None
        except ValueError as err:
            outcomes[case] = str(err)
        if case == "same":  # the sampler still yields its share after the check
            outcomes["first"] = next(iter(sampler))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, outcomes)
    return gathered


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(_check_every_case, 2, timeout_s=300)


def _both(outcomes, case):
    """The message of `case`, the same on both ranks."""
    assert outcomes[0][case] is not None, f"{case}: the check passed"
    assert outcomes[0][case] == outcomes[1][case]
    return outcomes[0][case]


@pytest.mark.parametrize("case", ["same", "same_in_a_group"])
def test_ranks_of_one_table_and_config_pass(outcomes, case):
    assert outcomes[0][case] is None and outcomes[1][case] is None
    assert outcomes[0]["first"] != outcomes[1]["first"]  # each took its own share


def test_a_table_in_another_order_raises_on_both_ranks_naming_the_fingerprints(outcomes):
    message = _both(outcomes, "order")
    reference = PackedBatchSampler(SampleTable(text_tokens=_TOKENS), _config(), dp_rank=0).layout()
    reversed_ = PackedBatchSampler(SampleTable(text_tokens=_TOKENS[::-1].copy()), _config(), dp_rank=0).layout()
    assert "the 2 ranks of the group disagree on the plan or their place in it" in message
    assert (f"table_fingerprint: {reference['table_fingerprint']!r} on rank 0; "
            f"{reversed_['table_fingerprint']!r} on rank 1") in message
    assert "layout.capacity" not in message and "seed" not in message  # only the fields that differ


@pytest.mark.parametrize("case, words", [
    ("capacity", "layout.capacity: 128 on rank 0; 256 on rank 1"),
    ("seed", "seed: 5 on rank 0; 6 on rank 1"),
    ("position", "position: 0 on rank 0; 1 on rank 1"),
])
def test_another_config_or_place_raises_on_both_ranks_naming_the_field_and_values(outcomes, case, words):
    message = _both(outcomes, case)
    assert "disagree on the plan or their place in it" in message and words in message
    assert "table_fingerprint" not in message


def test_a_field_one_rank_does_not_record_is_named_as_missing(outcomes):
    """balance=False records no cost model (it moves no sample there): the other rank's coefficients are named."""
    message = _both(outcomes, "balance")
    assert "balance: True on rank 0; False on rank 1" in message
    assert re.search(r"cost_model\.lm_linear: \S+ on rank 0; no such field on rank 1", message), message


def test_two_ranks_taking_one_share_raise(outcomes):
    assert "dp_rank=0 on ranks 0, 1" in _both(outcomes, "same_dp_rank")
    assert "dp_rank 1 on none" in _both(outcomes, "same_dp_rank")


def test_a_dp_size_other_than_the_group_size_raises(outcomes):
    """dp_size=1 on both ranks of a 2-rank group: each took the whole plan, every sample trained twice."""
    message = _both(outcomes, "dp_size")
    assert "the group has 2 ranks but dp_size=1" in message


def test_without_torch_distributed_one_rank_passes_and_more_are_refused():
    assert not dist.is_initialized()
    table = SampleTable(text_tokens=_TOKENS)
    PackedBatchSampler(table, _config(dp_size=1), dp_rank=0).check_same_plan_across_ranks()  # nothing to compare
    with pytest.raises(ValueError, match=r"dp_size=2 ranks but torch.distributed is not initialised"):
        PackedBatchSampler(table, _config(), dp_rank=0).check_same_plan_across_ranks()


def test_a_rank_that_cannot_record_its_plan_fails_every_rank(outcomes):
    """Rank 1's record raised before the all_gather (its token count hook refused its table): rank 0 waited in
    the collective for ever. Now the failure is gathered: rank 1 raises its own error, rank 0 names rank 1's."""
    assert outcomes[1]["fails_on_one_rank"] == "sample 3 has a grid the merge does not divide"
    assert outcomes[0]["fails_on_one_rank"] == (
        "check_same_plan_across_ranks: rank 1 of the group could not record its plan (ValueError: sample 3 has a "
        "grid the merge does not divide); 1 rank(s) failed")
