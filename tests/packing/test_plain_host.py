"""`packing.plain_host`: the plain batch's clean path of `pack_batch(host_reads=True)`.

It must give exactly the micro-batch the general path gives (every field, dtype and boundary) and
never an error of its own: any batch it does not take, or that fails a test, goes to the general
path, which packs it or names the fault. Held three ways on random and hostile batches: the plain
path, the general host path (plain path switched off) and the device path (`host_reads=False`).
"""

import collections
import contextlib
import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatron_vlm_packing.packing.batch as batch_module
import megatron_vlm_packing.packing.plain_host as plain_host_module
from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.packing.plain_host import pack_plain_batch_on_host
from megatron_vlm_packing.packing.plan import PackMultiples
from tests.packing.test_host_reads import BAD_VALUES, VOCAB, batch_of, with_bad_value

PLAIN_MASKS = ("long", "bool", "int32", "none")  # the mask forms the plain path reads
LOSS_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bool, torch.int64, torch.bfloat16)


@contextlib.contextmanager
def plain_path_off():
    with mock.patch.object(batch_module, "pack_plain_batch_on_host", lambda *args, **kwargs: None):
        yield


@contextlib.contextmanager
def plain_path_spied(taken: list):
    real = batch_module.pack_plain_batch_on_host

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        taken.append(result is not None)
        return result

    with mock.patch.object(batch_module, "pack_plain_batch_on_host", spy):
        yield


@contextlib.contextmanager
def positions_compared_per_document(per_document: bool, compared: list):
    """Given positions of plans without pad slots compared per document (`plain_host._checked_given_offsets`'
    branch for long documents) from any length when `per_document`, else never; `compared` gets a True for
    each call of that branch (it reads the shared ramp)."""
    real = plain_host_module.host_ramp

    def spy(length):
        compared.append(True)
        return real(length)

    threshold = 0 if per_document else 2 ** 62
    with mock.patch.object(plain_host_module, "_COMPARED_PER_DOCUMENT_FROM", threshold), \
            mock.patch.object(plain_host_module, "host_ramp", spy):
        yield


def outcome(call):
    try:
        return call()
    except ValueError as error:
        return f"ValueError: {error}"


def three_ways(batch: dict, **kwargs):
    """(plain path on, whether it packed the batch), general host path, device path: results or messages."""
    taken = []
    with plain_path_spied(taken):
        plain = outcome(lambda: pack_batch(batch, host_reads=True, **kwargs))
    with plain_path_off():
        general = outcome(lambda: pack_batch(batch, host_reads=True, **kwargs))
    device = outcome(lambda: pack_batch(batch, host_reads=False, **kwargs))
    return plain, any(taken), general, device


def assert_identical(a, b) -> None:
    """Two micro-batches equal in every field: values, dtypes, boundaries, plan, stats, media, flags."""
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "packed_seq_params":
            for name in ("qkv_format", "max_seqlen_q", "max_seqlen_kv", "pad_between_seqs"):
                assert getattr(x, name, None) == getattr(y, name, None), name
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                u, v = getattr(x, name), getattr(y, name)
                assert u.dtype == v.dtype and torch.equal(u, v), name
        elif field.name == "indices":
            assert torch.equal(x.cu_seqlens, y.cu_seqlens) and torch.equal(x.cu_seqlens_padded, y.cu_seqlens_padded)
        elif field.name == "extras":
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), field.name
            if x.is_floating_point():  # bit for bit (-0.0 and 0.0 are equal values)
                assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), field.name
        elif field.name not in ("checked_loss_mask", "checked_media", "checked_boundaries"):  # marks: below
            assert x == y, field.name
    assert a.loss_weights_checked and b.loss_weights_checked
    assert a.boundaries_checked and b.boundaries_checked
    assert a.media_checked_by_packer and b.media_checked_by_packer


def assert_same_three_ways(batch: dict, **kwargs) -> tuple[bool, bool]:
    """(the plain path packed it, it packs at all) after holding the three outcomes equal."""
    plain, taken, general, device = three_ways(batch, **kwargs)
    if isinstance(general, str):
        assert plain == general == device
        assert not taken  # a faulty batch is never packed by the plain path
    else:
        assert not isinstance(plain, str) and not isinstance(device, str)
        assert_identical(plain, general)
        assert_identical(plain, device)
    return taken, not isinstance(general, str)


