"""Hostile inputs to `pack_batch`: each is packed right or refused with a ValueError naming the field and
the numbers, the same on every path: `host_reads=True` (the plain path, `packing/plain_host.py`, for a
plain batch, else the general host path) and `host_reads=False` (the one-read step path).

Each case runs on both `host_reads` values and, where the batch's form picks the host path, on a plain
batch and one with an extra key (which the plain path leaves to the general one).
"""

import numpy as np
import pytest
import torch

from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.packing.lengths import (
    keep_mask_from_4d, lengths_from_keep_mask, real_lengths, right_padded_reads,
)
from tests.packing.test_plain_host import assert_identical, plain_path_spied, three_ways

M = 2**63 - 1  # int64's maximum: M + M + 5 wraps to 3
ROUTES = [(True, "plain"), (True, "general"), (False, "plain"), (False, "general")]  # (host_reads, batch form)


def rows_batch(mask=None, *, batch_size=2, row_length=4, **fields) -> dict:
    """A Megatron-style batch of `batch_size` x `row_length` rows (labels are not the ids), with `mask`."""
    ids = torch.arange(1, batch_size * row_length + 1).reshape(batch_size, row_length)
    batch = {"input_ids": ids, "labels": ids + 100, **fields}
    if mask is not None:
        batch["attention_mask"] = mask
    return batch


def packed(batch: dict, host_reads: bool, form: str, **kwargs):
    """pack_batch on `batch` as `form` ("plain", or "general": an extra key the plain path leaves alone)."""
    if form == "general":
        batch = {**batch, "token_type": torch.zeros_like(batch["input_ids"])}
        kwargs["extra_keys"] = ("token_type",)
    taken = []
    with plain_path_spied(taken):
        result = pack_batch(batch, host_reads=host_reads, **kwargs)
    assert any(taken) == (host_reads and form == "plain"), "the batch took another path than the test means"
    return result


# -- 1. attention_mask values outside {0, 1} ------------------------------------------------------------------------

WRAPPING_MASKS = [
    ([[M, M, 5, 0], [1, 1, 0, 0]], M, 0, 0),  # row sum wraps to 3 == the first zero: read as length 3
    ([[1, M, M, 3], [1, 1, 0, 0]], M, 0, 1),  # no zero: row sum wraps to 4 == S, read as a full row
    ([[1, 1, 0, 0], [2**62, 2**62, 2**62, 2**62 + 4]], 2**62, 1, 0),  # sum 2**64 + 4 wraps to 4 == S
]


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("rows, value, row, column", WRAPPING_MASKS)
def test_int64_mask_whose_row_sums_wrap_is_refused(host_reads, form, rows, value, row, column):
    mask = torch.tensor(rows, dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"attention_mask row {row} has values other than 0 and 1: {value} at "
                                         rf"column {column}$"):
        packed(rows_batch(mask), host_reads, form)


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_narrow_mask_with_large_values_names_the_value(host_reads, form, dtype):
    top = torch.iinfo(dtype).max
    mask = torch.tensor([[1, 1, 0, 0], [1, top, 5, 0]], dtype=dtype)
    with pytest.raises(ValueError, match=rf"attention_mask row 1 has values other than 0 and 1: {top} at column 1$"):
        packed(rows_batch(mask), host_reads, form)


def test_feature_attention_mask_reads_refuse_wrapping_int64_sums():
    """The device reads shared with `feature_attention_mask` (Qwen-Omni audio) fail on a wrapping int64 mask."""
    mask = torch.tensor([[M, M, 5, 0], [1, 1, 0, 0]])
    values, fails = right_padded_reads(mask, "feature_attention_mask")
    assert fails(torch.cat([values[0], values[1], values[2], values[3][None]]).tolist())
    with pytest.raises(ValueError, match=rf"feature_attention_mask row 0 .*: {M} at column 0"):
        lengths_from_keep_mask(mask, field="feature_attention_mask")


