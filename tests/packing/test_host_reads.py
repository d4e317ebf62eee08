"""`pack_batch(host_reads=True)`, the DataLoader worker's path (lengths read first, the value checks
made over the packed tokens, numpy for the small ops), gives exactly what the device path gives: the
same micro-batch for every batch form, the same ValueError for every bad input."""

import functools
from collections import UserDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.adversarial.test_packing_inputs as adversarial
from megatron_vlm_packing.packing import pack_batch

VOCAB = 60
FIELDS = ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask")
LOSS_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.bool, torch.int64)
MASK_FORMS = ("long", "bool", "int32", "float", "4d", "seq_lens", "none")


def assert_same(host, device) -> None:
    for name in FIELDS:
        a, b = getattr(host, name), getattr(device, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
        assert torch.equal(getattr(host.packed_seq_params, name), getattr(device.packed_seq_params, name)), name
    assert host.plan == device.plan and host.stats == device.stats
    assert host.extras.keys() == device.extras.keys()
    assert all(torch.equal(host.extras[k], device.extras[k]) for k in host.extras)


def both_paths(batch: dict, **kwargs):
    """(host_reads=True result, device-path result), or the two ValueError messages."""
    outcomes = []
    for host_reads in (True, False):
        try:
            outcomes.append(pack_batch(batch, host_reads=host_reads, **kwargs))
        except ValueError as error:
            outcomes.append(str(error))
    return outcomes


def batch_of(lengths, row_length, *, style, loss_dtype, mask_form, seed, positions=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), row_length + 1), generator=g)
    keep = torch.arange(row_length)[None] < torch.tensor(lengths)[:, None]
    if mask_form == "none":
        keep = torch.ones_like(keep)
    tokens = ids[:, :-1]
    labels = tokens if style == "hf" else ids[:, 1:]
    labels = torch.where(torch.rand(labels.shape, generator=g) < 0.2, -100, labels)  # some ignored targets
    batch = {"input_ids": torch.where(keep, tokens, 0), "labels": torch.where(keep, labels, -100),
             "side": torch.randn(len(lengths), row_length, 2, generator=g)}
    if positions:  # Megatron batches carry [B, S] position_ids: checked 0..n-1 on real tokens
        batch["position_ids"] = torch.arange(row_length).expand(len(lengths), row_length).clone()
    if loss_dtype is not None:
        weights = torch.rand(len(lengths), row_length, generator=g) * 3
        batch["loss_mask"] = torch.where(keep, weights, 0.0).to(loss_dtype)
    if mask_form == "seq_lens":
        batch["seq_lens"] = torch.tensor(lengths)
    elif mask_form == "4d":
        causal = torch.ones(row_length, row_length, dtype=torch.bool).tril()
        batch["attention_mask"] = ~(causal[None] & keep[:, None, :] & keep[:, :, None])[:, None]
    elif mask_form != "none":
        batch["attention_mask"] = keep.to({"long": torch.long, "bool": torch.bool, "int32": torch.int32,
                                           "float": torch.float32}[mask_form])
    return batch, keep


BATCHES = dict(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5).filter(any),
    style=st.sampled_from(["megatron", "hf"]), loss_dtype=st.sampled_from(LOSS_DTYPES),
    mask_form=st.sampled_from(MASK_FORMS), cp=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2]),
    vocab=st.sampled_from([None, VOCAB]), seed=st.integers(0, 2 ** 16), positions=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(**BATCHES)
def test_clean_batches_pack_the_same_on_the_host(lengths, style, loss_dtype, mask_form, cp, tp, vocab, seed,
                                                 positions):
    batch, _ = batch_of(lengths, 12, style=style, loss_dtype=loss_dtype, mask_form=mask_form, seed=seed,
                        positions=positions)
    host, device = both_paths(batch, label_style=style, cp_size=cp, tp_size=tp, sequence_parallel=tp > 1,
                              vocab_size=vocab, extra_keys=("side",))
    if isinstance(device, str):  # e.g. Hugging Face labels given as Megatron ones: the same refusal
        assert host == device
        return
    assert_same(host, device)


BAD_VALUES = [("input_ids", -5), ("input_ids", VOCAB), ("input_ids", VOCAB + 40), ("labels", -1), ("labels", -101),
              ("labels", VOCAB), ("loss_mask", float("nan")), ("loss_mask", -0.5), ("loss_mask", float("inf")),
              ("position_ids", 0), ("position_ids", 7), ("position_ids", -1)]


