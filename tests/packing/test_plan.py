import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing.packing import (
    PackMultiples, PackPlan, make_pack_plan, pack_positions, pack_rows, plan_indices, segment_positions, unpack_rows,
)
from megatron_vlm_packing.packing.indices import host_ramp

parallel_configs = st.tuples(
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 4]), st.booleans(), st.booleans()
).filter(lambda config: config[0] > 1 or not config[2])  # SP needs TP, as Megatron-Core's config says


def test_multiples_for_parallel():
    assert PackMultiples.for_parallel() == PackMultiples(1, 1)
    assert PackMultiples.for_parallel(cp_size=2) == PackMultiples(4, 4)
    assert PackMultiples.for_parallel(tp_size=2, sequence_parallel=True) == PackMultiples(1, 2)
    assert PackMultiples.for_parallel(tp_size=2, sequence_parallel=False) == PackMultiples(1, 1)
    # CP=2 x TP=4 x SP: segments of 4, T/cp divisible by tp -> T multiple of lcm(4, 8) = 8
    assert PackMultiples.for_parallel(tp_size=4, cp_size=2, sequence_parallel=True) == PackMultiples(4, 8)
    # fp8: each rank's local slice a multiple of 16
    assert PackMultiples.for_parallel(tp_size=2, cp_size=2, sequence_parallel=True, fp8=True) == PackMultiples(4, 64)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        PackMultiples.for_parallel(tp_size=0)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(tp_size=True), r"tp_size must be a positive int, got True"),
    (dict(cp_size=2.0), r"cp_size must be a positive int, got 2\.0"),
    (dict(sequence_parallel=1, tp_size=2), r"sequence_parallel must be a bool, got 1"),
    (dict(sequence_parallel=0), r"sequence_parallel must be a bool, got 0"),
    (dict(fp8="false"), r"fp8 must be a bool, got 'false' \(for Megatron's fp8 format: fp8=config.fp8 is not None\)"),
    (dict(fp8=None), r"fp8 must be a bool, got None"),
])
def test_multiples_refuse_what_is_not_a_size_or_a_flag(kwargs, expected):
    # A bool read as size 1, or a truthy string read as "on", would align the pack for another layout.
    with pytest.raises(ValueError, match=expected):
        PackMultiples.for_parallel(**kwargs)


def test_sequence_parallelism_without_tensor_parallelism_is_refused_as_megatron_core_does():
    # Megatron-Core's ModelParallelConfig raises "Cannot use sequence parallelism without tensor parallelism"
    # (0.16.1 and 0.19); the multiples took it and aligned as if SP were off, a layout no model can have.
    for tp in (1, np.int64(1)):
        with pytest.raises(ValueError, match=r"sequence_parallel=True needs tp_size > 1, got tp_size=1 \(cp_size=2\): "
                                             r"Megatron-Core refuses sequence parallelism without tensor parallelism"):
            PackMultiples.for_parallel(tp_size=tp, cp_size=2, sequence_parallel=True)
    assert PackMultiples.for_parallel(tp_size=1, cp_size=2) == PackMultiples(4, 4)


@pytest.mark.parametrize("pad_to", [np.int64(16), np.uint16(16)], ids=["int64", "uint16"])
def test_plan_takes_a_numpy_pad_to_as_a_python_int(pad_to):
    plan = make_pack_plan([3, 5], row_capacity=8, pad_to=pad_to)
    assert type(plan.total) is int and type(plan.max_seqlen) is int and plan.physical_lengths == (3, 13)
    assert all(type(n) is int for n in plan.physical_lengths)


def test_plan_refuses_a_tensor_pad_to():
    with pytest.raises(ValueError, match=r"pass a Python int \(int\(pad_to\)\), not a tensor"):
        make_pack_plan([3, 5], row_capacity=8, pad_to=torch.tensor(16))


def test_worked_example():
    plan = make_pack_plan([5, 0, 3], row_capacity=8, multiples=PackMultiples(segment=4, total=4))
    assert plan.segment_rows == (0, 2)
    assert plan.real_lengths == (5, 3) and plan.physical_lengths == (8, 4)
    assert plan.cu_seqlens().tolist() == [0, 5, 8] and plan.cu_seqlens_padded().tolist() == [0, 8, 12]
    assert plan.cu_seqlens().dtype == torch.int32 and plan.max_seqlen == 8
    assert isinstance(plan.max_seqlen, int)


