"""`packed_value_checks.packed_value_faults`' range tests of ids and labels (one unsigned comparison each for signed
integers) against their definitions: an id outside [0, vocab_size); a label other than -100 outside it.
Every signed and unsigned width, the extremes of each, vocab sizes below, at and above 2**(w-1). (Its test of
labels given in the other style is held to the row counts in tests/packing/test_label_style.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing.packing.checks import IGNORE_INDEX
from megatron_vlm_packing.packing.packed_value_checks import _ids_out_of_range, _labels_out_of_range

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