def with_bad_value(batch: dict, keep: torch.Tensor, key: str, value, *, at_pad: bool, slot: int) -> dict | None:
    """`batch` with `batch[key]` (a copy) holding `value` at one real token (or one pad slot: `at_pad`),
    chosen by `slot`; None when the rows have no such slot."""
    where = torch.nonzero(~keep if at_pad else keep)
    if not len(where):
        return None
    b, s = where[slot % len(where)].tolist()
    batch[key] = batch[key].clone()
    batch[key][b, s] = value
    return batch


@settings(max_examples=60, deadline=None)
@given(**BATCHES, bad=st.sampled_from(BAD_VALUES), at_pad=st.booleans(), slot=st.integers(0, 10 ** 6))
def test_a_bad_value_gives_the_same_error_or_result_on_the_host(lengths, style, loss_dtype, mask_form, cp, tp, vocab,
                                                                 seed, positions, bad, at_pad, slot):
    key, value = bad
    positions = positions or key == "position_ids"
    if key == "loss_mask" and (loss_dtype is None or not loss_dtype.is_floating_point):
        loss_dtype = torch.float32  # a NaN, negative or infinite weight needs a float loss_mask
    batch, keep = batch_of(lengths, 12, style=style, loss_dtype=loss_dtype, mask_form=mask_form, seed=seed,
                           positions=positions)
    batch = with_bad_value(batch, keep, key, value, at_pad=at_pad, slot=slot)
    if batch is None:
        return
    host, device = both_paths(batch, label_style=style, cp_size=cp, tp_size=tp, sequence_parallel=tp > 1,
                              vocab_size=vocab, extra_keys=("side",))
    if isinstance(device, str) or isinstance(host, str):
        assert host == device
    else:
        assert_same(host, device)


PACK_ERRORS = [e for e in adversarial.ERRORS if not e[0].startswith("dense")]  # "dense_*" call pad_batch


@pytest.mark.parametrize("name, call, message", PACK_ERRORS, ids=[e[0] for e in PACK_ERRORS])
def test_every_adversarial_input_is_the_same_error_on_the_host(name, call, message, monkeypatch):
    monkeypatch.setattr(adversarial, "pack_batch", functools.partial(pack_batch, host_reads=True))
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=80, deadline=None)
@given(mask=st.lists(st.lists(st.sampled_from([-1, 0, 0, 1, 1, 1, 2]), min_size=6, max_size=6), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.int8, torch.uint8]))
def test_any_integer_mask_gives_the_same_lengths_or_error_on_the_host(mask, dtype):
    """The host reads a mask with numpy (first minimum, its value, row sums): holes, left padding,
    negative values and values above 1 fail as they do on the device path."""
    if dtype == torch.uint8:
        mask = [[max(v, 0) for v in row] for row in mask]
    ids = torch.arange(1, 1 + 6 * len(mask)).reshape(len(mask), 6)
    batch = {"input_ids": ids, "labels": ids + 1, "attention_mask": torch.tensor(mask, dtype=dtype)}
    host, device = both_paths(batch)
    if isinstance(device, str) or isinstance(host, str):
        assert host == device
    else:
        assert_same(host, device)


@pytest.mark.parametrize("mask_form", ["long", "bool"])
def test_a_long_mask_is_read_and_checked_the_same(mask_form):
    lengths = [700, 0, 1200, 33, 2048]
    row_length = 1 << 14
    batch, _ = batch_of(lengths, row_length, style="hf", loss_dtype=torch.float32, mask_form=mask_form, seed=3)
    host, device = both_paths(batch, label_style="hf", cp_size=2, extra_keys=("side",))
    assert_same(host, device)
    holed = batch["attention_mask"].clone()
    holed[2, 5] = 0
    host, device = both_paths({**batch, "attention_mask": holed}, label_style="hf", extra_keys=("side",))
    assert host == device and "bad row(s) [2]" in host


def test_pre_packed_documents_and_mrope_pack_the_same_on_the_host():
    from megatron_vlm_packing.rope import MRopeConfig

    rope = MRopeConfig(family="qwen2_vl", image_token_id=9, video_token_id=8)
    ids = torch.tensor([[1, 9, 9, 9, 9, 2, 3, 4, 0], [3, 4, 9, 9, 9, 9, 5, 0, 0]])
    keep = (torch.arange(9)[None] < torch.tensor([[8], [7]])).long()
    batch = {"input_ids": ids, "labels": ids, "attention_mask": keep, "image_grid_thw": torch.tensor([[1, 4, 4],
             [1, 2, 8]]), "pixel_values": torch.zeros(32, 3), "document_lengths": torch.tensor([[6, 2], [7, 0]])}
    host, device = both_paths(batch, label_style="hf", mrope=rope, cp_size=2)
    assert_same(host, device)
    assert torch.equal(host.vision.pixel_values, device.vision.pixel_values)
    assert host.vision.images_per_sample == device.vision.images_per_sample == (1, 0, 1)  # per document