@pytest.mark.parametrize("host_reads, form", ROUTES)
def test_bool_mask_holding_other_bytes_is_refused(host_reads, form):
    """A bool tensor viewed from bytes other than 0/1 (torch's ops disagree on it: `!= 1` says False, `sum`
    counts 2) is a ValueError naming the byte, not an IndexError, nor packed as truthy."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 2, 1, 0]], dtype=torch.uint8).view(torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask row 1 has values other than 0 and 1: byte 2 at column 1 of "
                                         r"a torch.bool tensor"):
        packed(rows_batch(mask), host_reads, form)


def bool_4d_holding(byte: int, at: tuple[int, int, int], lengths=(3, 2), size: int = 4) -> torch.Tensor:
    """A Megatron [B, 1, S, S] bool mask (True = masked) of right-padded rows of `lengths`, with `byte` at
    (row, query, key) `at`: a torch.bool tensor viewed from its bytes."""
    causal = torch.ones(size, size, dtype=torch.bool).tril()
    keep = torch.arange(size)[None] < torch.tensor(lengths)[:, None]
    data = (~(causal[None] & keep[:, :, None] & keep[:, None, :]))[:, None].view(torch.uint8).clone()
    data[at[0], 0, at[1], at[2]] = byte
    return data.view(torch.bool)


# (byte, (row, query, key)): on a pad slot's diagonal and a pad pair (read as masked, packed as if 1); on a
# masked real pair; on the diagonal of row 0's last real token (read as masked: the row packed 2 tokens, not 3).
BYTES_4D = [(2, (1, 3, 3)), (255, (0, 3, 0)), (2, (0, 0, 1)), (7, (0, 2, 2))]


@pytest.mark.parametrize("byte, at", BYTES_4D)
def test_4d_bool_mask_holding_other_bytes_is_refused_on_every_path(byte, at):
    """A 4D bool mask viewed from bytes other than 0/1 was read as if each were 1 (masked) by the ops of the
    4D path, unchecked: now the same ValueError naming the row, (query, key) and byte on pack_batch's
    host and step paths, pad_batch, real_lengths, the parity probe's split_rows and pack_llava_batch."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import pack_llava_batch
    from megatron_vlm_packing.packing import pad_batch
    from megatron_vlm_packing.validate.probe import split_rows

    mask = bool_4d_holding(byte, at)
    message = (rf"^4D attention_mask row {at[0]} has values other than 0 and 1: byte {byte} at \(query {at[1]}, "
               rf"key {at[2]}\) of a torch.bool tensor")
    llava = LlavaSpace(img_seq_len=4, image_token_index=127)
    entries = [lambda batch: pack_batch(batch, host_reads=True), lambda batch: pack_batch(batch, host_reads=False),
               pad_batch, split_rows, lambda batch: pack_llava_batch(batch, llava),
               lambda batch: real_lengths(batch_size=2, row_length=4, attention_mask=batch["attention_mask"])]
    for entry in entries:
        with pytest.raises(ValueError, match=message):
            entry(rows_batch(mask))
    clean = bool_4d_holding(1, at)  # the same mask with a 1 there: packs (or names its own fault) as before
    assert keep_mask_from_4d(mask).tolist() == keep_mask_from_4d(clean).tolist()


def test_4d_bool_mask_bytes_ride_the_step_paths_one_read():
    """The byte check adds no host read: a clean 4D mask packs on the step path with one (as a 2D mask's pack)."""
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    with count_host_syncs() as syncs:
        micro_batch = pack_batch(rows_batch(bool_4d_holding(1, (1, 3, 3))), host_reads=False)
    assert syncs.total == 1, syncs.report()
    assert_identical(micro_batch, pack_batch(rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])), host_reads=False))


