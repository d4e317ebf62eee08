"""Bins: nothing lost, capacity respected after alignment, plans equal make_pack_plan's and pack_batch's."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import PackMultiples, make_pack_plan, pack_batch
from megatron_vlm_packing.planner import Bin, BinLayout, best_fit_decreasing
from megatron_vlm_packing.planner.bins import balanced_fit, split_to_count

MULTIPLES = [PackMultiples(), PackMultiples.for_parallel(cp_size=2), PackMultiples.for_parallel(tp_size=2, cp_size=2,
             sequence_parallel=True), PackMultiples.for_parallel(cp_size=2, fp8=True)]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=1, max_size=60), capacity=st.integers(64, 200),
       seed=st.integers(0, 10), balanced=st.booleans())
def test_every_item_once_and_capacity_respected(sizes, capacity, seed, balanced):
    slots = np.asarray(sizes, dtype=np.int64)
    if balanced:
        extra = np.random.default_rng(seed).random(len(sizes)) * slots
        bins = balanced_fit(slots, extra, capacity, max(1, -(-int(slots.sum()) // capacity)))
    else:
        bins = best_fit_decreasing(slots, capacity)
    assert sorted(p for b in bins for p in b) == list(range(len(sizes)))
    assert all(b and slots[b].sum() <= capacity for b in bins)


def test_best_fit_fills_exact_pairs():
    # 6 items that pair up exactly into 3 full bins.
    bins = best_fit_decreasing(np.asarray([7, 3, 6, 4, 5, 5]), 10)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2, 3], [4, 5]]


def test_split_to_count_keeps_items_and_refuses_too_few():
    slots = np.asarray([5, 4, 3, 2, 1])
    split = split_to_count([[0, 1, 2, 3, 4]], 3, slots)
    assert len(split) == 3 and sorted(p for b in split for p in b) == [0, 1, 2, 3, 4]
    assert split_to_count([[0, 1]], 3, slots) is None


@pytest.mark.parametrize("multiples", MULTIPLES, ids=str)
@pytest.mark.parametrize("static", [True, False])
def test_bin_plan_is_make_pack_plans(multiples, static):
    layout = BinLayout(capacity=multiples.total * 40, multiples=multiples, static_shapes=static)
    tokens = np.asarray([7, 1, 13, 4])
    slots = layout.slot_sizes(tokens)
    assert (slots % multiples.segment == 0).all() and (slots >= tokens).all()
    physical = layout.physical(int(slots.sum()))
    plan = Bin((3, 1, 4, 0), tuple(tokens.tolist()), physical, 0.0).plan(layout)
    expected = make_pack_plan(tokens.tolist(), row_capacity=13, multiples=multiples,
                              pad_to=layout.capacity if static else None)
    assert plan == expected and plan.total == physical and physical <= layout.capacity


def test_oversize_error_names_sample_and_size():
    layout = BinLayout(capacity=16, multiples=PackMultiples(segment=4, total=8))
    with pytest.raises(ValueError, match=r"sample 42 \(20 slots\)"):
        layout.check_oversize(layout.slot_sizes(np.asarray([3, 17])), np.asarray([7, 42]))
    own = BinLayout(capacity=16, multiples=PackMultiples(segment=4, total=8), oversize="own_bin")
    assert own.check_oversize(own.slot_sizes(np.asarray([3, 17])), np.asarray([7, 42])).tolist() == [1]
    assert own.physical(20) == 24  # its own bin, rounded up to the total multiple: nothing truncated
    with pytest.raises(ValueError, match="capacity=12 must be a positive multiple"):
        BinLayout(capacity=12, multiples=PackMultiples(segment=8, total=8))


def test_pack_batch_builds_the_bins_plan():
    """A bin of real synthetic samples, collated and packed, has exactly the planned layout."""
    samples = synthetic_samples(5, seed=3, cfg=SyntheticVLMConfig())
    multiples = PackMultiples.for_parallel(tp_size=2, cp_size=2, sequence_parallel=True)
    layout = BinLayout(capacity=multiples.total * 200, multiples=multiples)
    tokens = tuple(len(s["input_ids"]) for s in samples)
    planned = Bin(tuple(range(5)), tokens, layout.physical(int(layout.slot_sizes(np.asarray(tokens)).sum())), 0.0)
    packed = pack_batch(collate(samples), tp_size=2, cp_size=2, sequence_parallel=True, pad_to=planned.physical,
                        label_style="hf", image_token_id=SyntheticVLMConfig().image_token_id)
    assert packed.plan.real_lengths == planned.plan(layout).real_lengths
    assert packed.plan.physical_lengths == planned.plan(layout).physical_lengths
    assert packed.input_ids.shape == (1, layout.capacity) and torch.equal(
        packed.packed_seq_params.cu_seqlens_q_padded, planned.plan(layout).cu_seqlens_padded())


@pytest.mark.parametrize("slots, capacity, message", [
    ([9, 3], 8, r"best_fit_decreasing's slots must lie in \[1, 8\] \(the capacity\); item 0 is 9"),  # a bin of 9
    ([-1, 3], 8, r"slots must lie in \[1, 8\] \(the capacity\); item 0 is -1"),
    ([3, 4], 0, r"best_fit_decreasing's capacity must be a positive int, got 0"),  # bins over it
    ([3.5, 4], 8, r"best_fit_decreasing's slots must be a 1-D array of ints, got float64 \(2,\)"),
])
def test_best_fit_decreasing_refuses_items_it_cannot_place_within_capacity(slots, capacity, message):
    """Each was packed into bins larger than the capacity (or of fractional size), silently."""
    with pytest.raises(ValueError, match=message):
        best_fit_decreasing(np.asarray(slots), capacity)
    assert best_fit_decreasing(np.asarray([]), 8) == []  # no items (numpy's empty array is float64), as before


@pytest.mark.parametrize("costs, ranks, per_rank, message", [
    ([1.0, 2.0], -1, -2, r"num_ranks and per_rank must be positive ints, got -1 and -2"),  # IndexError
    ([1.0, 2.0], True, 2, r"num_ranks and per_rank must be positive ints, got True and 2"),
    ([float("nan"), 1.0], 2, 1, r"costs must be finite and >= 0; bin 0 costs nan"),  # placed as if free
])
def test_assign_to_ranks_refuses_what_it_cannot_balance(costs, ranks, per_rank, message):
    from megatron_vlm_packing.planner import assign_to_ranks

    with pytest.raises(ValueError, match=message):
        assign_to_ranks(np.asarray(costs), ranks, per_rank)


def test_bins_no_pack_can_hold_are_refused_when_planned():
    """A pack's cu_seqlens are int32 (T < 2**31). BinLayout took capacity=2**31 (or 2**62) and the planner laid out
    bins of that many slots, which Bin.plan and pack_batch refused only when the loader packed them; an oversize
    sample of 2**31 tokens under oversize='own_bin' likewise got a bin of its own that no pack can hold."""
    from megatron_vlm_packing.planner import PlannerConfig, SampleTable, plan_epoch

    for capacity in (2**31, 2**62):
        with pytest.raises(ValueError, match=rf"capacity={capacity} must be below 2\*\*31"):
            BinLayout(capacity=capacity)
    assert BinLayout(capacity=2**31 - 1).capacity == 2**31 - 1
    cp2 = PackMultiples.for_parallel(cp_size=2)
    table = SampleTable(text_tokens=[5, 2**31 - 3, 7])
    config = PlannerConfig(layout=BinLayout(capacity=64, multiples=cp2, oversize="own_bin"))
    with pytest.raises(ValueError, match=r"sample 1 \(2147483648 slots\) .* more than int32 cu_seqlens can hold"):
        plan_epoch(table, config)
    assert sorted(b.tokens for b in plan_epoch(SampleTable(text_tokens=[5, 2**31 - 4, 7]), config).bins()) \
        == [(7, 5), (2**31 - 4,)]