BATCHES = dict(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5).filter(any),
    style=st.sampled_from(["megatron", "hf"]), loss_dtype=st.sampled_from(LOSS_DTYPES),
    mask_form=st.sampled_from(PLAIN_MASKS + ("float", "4d", "seq_lens")), cp=st.sampled_from([1, 2, 3]),
    tp=st.sampled_from([1, 2]), fp8=st.booleans(), vocab=st.sampled_from([None, VOCAB]), seed=st.integers(0, 2 ** 16),
    positions=st.booleans(), pad_extra=st.sampled_from([None, 0, 48]),
)


def plain_batch(lengths, style, loss_dtype, mask_form, seed, positions):
    batch, keep = batch_of(lengths, 12, style=style, loss_dtype=loss_dtype, mask_form=mask_form, seed=seed,
                           positions=positions)
    del batch["side"]  # an extra key: the general path's
    return batch, keep


def layout(cp, tp, fp8, vocab, style, lengths, pad_extra) -> dict:
    kwargs = dict(label_style=style, cp_size=cp, tp_size=tp, sequence_parallel=tp > 1, fp8=fp8, vocab_size=vocab)
    if pad_extra is not None:  # static shapes: pad_to the aligned length, or 48 totals more
        multiples = PackMultiples.for_parallel(tp_size=tp, cp_size=cp, sequence_parallel=tp > 1, fp8=fp8)
        aligned = sum(-(-n // multiples.segment) * multiples.segment for n in lengths if n)
        kwargs["pad_to"] = -(-aligned // multiples.total) * multiples.total + pad_extra * multiples.total
    return kwargs


@settings(max_examples=80, deadline=None)
@given(**BATCHES)
def test_clean_plain_batches_pack_the_same_three_ways(lengths, style, loss_dtype, mask_form, cp, tp, fp8, vocab, seed,
                                                      positions, pad_extra):
    batch, keep = plain_batch(lengths, style, loss_dtype, mask_form, seed, positions)
    taken, packs = assert_same_three_ways(batch, **layout(cp, tp, fp8, vocab, style, keep.sum(1).tolist(), pad_extra))
    plain_form = mask_form in PLAIN_MASKS and loss_dtype != torch.bfloat16  # numpy has no bfloat16
    assert taken == (plain_form and packs)  # every clean batch of a plain form takes the plain path, no other does


@settings(max_examples=80, deadline=None)
@given(**BATCHES, bad=st.sampled_from(BAD_VALUES), at_pad=st.booleans(), slot=st.integers(0, 10 ** 6))
def test_a_bad_value_gives_the_same_error_or_result_three_ways(lengths, style, loss_dtype, mask_form, cp, tp, fp8,
                                                               vocab, seed, positions, pad_extra, bad, at_pad, slot):
    key, value = bad
    positions = positions or key == "position_ids"
    if key == "loss_mask" and (loss_dtype is None or not loss_dtype.is_floating_point):
        loss_dtype = torch.float32  # a NaN, negative or infinite weight needs a float loss_mask
    batch, keep = plain_batch(lengths, style, loss_dtype, mask_form, seed, positions)
    batch = with_bad_value(batch, keep, key, value, at_pad=at_pad, slot=slot)
    if batch is None:
        return
    assert_same_three_ways(batch, **layout(cp, tp, fp8, vocab, style, keep.sum(1).tolist(), pad_extra))


ROW_PREFIX_BATCHES = {**BATCHES, "cp": st.just(1), "tp": st.just(1), "fp8": st.just(False),
                      "pad_extra": st.sampled_from([None, 0])}  # plans without pad slots: documents are row prefixes


@settings(max_examples=120, deadline=None)
@given(**ROW_PREFIX_BATCHES, bad=st.sampled_from([None, *BAD_VALUES]), at_pad=st.booleans(),
       slot=st.integers(0, 10 ** 6), per_document=st.booleans())
def test_plans_without_pad_slots_pack_the_same_three_ways(lengths, style, loss_dtype, mask_form, cp, tp, fp8, vocab,
                                                          seed, positions, pad_extra, bad, at_pad, slot, per_document):
    """The plain path's one-function branch for plans without pad slots (`plain_host._pack_row_prefixes`),
    on clean batches and with one bad value, given positions compared both ways."""
    if bad is not None:
        positions = positions or bad[0] == "position_ids"
        if bad[0] == "loss_mask" and (loss_dtype is None or not loss_dtype.is_floating_point):
            loss_dtype = torch.float32
    batch, keep = plain_batch(lengths, style, loss_dtype, mask_form, seed, positions)
    if bad is not None:
        batch = with_bad_value(batch, keep, *bad, at_pad=at_pad, slot=slot)
        if batch is None:
            return
    calls = []
    real = plain_host_module._pack_row_prefixes

    def spy(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    compared = []
    with mock.patch.object(plain_host_module, "_pack_row_prefixes", spy), \
            positions_compared_per_document(per_document, compared):
        taken, packs = assert_same_three_ways(batch, **layout(cp, tp, fp8, vocab, style, keep.sum(1).tolist(),
                                                              pad_extra))
    if taken:
        assert calls and calls[-1] is not None  # no pad slots: the one-function branch packed it
        assert any(compared) == (per_document and "position_ids" in batch)
    if bad is None:
        assert taken == (mask_form in PLAIN_MASKS and loss_dtype != torch.bfloat16 and packs)


@settings(max_examples=60, deadline=None)
@given(mask=st.lists(st.lists(st.sampled_from([-1, 0, 0, 1, 1, 1, 2]), min_size=6, max_size=6), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]))
def test_any_mask_gives_the_same_lengths_or_error_three_ways(mask, dtype):
    if dtype in (torch.uint8, torch.bool):
        mask = [[max(v, 0) for v in row] for row in mask]
    ids = torch.arange(1, 1 + 6 * len(mask)).reshape(len(mask), 6)
    assert_same_three_ways({"input_ids": ids, "labels": ids + 1, "attention_mask": torch.tensor(mask).to(dtype)})



M = 2 ** 63 - 1


@pytest.mark.parametrize("mask, dtype", [
    ([[M, M, 5, 0, 0], [1, 1, 1, 1, 1]], torch.int64),  # row sum wraps to 3, the first zero's place
    ([[-(2 ** 63), 1, 0, 0, 0], [1, 1, 1, 1, 1]], torch.int64),
    ([[1, 1, 255, 0, 0], [1, 0, 0, 0, 0]], torch.uint8),
    ([[1, 1, -1, 0, 0], [1, 0, 0, 0, 0]], torch.int16),
    ([[1, 1, 2 ** 31 - 1, 0, 0], [1, 0, 0, 0, 0]], torch.int32),
    ([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], torch.int16),
], ids=["int64_wrapping_sum", "int64_min", "uint8_255", "int16_minus_one", "int32_max", "int16_full_and_empty"])
def test_extreme_mask_values_give_the_same_lengths_or_error_three_ways(mask, dtype):
    """Values whose row sums wrap or that only an unsigned reading of the mask's width sees as > 1."""
    ids = torch.arange(1, 11).reshape(2, 5)
    assert_same_three_ways({"input_ids": ids, "labels": ids + 1, "attention_mask": torch.tensor(mask, dtype=dtype)})

def _clean():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 4, 3]])
    return {"input_ids": ids, "labels": torch.tensor([[6, 7, 1, -100], [9, 4, 3, 2]]),
            "loss_mask": torch.tensor([[1.0, 1, 1, 0], [1, 0.5, 1, 1]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
            "position_ids": torch.arange(4).expand(2, 4).clone()}


@pytest.mark.parametrize("per_document", [False, True], ids=["positions_compared_at_once", "per_document"])
def test_a_clean_batch_takes_the_plain_path_in_every_plain_form(per_document):
    forms = {"as_given": _clean(), "tokens_key": {"tokens": _clean()["input_ids"],
                                                  **{k: v for k, v in _clean().items() if k != "input_ids"}},
             "bool_mask": {**_clean(), "attention_mask": _clean()["attention_mask"].bool()},
             "no_mask_full_rows": {k: v for k, v in _clean().items() if k != "attention_mask"},
             "no_loss_mask_no_positions": {k: v for k, v in _clean().items() if k not in ("loss_mask", "position_ids")},
             "float64_weights": {**_clean(), "loss_mask": _clean()["loss_mask"].double()},
             "none_values_are_absent": {**_clean(), "position_ids": None, "loss_mask": None}}
    for name, batch in forms.items():
        for kwargs in ({}, dict(cp_size=2), dict(tp_size=2, sequence_parallel=True, fp8=True), dict(pad_to=64),
                       dict(vocab_size=10)):
            with positions_compared_per_document(per_document, []):
                assert assert_same_three_ways(batch, **kwargs) == (True, True), (name, kwargs)
                # 1D positions view the indices' offsets (no copy per micro-batch), as on the general path
                micro = pack_batch(batch, host_reads=True, **kwargs)
            assert np.shares_memory(micro.position_ids.numpy(), micro.indices.offset_in_segment_host), (name, kwargs)


@pytest.mark.parametrize("per_document", [False, True], ids=["positions_compared_at_once", "per_document"])
def test_a_wrong_position_at_any_real_token_is_named_three_ways(per_document):
    """Each document's first, inner and last real token: a given position off there is the general path's error
    (the per-document comparison reads every slot of every document)."""
    clean = _clean()
    for row, length in enumerate((3, 4)):
        for place in range(length):
            for value in (place + 1, -1):
                positions = _with(clean["position_ids"], (row, place), value)
                with positions_compared_per_document(per_document, []):
                    taken, packs = assert_same_three_ways({**clean, "position_ids": positions})
                assert not taken and not packs, (row, place, value)


def _deferred_batches():
    clean = _clean()
    grad_weights = clean["loss_mask"].clone().requires_grad_()
    return {
        "media_key": {**clean, "pixel_values": torch.zeros(4, 3)},
        "seq_lens": {k: v for k, v in clean.items() if k != "attention_mask"} | {"seq_lens": torch.tensor([3, 4])},
        "document_lengths": {**clean, "document_lengths": torch.tensor([[3, 0], [2, 2]])},
        "unknown_key": {**clean, "side": torch.zeros(2, 4)},
        "int32_ids": {**clean, "input_ids": clean["input_ids"].int()},
        "int32_labels": {**clean, "labels": clean["labels"].int()},
        "both_id_keys": {**clean, "tokens": clean["input_ids"]},
        "no_labels": {k: v for k, v in clean.items() if k != "labels"},
        "bfloat16_weights": {**clean, "loss_mask": clean["loss_mask"].bfloat16()},
        "weights_with_grad": {**clean, "loss_mask": grad_weights},
        "float_mask": {**clean, "attention_mask": clean["attention_mask"].float()},
        "4d_mask": {**clean, "attention_mask": torch.ones(2, 1, 4, 4, dtype=torch.bool)},
        "mrope_positions": {**clean, "position_ids": torch.arange(4).expand(3, 2, 4).clone()},
        "short_mask": {**clean, "attention_mask": clean["attention_mask"][:, :3]},
        "holed_mask": {**clean, "attention_mask": torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1]])},
        "bad_id": {**clean, "input_ids": torch.tensor([[5, -6, 7, 0], [8, 9, 4, 3]])},
        "bad_label": {**clean, "labels": torch.tensor([[6, -7, 1, -100], [9, 4, 3, 2]])},
        "labels_copy_ids": {**clean, "labels": torch.where(clean["attention_mask"].bool(), clean["input_ids"], -100)},
        "nan_weight": {**clean, "loss_mask": torch.tensor([[1.0, float("nan"), 1, 0], [1, 1, 1, 1]])},
        "restarting_positions": {**clean, "position_ids": torch.tensor([[0, 1, 0, 0], [0, 1, 2, 3]])},
        "not_a_dict": list(clean.items()),
        # A nested tensor (strided layout) has no sizes: reading its shape raised a RuntimeError before the
        # general path could name it.
        **{f"nested_{key}": {**clean, key: torch.nested.nested_tensor(list(clean[key]))}
           for key in ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids")},
    }