def test_4d_bool_mask_bytes_are_checked_before_its_other_faults():
    """A byte other than 0/1 and a non-causal real pair: the byte is named first, on both read paths."""
    mask = bool_4d_holding(2, (1, 3, 3)).view(torch.uint8).clone()
    mask[0, 0, 0, 1] = 0  # real token 0 sees token 1
    for host_reads in (True, False):
        with pytest.raises(ValueError, match=r"^4D attention_mask row 1 has values other than 0 and 1: byte 2"):
            pack_batch(rows_batch(mask.view(torch.bool)), host_reads=host_reads)
        with pytest.raises(ValueError, match=r"^4D attention_mask row 0 lets real token 0 see real token 1"):
            pack_batch(rows_batch(bool_4d_holding(0, (0, 0, 1))), host_reads=host_reads)


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("dtype_name", ["uint16", "uint32"])
def test_wide_unsigned_mask_packs_as_int64(host_reads, dtype_name):
    """uint16 / uint32 masks (torch cannot reduce them) are read as int64: exact, the same pack."""
    rows = [[1, 1, 1, 0], [1, 1, 0, 0]]
    mask = torch.tensor(rows).to(getattr(torch, dtype_name))
    expected = pack_batch(rows_batch(torch.tensor(rows)), host_reads=host_reads)
    assert_identical(pack_batch(rows_batch(mask), host_reads=host_reads), expected)
    bad = torch.tensor([[1, 1, 1, 0], [1, 300, 0, 0]]).to(getattr(torch, dtype_name))
    with pytest.raises(ValueError, match=r"attention_mask row 1 has values other than 0 and 1: 300 at column 1$"):
        pack_batch(rows_batch(bad), host_reads=host_reads)


@pytest.mark.parametrize("host_reads", [True, False])
def test_uint64_mask_is_refused(host_reads):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).to(torch.uint64)
    with pytest.raises(ValueError, match=r"attention_mask has dtype torch.uint64"):
        pack_batch(rows_batch(mask), host_reads=host_reads)


# -- 2. pad_token_id (and placeholder ids) beyond int64 --------------------------------------------------------------

@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("pad_token_id, message", [(2**63, r"at most 2\*\*63 - 1 \(ids are int64\)"),
                                                   (2**64 + 5, r"at most 2\*\*63 - 1 \(ids are int64\)"),
                                                   (-2**63 - 1, r"a non-negative int \(the id written at pad slots\)")])
def test_pad_token_id_beyond_int64_is_refused(host_reads, form, pad_token_id, message):
    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=rf"pad_token_id must be {message}, got {pad_token_id}$"):
        packed(batch, host_reads, form, pad_token_id=pad_token_id)


@pytest.mark.parametrize("host_reads", [True, False])
def test_pad_token_id_at_int64_max_is_written(host_reads):
    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    micro_batch = pack_batch(batch, host_reads=host_reads, pad_token_id=M, pad_to=8)
    assert micro_batch.input_ids[0, 5:].tolist() == [M] * 3


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("name", ["image_token_id", "video_token_id", "audio_token_id"])
def test_placeholder_id_beyond_int64_is_refused(host_reads, name):
    with pytest.raises(ValueError, match=rf"{name} must be a non-negative int \(at most 2\*\*63 - 1.*got {2**64}$"):
        pack_batch(rows_batch(), host_reads=host_reads, **{name: 2**64})


def test_placeholder_ids_and_pad_token_id_share_int64s_bound():
    """MediaTokens and pad_token_id are bounded by the one INT64_MAX (packing/bounds.py): its value is accepted
    by both, one more is refused by both."""
    from megatron_vlm_packing.packing.bounds import INT64_MAX
    from megatron_vlm_packing.packing.media_tokens import MediaTokens
    from megatron_vlm_packing.packing.rows import check_pad_token_id

    assert INT64_MAX == torch.iinfo(torch.int64).max == M
    assert MediaTokens(image_token_id=INT64_MAX).image_token_id == check_pad_token_id(INT64_MAX) == INT64_MAX
    with pytest.raises(ValueError, match=rf"image_token_id must be .* got {2**63}$"):
        MediaTokens(image_token_id=INT64_MAX + 1)
    with pytest.raises(ValueError, match=rf"pad_token_id must be at most 2\*\*63 - 1 .* got {2**63}$"):
        check_pad_token_id(INT64_MAX + 1)


