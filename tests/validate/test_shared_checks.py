"""The validator's integer, label_style and mrope checks follow the packers' shared rules
(`packing.bounds.is_int`, `row_fields.check_label_style`, `row_fields.check_mrope`): numpy ints are taken,
bools, floats, strings and tensors are still refused, and the messages are the packers'."""

import numpy as np
import pytest
import torch

from megatron_vlm_packing.validate import SourceRows, validate_packed_batch
from megatron_vlm_packing.validate.inputs import build_inputs
from megatron_vlm_packing.validate.step_probe import StepProbe, with_parity_probe

from tests.validate.conftest import clone


def _longest(fields) -> int:
    return int((fields["cu_seqlens_padded"][1:] - fields["cu_seqlens_padded"][:-1]).max())


def test_a_numpy_max_seqlen_covering_every_document_is_clean(vlm_pack):
    fields = vlm_pack[1]
    report = validate_packed_batch(**clone(fields, max_seqlen=np.int64(_longest(fields))))
    assert report.ok, str(report)  # before: "max_seqlen_q is 14 (int64), not an int"


def test_a_numpy_max_seqlen_below_the_longest_document_is_named_with_its_numbers(vlm_pack):
    fields = vlm_pack[1]
    longest = _longest(fields)
    report = validate_packed_batch(**clone(fields, max_seqlen=np.int32(longest - 1)))
    assert report.failed_checks == {"max_seqlen"}, str(report)
    assert f"max_seqlen_q={longest - 1} but the longest document has {longest} slots" in str(report)


@pytest.mark.parametrize("value", [True, np.True_, 14.0, np.float64(14), "14"])
def test_a_max_seqlen_that_is_not_an_int_is_still_reported(vlm_pack, value):
    report = validate_packed_batch(**clone(vlm_pack[1], max_seqlen=value))
    assert report.failed_checks == {"max_seqlen"}, str(report)
    assert f"max_seqlen_q is {value!r} ({type(value).__name__}), not an int" in str(report)


def test_step_probe_takes_a_numpy_every_as_a_python_int():
    probe = StepProbe(np.int64(3), on_result=None)
    assert probe.every == 3 and type(probe.every) is int


@pytest.mark.parametrize("every", [True, 2.0, "2", 0, -1, np.int64(0), torch.tensor(2), None])
def test_step_probe_refuses_every_that_is_not_a_positive_int(every):
    with pytest.raises(ValueError) as err:
        StepProbe(every)
    assert str(err.value) == f"parity_probe_every must be an int >= 1, got {every!r}"


def test_with_parity_probe_takes_a_numpy_every():
    with_parity_probe(lambda data_iterator, model: None, every=np.int32(2))  # before: a ValueError


@pytest.mark.parametrize("every", [True, 2.5, "1", 0, np.uint8(0), torch.tensor(1)])
def test_with_parity_probe_refuses_every_that_is_not_a_positive_int(every):
    with pytest.raises(ValueError) as err:
        with_parity_probe(lambda data_iterator, model: None, every=every)
    assert str(err.value) == f"every must be an int >= 1, got {every!r}"


def test_source_rows_label_style_is_refused_with_the_packers_message():
    with pytest.raises(ValueError, match=r"^label_style must be 'megatron' or 'hf', got 'HF'$"):
        SourceRows(input_ids=torch.ones(1, 3, dtype=torch.long), label_style="HF")


@pytest.mark.parametrize("mrope", [5, "qwen2_vl", {"family": "qwen2_vl"}])
def test_build_inputs_refuses_an_mrope_that_is_no_config_nor_callable_with_the_packers_message(mrope):
    with pytest.raises(ValueError, match=rf"^mrope must be an MRopeConfig, a callable or None, got "
                                         rf"{type(mrope).__name__}$"):
        build_inputs(input_ids=torch.ones(1, 4, dtype=torch.long), mrope=mrope)