@pytest.mark.parametrize("name", list(_deferred_batches()))
def test_the_plain_path_leaves_every_other_batch_to_the_general_path(name):
    batch = _deferred_batches()[name]
    assert pack_plain_batch_on_host(batch, multiples=PackMultiples(), pad_to=None, label_style="megatron",
                                    pad_token_id=0, vocab_size=None) is None
    if isinstance(batch, dict):
        taken, _ = assert_same_three_ways(batch, extra_keys=("side",) if name == "unknown_key" else ())
        assert not taken


@pytest.mark.parametrize("kwargs", [dict(pad_to=4), dict(vocab_size=9), dict(vocab_size=True), dict(label_style="x"),
                                    dict(cp_size=True), dict(fp8="no"), dict(image_token_id=9), dict(audio_token_id=9),
                                    dict(extra_keys=("other",)), dict(position_layout="BS3"),
                                    dict(mrope=lambda ids, **kw: torch.zeros(3, *ids.shape, dtype=torch.long))],
                         ids=lambda kwargs: ",".join(f"{k}={v!r}"[:24] for k, v in kwargs.items()))
def test_options_the_plain_path_does_not_take_go_to_the_general_path(kwargs):
    """Options that are faults (the general path names them, after any fault of the batch) or that ask for
    more than the batch's keys (media ids, extra keys, mRoPE) are the general path's."""
    plain, taken, general, device = three_ways(_clean(), **kwargs)
    assert not taken
    if isinstance(general, str):
        assert plain == general == device
    else:
        assert_identical(plain, general)