# -- 3. packed length T >= 2**31 (int32 cu_seqlens) -----------------------------------------------------------------

def test_plan_of_2_to_the_31_tokens_is_refused():
    """Checked from the lengths alone (no tensor is made): T = 2**31 would wrap cu_seqlens' int32."""
    from megatron_vlm_packing.packing.plan import PackMultiples, make_pack_plan

    with pytest.raises(ValueError, match=r"the pack has 2147483648 slots \(2147483648 real tokens\), more than int32 "
                                         r"cu_seqlens can hold \(< 2\*\*31\)"):
        make_pack_plan([2**30, 2**30], row_capacity=2**30)
    with pytest.raises(ValueError, match=r"the pack has 2147483648 slots \(2147483647 real tokens\)"):
        make_pack_plan([2**30, 2**30 - 1], row_capacity=2**30, multiples=PackMultiples(segment=2, total=2))
    largest = make_pack_plan([2**30, 2**30 - 1], row_capacity=2**30)
    assert largest.cu_seqlens_padded()[-1].item() == 2**31 - 1
    # A plan built by hand is checked by PackPlan itself (make_pack_plan's skips that second check).
    from megatron_vlm_packing.packing.plan import PackPlan

    with pytest.raises(ValueError, match=r"the pack has 2147483648 slots \(2147483648 real tokens\)"):
        PackPlan(row_lengths=(2**30, 2**30), row_capacity=2**30, segment_rows=(0, 1), real_lengths=(2**30, 2**30),
                 physical_lengths=(2**30, 2**30), multiples=PackMultiples())


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("pad_to", [2**31, 2**64])
def test_pad_to_beyond_int32_is_refused(host_reads, form, pad_to):
    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=rf"the pack has {pad_to} slots \(5 real tokens\), more than int32"):
        packed(batch, host_reads, form, pad_to=pad_to)


# -- 4. unsigned dtypes torch cannot reduce or compare (uint16, uint32, uint64) --------------------------------------
# Read as int64 (exact) in every field, as input_ids and labels always were; uint64 is refused in every field: its
# values need not fit int64 (a label 2**64 - 100 read as -100 would be ignored) and torch cannot reduce it.

MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("dtype_name", ["uint16", "uint32"])
@pytest.mark.parametrize("field", ["position_ids", "loss_mask", "input_ids", "labels"])
def test_wide_unsigned_fields_pack_as_int64(host_reads, dtype_name, field):
    batch = rows_batch(torch.tensor(MASK), position_ids=torch.arange(4).expand(2, 4), loss_mask=torch.ones(2, 4))
    expected = pack_batch({**batch, field: batch[field].long()}, host_reads=host_reads)
    unsigned = pack_batch({**batch, field: batch[field].to(getattr(torch, dtype_name))}, host_reads=host_reads)
    assert_identical(unsigned, expected)


@pytest.mark.parametrize("host_reads", [True, False])
def test_wide_unsigned_mrope_positions_pack_as_int64(host_reads):
    positions = torch.arange(4).expand(3, 2, 4)
    batch = rows_batch(torch.tensor(MASK))
    expected = pack_batch({**batch, "position_ids": positions}, host_reads=host_reads)
    unsigned = pack_batch({**batch, "position_ids": positions.to(torch.uint32)}, host_reads=host_reads)
    assert_identical(unsigned, expected)


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("field", ["position_ids", "loss_mask", "input_ids", "labels", "attention_mask"])
@pytest.mark.parametrize("positions_shape", [(2, 4), (3, 2, 4)])
def test_uint64_fields_are_refused(host_reads, field, positions_shape):
    batch = rows_batch(torch.tensor(MASK), position_ids=torch.arange(4).expand(positions_shape),
                       loss_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match=rf"^{field} has dtype torch.uint64"):
        pack_batch({**batch, field: batch[field].to(torch.uint64)}, host_reads=host_reads)