@pytest.mark.parametrize("kind", [dict, UserDict])
def test_host_reads_refuses_a_batch_off_the_host(kind):
    """Any mapping pack_batch takes (a Hugging Face BatchFeature is a UserDict) is checked, not only a dict."""
    batch = kind({"input_ids": torch.ones(2, 4, dtype=torch.long, device="meta"),
                  "labels": torch.ones(2, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"host_reads=True packs a batch on the CPU .* 'input_ids' is on meta"):
        pack_batch(batch, host_reads=True)


def _two_faults():
    """Batches with a bad id, label or loss weight (or 1D position) and a second fault that a later check
    finds: a media count, a grid, mRoPE blocks, positions numpy cannot view, or pad_to."""
    from megatron_vlm_packing.rope import MRopeConfig

    img, rope = 9, MRopeConfig(family="qwen2_vl", image_token_id=9, video_token_id=8)
    ids = torch.tensor([[1, img, img, 0], [2, 3, 0, 0]])
    base = {"input_ids": ids, "labels": torch.tensor([[1, -7, img, -100], [2, 3, -100, -100]]),
            "attention_mask": (ids != 0).long(), "pixel_values": torch.zeros(4, 3),
            "image_grid_thw": torch.tensor([[1, 2, 2]])}  # 1 placeholder per image, the row has 2
    text = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]),
            "labels": torch.tensor([[6, -7, 1, -100], [9, 2, -100, -100]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    bad_positions = torch.tensor([[0, 1, 0, 3], [0, 1, 2, 3]])
    good_labels = torch.tensor([[1, img, img, -100], [2, 3, -100, -100]])
    return {
        "bad_label_and_media_count": (base, dict(label_style="hf", image_token_id=img)),
        "bad_label_and_mrope_blocks": ({  # 3 placeholders as the grids give, but blocks of 2 and 1, not 1 and 2
            "input_ids": torch.tensor([[1, img, img, 5, img], [2, 3, 0, 0, 0]]),
            "labels": torch.tensor([[1, -7, img, 5, img], [2, 3, -100, -100, -100]]),
            "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]), "pixel_values": torch.zeros(12, 3),
            "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 4]])}, dict(label_style="hf", mrope=rope)),
        "bad_id_and_media_count": ({**base, "labels": good_labels, "input_ids": ids.clone().index_put_(
            (torch.tensor(1), torch.tensor(1)), torch.tensor(-4))}, dict(label_style="hf", image_token_id=img)),
        "bad_loss_weight_and_media_count": ({**base, "labels": good_labels, "loss_mask": torch.tensor(
            [[1.0, float("nan"), 1, 0], [1, 1, 0, 0]])}, dict(label_style="hf", image_token_id=img)),
        "bad_position_and_media_count": ({**base, "labels": good_labels, "position_ids": bad_positions},
                                         dict(label_style="hf", image_token_id=img)),
        "bad_label_and_bfloat16_positions": ({**text, "position_ids": bad_positions.bfloat16()}, {}),
        "bad_label_and_pad_to_too_small": (text, dict(pad_to=2)),
        "bad_label_and_pad_to_not_aligned": (text, dict(pad_to=6, cp_size=2)),
        "bad_position_and_pad_to_too_small": ({**text, "labels": torch.tensor([[6, 7, 1, -100], [9, 2, -100, -100]]),
                                               "position_ids": bad_positions}, dict(pad_to=2)),
    }


@pytest.mark.parametrize("name", list(_two_faults()))
def test_a_batch_with_two_faults_gives_the_device_paths_first_error_on_the_host(name):
    """The device path raises the value errors (ids, labels, loss weights, then 1D positions) before
    those of media, mRoPE blocks, positions read with them and the plan; the host checks values over the
    packed tokens, after those, so it runs them first wherever a later check fails."""
    batch, kwargs = _two_faults()[name]
    host, device = both_paths(batch, **kwargs)
    assert isinstance(device, str) and host == device