def test_total_padding_grows_the_last_segment_only():
    plan = make_pack_plan([3, 5], row_capacity=8, multiples=PackMultiples(segment=1, total=8))
    assert plan.physical_lengths == (3, 5) and plan.total == 8
    plan = make_pack_plan([3, 6], row_capacity=8, multiples=PackMultiples(segment=1, total=8))
    assert plan.physical_lengths == (3, 13)
    plan = make_pack_plan([3, 6], row_capacity=8, pad_to=32)
    assert plan.physical_lengths == (3, 29) and plan.num_segments == 2


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(row_lengths=[0, 0]), r"no real tokens \(2 rows, all empty\)"),
        (dict(row_lengths=[9]), r"must lie in \[0, 8\]"),
        (dict(row_lengths=[8, 8], pad_to=12), r"pad_to=12 is smaller than the 16 physical tokens.*16 real tokens in 2 samples"),
        (dict(row_lengths=[2], pad_to=10, multiples=PackMultiples(4, 4)), r"pad_to=10 is not a multiple of the total multiple 4"),
        (dict(row_lengths=[2], pad_to=8.0), r"pad_to must be an int \(the packed length T\) or None, got 8\.0"),
        (dict(row_lengths=[2], pad_to=True), r"pad_to must be an int \(the packed length T\) or None, got True"),
    ],
)
def test_plan_rejects(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        make_pack_plan(row_capacity=8, **kwargs)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(any),
    config=parallel_configs,
    extra=st.integers(0, 3),
    use_pad_to=st.booleans(),
)
def test_plan_contract(lengths, config, extra, use_pad_to):
    tp, cp, sp, fp8 = config
    multiples = PackMultiples.for_parallel(tp_size=tp, cp_size=cp, sequence_parallel=sp, fp8=fp8)
    natural = make_pack_plan(lengths, row_capacity=12, multiples=multiples)
    pad_to = natural.total + extra * multiples.total if use_pad_to else None
    plan = make_pack_plan(lengths, row_capacity=12, multiples=multiples, pad_to=pad_to)
    # Contract item 2: two boundary sets, alignment, no zero-length segments.
    assert plan.real_lengths == tuple(n for n in lengths if n > 0)
    assert all(p >= r > 0 for p, r in zip(plan.physical_lengths, plan.real_lengths))
    assert all(p % multiples.segment == 0 for p in plan.physical_lengths)
    assert plan.total % multiples.total == 0
    if cp > 1:
        assert all(p % (2 * cp) == 0 for p in plan.physical_lengths)
    if sp:
        assert (plan.total // cp) % tp == 0
    if pad_to is not None:
        assert plan.total == pad_to
    # Only the last segment takes total-level padding.
    assert plan.physical_lengths[:-1] == natural.physical_lengths[:-1]
    assert plan.max_seqlen >= max(plan.physical_lengths)
    # make_pack_plan skips PackPlan's own checks: the checking constructor takes the same fields.
    rebuilt = PackPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(PackPlan)})
    assert rebuilt == plan and type(plan) is PackPlan
    assert (rebuilt.total, rebuilt.max_seqlen, rebuilt.num_real_tokens) == (plan.total, plan.max_seqlen,
                                                                            plan.num_real_tokens)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 10), min_size=1, max_size=5).filter(any),
    config=parallel_configs,
    trailing=st.sampled_from([(), (3,)]),
)
def test_pack_unpack_round_trip_and_positions(lengths, config, trailing):
    tp, cp, sp, fp8 = config
    multiples = PackMultiples.for_parallel(tp_size=tp, cp_size=cp, sequence_parallel=sp, fp8=fp8)
    batch, seq = len(lengths), 10
    plan = make_pack_plan(lengths, row_capacity=seq, multiples=multiples)
    idx = plan_indices(plan)
    rows = torch.randn(batch, seq, *trailing)
    packed = pack_rows(rows, idx, pad_value=-7.0)
    assert packed.shape == (1, plan.total, *trailing)
    keep = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
    # Real tokens in document order, pad slots hold the pad value.
    assert torch.equal(packed[0][idx.is_real], rows[keep])
    assert bool((packed[0][~idx.is_real] == -7.0).all())
    back = unpack_rows(packed, idx, batch_size=batch, row_length=seq, pad_value=0.0)
    assert torch.equal(back[keep], rows[keep]) and bool((back[~keep] == 0).all())
    # Positions restart at 0 in every document; pads never restart.
    pos = segment_positions(idx)[0]
    starts = plan.cu_seqlens_padded()[:-1].long()
    assert bool((pos[starts] == 0).all()) and int((pos == 0).sum()) == plan.num_segments
    assert torch.equal(pos[idx.is_real], torch.cat([torch.arange(n) for n in plan.real_lengths]))
    # Padding mask exactly at physical gaps.
    assert int((~idx.is_real).sum()) == plan.total - plan.num_real_tokens


def test_pack_positions_3d_pads_continue_after_the_document():
    plan = make_pack_plan([3, 2], row_capacity=4, multiples=PackMultiples(4, 4))
    idx = plan_indices(plan)
    pos = torch.tensor([[[0, 1, 5, 0], [0, 1, 0, 0]], [[0, 2, 3, 0], [0, 4, 0, 0]], [[0, 1, 1, 0], [0, 3, 0, 0]]])
    packed = pack_positions(pos, idx)
    assert packed.shape == (3, 1, 8)
    assert packed[:, 0].tolist() == [[0, 1, 5, 6, 0, 1, 5, 6], [0, 2, 3, 6, 0, 4, 5, 6], [0, 1, 1, 6, 0, 3, 5, 6]]


def test_pack_keeps_autograd():
    plan = make_pack_plan([2, 3], row_capacity=3)
    idx = plan_indices(plan)
    rows = torch.randn(2, 3, 4, requires_grad=True)
    pack_rows(rows, idx).sum().backward()
    assert rows.grad[0, 2].abs().sum() == 0 and rows.grad[0, :2].eq(1).all() and rows.grad[1].eq(1).all()


@pytest.mark.parametrize("length", [0, 1, 2, 3, 5, 1024, 1025, 40000])
def test_host_ramp_is_a_read_only_arange(length):
    ramp = host_ramp(length)
    assert ramp.dtype == np.int64 and np.array_equal(ramp, np.arange(length))
    assert not ramp.flags.writeable
    with pytest.raises(ValueError):
        ramp[:1] = 7


def test_host_offsets_and_positions_are_copies_of_the_shared_ramp():
    # Offsets are slices of one shared ramp: what leaves the plan must be its own array, so a caller that
    # writes its positions in place reaches neither the ramp nor the next micro-batch.
    plan = make_pack_plan([5], row_capacity=8)  # one document: the one case a concatenation could skip
    positions = segment_positions(plan_indices(plan))
    positions.add_(100)
    assert segment_positions(plan_indices(plan)).tolist() == [[0, 1, 2, 3, 4]]
    assert host_ramp(5).tolist() == [0, 1, 2, 3, 4]