def test_uint64_label_is_not_read_as_ignore_index():
    """2**64 - 100 wraps to -100 as int64: it was packed as an ignored target, silently."""
    labels = torch.from_numpy(np.array([[5, 2**64 - 100, 7, 8], [5, 6, 7, 8]], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"^labels has dtype torch.uint64"):
        pack_batch(rows_batch(labels=labels), host_reads=False)


# -- 5. sparse, nested and meta tensors ----------------------------------------------------------------------------

@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("field", ["input_ids", "labels", "attention_mask", "loss_mask", "position_ids"])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_tensor_is_refused_naming_field_and_layout(host_reads, form, field, layout):
    batch = rows_batch(torch.tensor(MASK), position_ids=torch.arange(4).expand(2, 4).contiguous(),
                       loss_mask=torch.ones(2, 4))
    sparse = batch[field].to_sparse() if layout == "sparse_coo" else batch[field].to_sparse_csr()
    with pytest.raises(ValueError, match=rf"^{field} has layout torch.{layout}: .* pass {field}.to_dense\(\)"):
        packed({**batch, field: sparse}, host_reads, form)


@pytest.mark.parametrize("host_reads", [True, False])
def test_sparse_extra_key_is_refused(host_reads):
    batch = rows_batch(torch.tensor(MASK), token_type=torch.ones(2, 4).to_sparse())
    with pytest.raises(ValueError, match=r"^token_type has layout torch.sparse_coo"):
        pack_batch(batch, host_reads=host_reads, extra_keys=("token_type",))


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_ids_are_refused(host_reads, layout):
    ids = torch.nested.nested_tensor([torch.arange(1, 5), torch.arange(1, 4)], layout=layout) \
        if layout is torch.jagged else torch.nested.nested_tensor([torch.arange(1, 5), torch.arange(1, 5)])
    with pytest.raises(ValueError, match=rf"^input_ids is a nested tensor \(layout {layout}\)"):
        pack_batch({"input_ids": ids, "labels": torch.ones(2, 4, dtype=torch.long)}, host_reads=host_reads)


@pytest.mark.parametrize("field", ["input_ids", "attention_mask"])
def test_meta_tensor_is_refused(field):
    """The step path names it; host_reads=True refuses it as a tensor off the host (tests/packing/test_host_reads)."""
    batch = rows_batch(torch.tensor(MASK))
    with pytest.raises(ValueError, match=rf"^{field} is a meta tensor: it holds no values for "
                                         r"pack_batch/pad_batch to read"):
        pack_batch({**batch, field: batch[field].to("meta")}, host_reads=False)


# -- 6. extra_keys of the wrong type --------------------------------------------------------------------------------

@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("extra_keys", [None, 0, "token_type", b"token_type"])
def test_extra_keys_not_a_collection_of_names_is_refused(host_reads, extra_keys):
    batch = rows_batch(torch.tensor(MASK), token_type=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=rf"^extra_keys must be a tuple of batch key names .*, got {extra_keys!r}$"):
        pack_batch(batch, host_reads=host_reads, extra_keys=extra_keys)


@pytest.mark.parametrize("host_reads", [True, False])
def test_extra_keys_as_list_or_set_pack_as_tuple(host_reads):
    batch = rows_batch(torch.tensor(MASK), token_type=torch.arange(8).reshape(2, 4))
    expected = pack_batch(batch, host_reads=host_reads, extra_keys=("token_type",))
    for keys in (["token_type"], {"token_type"}, iter(["token_type"])):
        assert_identical(pack_batch(batch, host_reads=host_reads, extra_keys=keys), expected)


def test_pad_batch_refuses_extra_keys_none():
    from megatron_vlm_packing.packing.dense_batch import pad_batch

    with pytest.raises(ValueError, match=r"^extra_keys must be a tuple of batch key names"):
        pad_batch(rows_batch(torch.tensor(MASK)), extra_keys=None)


# -- 7. position_layout ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("positions", [None, "1d", "3d"])
@pytest.mark.parametrize("position_layout", ["bogus", "3bs", 5])
def test_unknown_position_layout_is_refused(host_reads, form, positions, position_layout):
    """Refused with or without position_ids in the batch, listing the valid values."""
    fields = {} if positions is None else {
        "position_ids": torch.arange(4).expand((2, 4) if positions == "1d" else (3, 2, 4))}
    batch = rows_batch(torch.tensor(MASK), **fields)
    with pytest.raises(ValueError, match=rf"^position_layout must be '3BS' or 'B3S' \(or None\), got "
                                         rf"{position_layout!r}$"):
        packed(batch, host_reads, form, position_layout=position_layout)


# -- the paths agree on random hostile masks ----------------------------------------------------------------------

MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32)