def _any_outcome(call):
    try:
        return call()
    except Exception as error:  # noqa: BLE001 (any exception: the plain path must raise none the general path does not)
        return f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("kwargs", [dict(extra_keys=None), dict(extra_keys=0), dict(pad_token_id=-1),
                                    dict(pad_token_id=2**63), dict(pad_token_id=True), dict(pad_token_id=1.0),
                                    dict(pad_to=True), dict(pad_to=48.0), dict(pad_to=-4), dict(spatial_merge_size=0),
                                    dict(spatial_merge_size=True)], ids=repr)
def test_options_the_general_path_refuses_with_any_error_are_not_packed_by_the_plain_path(kwargs):
    """Not only ValueErrors: the general path's TypeError of `tuple(extra_keys)` too. `pack_batch` tries the
    plain path before its own option checks, so the plain path's gate must defer every option they refuse."""
    taken = []
    with plain_path_spied(taken):
        plain = _any_outcome(lambda: pack_batch(_clean(), host_reads=True, **kwargs))
    with plain_path_off():
        general = _any_outcome(lambda: pack_batch(_clean(), host_reads=True, **kwargs))
    assert isinstance(general, str) and plain == general and not any(taken)


@pytest.mark.parametrize("kwargs", [dict(spatial_merge_size=2), dict(pad_token_id=2**63 - 1), dict(pad_to=48),
                                    dict(require_media_counts=False), dict(position_layout="3BS")], ids=repr)
