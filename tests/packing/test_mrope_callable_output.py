"""What a position callable (`pack_batch(mrope=callable)` / `pad_batch`) returns is checked like [3, B, S]
`position_ids` given in the batch: dense, with values, integer or real, finite at real tokens. NaN and inf went
into the pack (the rotary turns them into NaN activations) and bool, complex, meta and sparse outputs crashed in
the pack with a TypeError or RuntimeError."""

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch

IDS = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
GOOD = (torch.cumsum(MASK, dim=1) - 1).expand(3, 2, 4)  # [3, B, S] text positions


def _callable(output):
    def index(input_ids, attention_mask=None):
        return output
    return index


def _call(how, output, **options):
    batch = {"input_ids": IDS, "labels": IDS, "attention_mask": MASK}
    if how == "pad":
        return pad_batch(batch, mrope=_callable(output), label_style="hf", **options)
    return pack_batch(batch, mrope=_callable(output), label_style="hf", cp_size=2 if how == "pack_cp2" else 1,
                      **options)


HOWS = ["pack", "pack_cp2", "pad"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_positions_at_a_real_token_are_refused(how, value):
    output = GOOD.float().clone()
    output[1, 1, 1] = value
    with pytest.raises(ValueError, match=rf"the mrope callable index gave channel 1 row 1 position 1 the position "
                                         rf"{value}: mRoPE positions must be finite"):
        _call(how, output)


@pytest.mark.parametrize("how", HOWS)
def test_non_finite_positions_at_pad_slots_are_rebuilt_not_refused(how):
    output = GOOD.float().clone()
    output[:, 1, 3] = float("nan")  # a pad slot: packing rebuilds its position
    expected = _call(how, GOOD.float()).position_ids
    assert torch.equal(_call(how, output).position_ids, expected)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64])
def test_bool_or_complex_positions_are_refused(how, dtype):
    with pytest.raises(ValueError, match=rf"the mrope callable index returned dtype {dtype}: mRoPE positions must "
                                         r"hold integer or real positions"):
        _call(how, GOOD.to(dtype))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_positions_without_dense_values_are_refused(how, kind):
    output = GOOD.to("meta") if kind == "meta" else GOOD.to_sparse()
    message = "is a meta tensor: it holds no values" if kind == "meta" else "has layout torch.sparse_coo"
    with pytest.raises(ValueError, match=rf"the output of the mrope callable index {message}"):
        _call(how, output)


@pytest.mark.parametrize("how", HOWS)
def test_wide_unsigned_positions_read_as_int64_and_uint64_is_refused(how):
    expected = _call(how, GOOD.clone()).position_ids
    assert torch.equal(_call(how, GOOD.to(torch.uint32)).position_ids, expected)
    with pytest.raises(ValueError, match=r"positions from the mrope callable index has dtype torch.uint64"):
        _call(how, GOOD.to(torch.uint64))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_positions_are_refused(how, dtype):
    """bf16 holds whole numbers exactly up to 256 only (fp16 2048; fractional Omni positions fewer): the
    rotary would read the rounded positions, silently. Refused by dtype, whatever the values (no read)."""
    with pytest.raises(ValueError, match=rf"the mrope callable index returned dtype {dtype}, which holds whole numbers exactly only up to .*int64 or float32"):
        _call(how, GOOD.to(dtype))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_positions_in_the_batch_are_refused(how, dtype):
    batch = {"input_ids": IDS, "labels": IDS, "attention_mask": MASK, "position_ids": GOOD.to(dtype)}
    entry = (lambda b: pad_batch(b, label_style="hf")) if how == "pad" else \
        (lambda b: pack_batch(b, label_style="hf", cp_size=2 if how == "pack_cp2" else 1))
    with pytest.raises(ValueError, match=rf"position_ids has dtype {dtype}, which holds .*int64 or float32"):
        entry(batch)


@pytest.mark.parametrize("how", HOWS)
def test_float32_and_float64_positions_are_taken(how):
    expected = _call(how, GOOD.clone()).position_ids
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(_call(how, GOOD.to(dtype)).position_ids.long(), expected)