def _random_mask(rng: np.random.Generator):
    """A [B, S] mask of a random dtype: right-padded 0/1 rows, some with extreme values or a flipped slot."""
    batch_size, row_length = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    dtype = MASK_DTYPES[rng.integers(len(MASK_DTYPES))]
    lengths = rng.integers(0, row_length + 1, batch_size)
    rows = (np.arange(row_length)[None] < lengths[:, None]).astype(object)
    for _ in range(int(rng.integers(0, 3))):
        b, s = rng.integers(batch_size), rng.integers(row_length)
        if dtype == torch.bool:
            rows[b, s] = int(rng.choice([1 - rows[b, s], 2, 255]))  # bytes, viewed as bool below
        else:
            info = torch.iinfo(dtype)
            rows[b, s] = int(rng.choice([1 - rows[b, s], info.max, info.min, 2, info.max // 2 + 3]))
    if dtype == torch.int64 and row_length >= 3 and rng.random() < 0.3:  # a row whose sum wraps to its first zero
        rows[0] = [M, M, 5] + [0] * (row_length - 3)
    if dtype == torch.bool:
        return torch.tensor(rows.astype(np.int64), dtype=torch.uint8).view(torch.bool)
    return torch.tensor(rows.astype(np.int64)).to(dtype)


def _true_lengths(mask: torch.Tensor):
    """The rows' lengths by the definition (every value 0 or 1, each row 1...1 0...0), else None."""
    values = (mask.view(torch.uint8) if mask.dtype == torch.bool else mask.long()).tolist()
    if any(v not in (0, 1) for row in values for v in row):
        return None
    if any(row != sorted(row, reverse=True) for row in values):
        return None
    return [sum(row) for row in values]


def test_paths_agree_on_random_hostile_masks():
    """Plain, general host and step paths give the same micro-batch or the same ValueError, and pack exactly
    the masks that are 0/1 and right-padded, at their true lengths."""
    rng = np.random.default_rng(7)
    for case in range(150):
        mask = _random_mask(rng)
        ids = torch.arange(1, mask.numel() + 1).reshape(mask.shape)
        extra = {"token_type": torch.zeros(mask.shape)} if case % 3 == 0 else {}
        plain, _, general, device = three_ways({"input_ids": ids, "labels": ids + 100, "attention_mask": mask, **extra},
                                               extra_keys=tuple(extra))
        lengths = _true_lengths(mask)
        if isinstance(plain, str):
            assert plain == general == device, (case, mask)
            assert lengths is None or not any(lengths), (case, mask, plain)
            continue
        assert_identical(plain, general)
        assert_identical(plain, device)
        assert lengths is not None and list(plain.plan.real_lengths) == [n for n in lengths if n], (case, mask)


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("option", [{"tp_size": 0}, {"sequence_parallel": 1}])
def test_bad_value_is_named_before_a_bad_parallel_option(host_reads, form, option):
    """Both faults: every path names the batch's (the step path reads values before the parallel layout; the host
    paths check them last, so they raise them first on any later error)."""
    batch = rows_batch(torch.tensor(MASK), position_ids=torch.tensor([[0, 1, 5, 3], [0, 1, 2, 3]]))
    with pytest.raises(ValueError, match=r"^position_ids row 0 position 2 is 5, expected 2"):
        packed(batch, host_reads, form, **option)


@pytest.mark.parametrize("host_reads, form", ROUTES)
@pytest.mark.parametrize("option", [{}, {"tp_size": 0}, {"pad_to": 2**64}])
def test_vocab_size_beyond_int64_is_refused(host_reads, form, option):
    """Ids are compared with it as int64 (an OverflowError on the error path before); with a second fault the
    vocab_size is named first, as every option before the batch."""
    with pytest.raises(ValueError, match=rf"^vocab_size must be at most 2\*\*63 - 1 \(ids are int64\), got {2**64}$"):
        packed(rows_batch(torch.tensor(MASK)), host_reads, form, vocab_size=2**64, **option)
@pytest.mark.parametrize("pad_to", [2**31, 2**31 + 6, 2**64])
def test_llava_expanded_pack_beyond_int32_is_refused(pad_to):
    """LLaVA's boundaries are expanded ones (each image token grows): the collapsed plan stays below 2**31
    (PackPlan's check passes) while the expanded T reaches it, which was a RuntimeError (int32 overflow)
    when the model's patch built the expanded cu_seqlens."""
    from megatron_vlm_packing.models.llava import LlavaSpace, llava_pack_plan

    space = LlavaSpace(img_seq_len=4, image_token_index=9)
    with pytest.raises(ValueError, match=rf"the pack has {pad_to} slots, more than int32 cu_seqlens can hold "
                                         r"\(< 2\*\*31\): a smaller pad_to or seq_length, or fewer rows or images"):
        llava_pack_plan([5, 3], row_capacity=8, row_expansion=[3, 3], opens_with_image=[False, False], space=space,
                        pad_to=pad_to)
    largest = llava_pack_plan([5, 3], row_capacity=8, row_expansion=[3, 3], opens_with_image=[False, False],
                              space=space, pad_to=2**31 - 1)
    assert largest.total == 2**31 - 1 - 6  # collapsed: the 6 expanded slots come from the images


# -- 5. options: flags, placeholder ids and merge sizes given as floats, extra_keys ----------------------------------

@pytest.mark.parametrize("pack, flag", [(True, "host_reads"), (True, "require_media_counts"),
                                        (False, "require_media_counts"), (False, "truncate")])
@pytest.mark.parametrize("value", ["no", None, 1])
def test_a_flag_that_is_not_a_bool_is_refused(pack, flag, value):
    """A truthy string switched the option on: truncate='no' cut rows, host_reads='False' read on the host."""
    from megatron_vlm_packing.packing import pad_batch

    batch = rows_batch(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
    options = dict(seq_length=2) if flag == "truncate" else {}
    with pytest.raises(ValueError, match=rf"{flag} must be a bool, got {value!r}$"):
        (pack_batch if pack else pad_batch)(batch, **{flag: value}, **options)


@pytest.mark.parametrize("host_reads", [True, False])
@pytest.mark.parametrize("name, value", [("image_token_id", 3.7), ("video_token_id", float("inf")),
                                         ("audio_token_id", float("nan")), ("spatial_merge_size", 1.5)])
def test_a_placeholder_id_or_merge_size_that_is_not_an_integer_is_refused(host_reads, name, value):
    """3.7 was read as 3 and 1.5 as 1 (int() truncates), inf was an OverflowError, nan an unnamed ValueError."""
    with pytest.raises(ValueError, match=rf"{name} must be a .*, got {value!r}$"):
        pack_batch(rows_batch(), host_reads=host_reads, **{name: value})
    integral = 1000.0 if name.endswith("_id") else 8.0  # read as its int, as before (no id 1000 in the batch)
    assert pack_batch(rows_batch(), host_reads=host_reads, **{name: integral}).plan is not None


@pytest.mark.parametrize("pack", [True, False])
def test_extra_keys_that_cannot_be_iterated_are_named(pack):
    """A 0-d tensor was a TypeError ('iteration over a 0-d tensor'); pad_batch did not check extra_keys at all."""
    from megatron_vlm_packing.packing import pad_batch

    with pytest.raises(ValueError, match=r"extra_keys must be a tuple of batch key names .* got tensor\(3\)$"):
        (pack_batch if pack else pad_batch)(rows_batch(), extra_keys=torch.tensor(3))