def test_options_a_plain_batch_ignores_or_takes_pack_the_same_on_the_plain_path(kwargs):
    taken, packs = assert_same_three_ways(_clean(), **kwargs)
    assert taken and packs


def _strided(tensor: torch.Tensor, form: str) -> torch.Tensor:
    """The same values in another memory layout: column-major, a slice of a bigger tensor (storage offset,
    row stride), every other column of one (column stride 2), or one row expanded (row stride 0)."""
    if form == "column_major":
        return tensor.t().contiguous().t()
    if form == "expanded":
        return tensor[:1].expand(tensor.shape)
    rows, columns = tensor.shape
    big = torch.zeros(rows + 2, 2 * columns + 3, dtype=tensor.dtype)
    view = big[1:rows + 1, 3:] if form == "offset" else big[1:rows + 1, 3::2]
    view = view[:, :columns]
    view.copy_(tensor)
    return view


def _with(tensor: torch.Tensor, at: tuple[int, int], value) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[at] = value
    return tensor


def _hostile_cases():
    clean, weights = _clean(), _clean()["loss_mask"].double()
    cases = {f"{form}_{key}": ({**clean, key: _strided(clean[key], form)}, {})
             for form in ("column_major", "offset", "every_other_column") for key in clean}
    cases.update({
        "all_expanded_rows": ({k: _strided(v, "expanded") for k, v in clean.items()}, {}),
        "ids_at_int64_max": ({**clean, "input_ids": _with(clean["input_ids"], (1, 1), 2 ** 63 - 1)}, {}),
        "labels_all_ignored_hf_one_token_rows": (
            {"input_ids": clean["input_ids"][:, :1], "labels": torch.full((2, 1), -100)}, dict(label_style="hf")),
        "pad_token_at_vocab_size_in_pad_slots": (clean, dict(pad_token_id=10, vocab_size=10, pad_to=16)),
        "float64_weight_above_float32_max_at_a_pad": ({**clean, "loss_mask": _with(weights, (0, 3), 1e300)}, {}),
        "float64_weight_float32_max": (
            {**clean, "loss_mask": _with(weights, (0, 1), torch.finfo(torch.float32).max)}, {}),
        "float64_negative_subnormal_weight": ({**clean, "loss_mask": _with(weights, (0, 1), -1e-320)}, {}),
        "uint8_weights_255": ({**clean, "loss_mask": (clean["loss_mask"] * 255).to(torch.uint8)}, {}),
        "int8_weights": ({**clean, "loss_mask": clean["loss_mask"].to(torch.int8)}, {}),
        "ordered_dict": (collections.OrderedDict(clean), {}),
        # Hugging Face labels: a document's first label, which no shifted target holds, is checked all the same
        "hf_bad_first_label": ({**clean, "labels": _with(clean["labels"], (1, 0), -7)}, dict(label_style="hf")),
        "hf_first_label_at_vocab": ({**clean, "labels": _with(clean["labels"], (0, 0), 10)},
                                    dict(label_style="hf", vocab_size=10)),
        "keys_reversed": (dict(reversed(list(clean.items()))), dict(extra_keys=[], position_layout="B3S")),
        # no -100 among the real targets (the clean batch's): the weights are the values, bit for bit
        "negative_zero_and_subnormal_weights": (
            {**clean, "loss_mask": _with(_with(clean["loss_mask"], (0, 1), -0.0), (1, 2), 1e-40)}, {}),
        "an_ignored_target_negative_zero_weight": (
            {**clean, "labels": _with(clean["labels"], (1, 1), -100),
             "loss_mask": _with(clean["loss_mask"], (1, 1), -0.0)}, {}),
    })
    for dtype in (torch.float16, torch.bool, torch.int64):
        cases[f"no_ignored_target_{dtype}_weights"] = ({**clean, "loss_mask": clean["loss_mask"].to(dtype)}, {})
    for dtype in (torch.int32, torch.uint8, torch.int8, torch.float16, torch.float64, torch.bool):
        cases[f"positions_{dtype}"] = ({**clean, "position_ids": clean["position_ids"].to(dtype)}, {})
    cases["positions_halves"] = ({**clean, "position_ids": clean["position_ids"] / 2}, {})
    return cases


@pytest.mark.parametrize("per_document", [False, True], ids=["positions_compared_at_once", "per_document"])
@pytest.mark.parametrize("name", list(_hostile_cases()))
def test_hostile_layouts_dtypes_and_extremes_are_the_same_three_ways(name, per_document):
    """What the Hypothesis batches do not hold: strided tensors, other position / weight dtypes, extreme values."""
    batch, kwargs = _hostile_cases()[name]
    with positions_compared_per_document(per_document, []):
        taken, packs = assert_same_three_ways(batch, **kwargs)
    # Left to the general path: a test tripped by pad slots only, a weight < 0 that float32 makes -0.0, a dict subclass.
    general_only = ("pad_token_at_vocab_size_in_pad_slots", "float64_negative_subnormal_weight", "ordered_dict")
    assert taken == (packs and name not in general_only)
