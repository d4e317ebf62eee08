"""`packed_value_checks.packed_value_faults`' range tests of ids and labels (one unsigned comparison each for signed
integers) against their definitions: an id outside [0, vocab_size); a label other than -100 outside it.
Every signed and unsigned width, the extremes of each, vocab sizes below, at and above 2**(w-1). And its
test of Megatron labels that copy their ids (settled by the first target where it differs) against its
definition."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing.packing.checks import IGNORE_INDEX
from megatron_vlm_packing.packing.packed_value_checks import _ids_out_of_range, _labels_out_of_range, _targets_copy_ids

DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def values_of(dtype, draw_values: list[int]) -> np.ndarray:
    info = np.iinfo(dtype)
    specials = [info.min, info.max, info.min + 1, info.max - 1, 0, 1, -1, -100, -101, -99]
    return np.array([specials[v % len(specials)] if v < 0 else v for v in draw_values
                     if info.min <= (specials[v % len(specials)] if v < 0 else v) <= info.max] or [0], dtype=dtype)


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES), raw=st.lists(st.integers(-10, 300), min_size=1, max_size=12),
       vocab=st.sampled_from([None, 1, 100, 127, 128, 129, 255, 2 ** 15, 2 ** 31, 2 ** 31 + 5, 2 ** 63 - 1]))
def test_range_tests_equal_their_definitions(dtype, raw, vocab):
    values = values_of(dtype, raw)
    as_ints = [int(v) for v in values]
    outside = [v < 0 or (vocab is not None and v >= vocab) for v in as_ints]
    assert _ids_out_of_range(values, vocab) == any(outside)
    ignored = sum(v == IGNORE_INDEX for v in as_ints)
    assert _labels_out_of_range(values, ignored, vocab) == any(o and v != IGNORE_INDEX for o, v in zip(outside, as_ints))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_negative_id_is_out_of_range_under_a_vocab_above_the_signed_half(dtype):
    """The bound is min(vocab_size, 2**(w-1)): with vocab_size above it, -1 (unsigned 2**w - 1) stays out."""
    assert _ids_out_of_range(np.array([5, -1], dtype=dtype), 2 ** 40)
    assert not _ids_out_of_range(np.array([5, np.iinfo(dtype).max - 1], dtype=dtype), 2 ** 63 - 1)
    assert _labels_out_of_range(np.array([-100, -2], dtype=dtype), 1, 2 ** 40)
    assert not _labels_out_of_range(np.array([-100, 7], dtype=dtype), 1, 2 ** 40)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.sampled_from([0, 1, 2, 7, -1, -100]), min_size=1, max_size=10),
       targets=st.lists(st.sampled_from(["id", "id", -100, 0, 1, 7, -1]), min_size=10, max_size=10),
       lead=st.sampled_from([0, 1, 4095, 4096, 5000]), lead_target=st.sampled_from([-100, "id"]))
def test_targets_copying_ids_equal_the_definition(ids, targets, lead, lead_target):
    """Exactly the ignored targets differ from their ids, whatever the ids (negative, -100) and wherever the
    first target lies (in the first 4096 slots or after them): the first target's shortcut never changes it."""
    ids = np.array([0] * lead + ids, dtype=np.int64)
    labels = np.array([ids[i] if t == "id" else t for i, t in enumerate([lead_target] * lead + targets[:len(ids) - lead])],
                      dtype=np.int64)
    is_target = labels != IGNORE_INDEX
    ignored = labels.size - int(np.count_nonzero(is_target))
    if labels.size - ignored < 1:
        return  # (packed_value_faults asks from 2 real targets)
    definition = np.count_nonzero(labels != ids) == ignored
    assert _targets_copy_ids(ids, labels, is_target, ignored, ids_in_range=bool((ids >= 0).all())) == definition
    assert _targets_copy_ids(ids, labels, is_target, ignored, ids_in_range=False) == definition
