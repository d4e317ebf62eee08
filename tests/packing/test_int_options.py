"""One rule for an integer option (`packing.bounds.is_int` / `checked_int`): a Python int or a numpy integer,
kept as a Python int; a bool, a float, a string, a tensor or None where a number goes is a ValueError. Before,
about half the options refused numpy ints (LlavaSpace, PlannerConfig.dp_size, PackMultiples' sizes, ...) while
the planner's accepted them."""

import numpy as np
import pytest
import torch

from megatron_vlm_packing.attention.spec import check_context_parallel_size
from megatron_vlm_packing.models.llava import LlavaSpace
from megatron_vlm_packing.models.llava_pack import _dense_length
from megatron_vlm_packing.packing import pack_batch, pad_batch
from megatron_vlm_packing.packing.bounds import checked_int, is_int
from megatron_vlm_packing.packing.dense_batch import dense_row_length
from megatron_vlm_packing.packing.media_tokens import MediaTokens
from megatron_vlm_packing.packing.dense import dense_packed_seq_params
from megatron_vlm_packing.packing.plan import PackMultiples, checked_pad_to, make_pack_plan
from megatron_vlm_packing.packing.row_fields import check_pad_token_id, check_vocab_size
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.planner import BinLayout, PlannerConfig
from megatron_vlm_packing.planner.balance import assign_to_ranks
from megatron_vlm_packing.planner.cost import CostModel, TransformerShape
from megatron_vlm_packing.planner.metadata import TokenCounter, llava_tokens
from megatron_vlm_packing.rope.config import MRopeConfig
from megatron_vlm_packing.train.build import StepOptions
from megatron_vlm_packing.validate.coerce import int_field

NUMPY_INTS = [np.int64(4), np.int32(4), np.uint8(4), np.int16(4)]
NOT_INTS = [True, False, np.bool_(True), 4.0, np.float64(4), "4", None, torch.tensor(4), [4], 4 + 0j]

SHAPE = dict(hidden=8, layers=2, heads=2, head_dim=4, kv_groups=1, ffn=16)

# site -> (call with the value, what the call gives back that must be the Python int 4)
SITES = {
    "LlavaSpace.img_seq_len": lambda v: LlavaSpace(img_seq_len=v, image_token_index=127).img_seq_len,
    "LlavaSpace.image_token_index": lambda v: LlavaSpace(img_seq_len=2, image_token_index=v).image_token_index,
    "LlavaSpace.max_length": lambda v: LlavaSpace(img_seq_len=2, image_token_index=127, max_length=v).max_length,
    "PlannerConfig.dp_size": lambda v: PlannerConfig(layout=BinLayout(capacity=64), dp_size=v).dp_size,
    "PlannerConfig.seed": lambda v: PlannerConfig(layout=BinLayout(capacity=64), seed=v).seed,
    "PlannerConfig.window_steps": lambda v: PlannerConfig(layout=BinLayout(capacity=64), window_steps=v).window_steps,
    "PlannerConfig.samples_per_step": lambda v: PlannerConfig(layout=BinLayout(capacity=64),
                                                              samples_per_step=v).samples_per_step,
    "PackMultiples.cp_size": lambda v: PackMultiples.for_parallel(cp_size=v).segment // 2,
    "PackMultiples.tp_size": lambda v: PackMultiples.for_parallel(tp_size=v, sequence_parallel=True).total,
    "ParallelLayout.cp_size": lambda v: ParallelLayout(cp_size=v).cp_size,
    "ParallelLayout.cp_rank": lambda v: ParallelLayout(cp_size=8, cp_rank=v).cp_rank,
    "context_parallel_size": check_context_parallel_size,
    "MediaTokens.image_token_id": lambda v: MediaTokens(image_token_id=v).image_token_id,
    "MediaTokens.spatial_merge_size": lambda v: MediaTokens(spatial_merge_size=v).spatial_merge_size,
    "MRopeConfig.spatial_merge_size": lambda v: MRopeConfig(family="qwen2_vl", spatial_merge_size=v).spatial_merge_size,
    "MRopeConfig.image_token_id": lambda v: MRopeConfig(family="qwen2_vl", image_token_id=v).image_token_id,
    "MRopeConfig.mrope_section": lambda v: MRopeConfig(family="qwen2_vl", mrope_section=(v, 6, 6)).mrope_section[0],
    "StepOptions.seq_length": lambda v: StepOptions(pack=False, seq_length=v).seq_length,
    "dense_row_length": lambda v: dense_row_length(3, 2, 2, seq_length=v, truncate=False),
    "llava._dense_length": lambda v: _dense_length(3, 2, 0, 2, v),
    "pad_token_id": check_pad_token_id,
    "int_field": lambda v: int_field(v, "count", 1),
    # these kept the numpy int before (int32 arithmetic wrapped in TransformerShape's FLOP count)
    **{f"TransformerShape.{name}": (lambda name: lambda v: getattr(TransformerShape(**{**SHAPE, name: v}), name))(name)
       for name in (*SHAPE, "vocab")},
    **{f"TokenCounter.{name}": (lambda name: lambda v: getattr(TokenCounter(**{name: v}), name))(name)
       for name in ("spatial_merge", "audio_pool", "vision_wrappers", "audio_wrappers", "audio_n_window",
                    "video_frame_tokens")},
    "BinLayout.capacity": lambda v: BinLayout(capacity=v).capacity,
    "PackMultiples.segment": lambda v: PackMultiples(segment=v, total=8).segment,
    "PackMultiples.total": lambda v: PackMultiples(segment=1, total=v).total,
    "ParallelLayout.tp_size": lambda v: ParallelLayout(tp_size=v).tp_size,
    "llava_tokens": lambda v: 4 if llava_tokens(v) else None,
    "assign_to_ranks": lambda v: len(assign_to_ranks(np.ones(8), v, 2)),
    "vocab_size": lambda v: 4 if check_vocab_size(v) is None else None,
    # lengths: these took a one-element integer tensor too (operator.index), the only options that did
    "pad_to": checked_pad_to,
    "make_pack_plan.pad_to": lambda v: make_pack_plan([3, 1], row_capacity=4, pad_to=v).total,
    "StepOptions.pad_to": lambda v: StepOptions(pad_to=v).pad_to,
    "dense_packed_seq_params.batch_size": lambda v: dense_packed_seq_params(v, 2).cu_seqlens_q.numel() - 1,
    "dense_packed_seq_params.seq_length": lambda v: dense_packed_seq_params(2, v).max_seqlen_q,
}


@pytest.mark.parametrize("site", sorted(SITES))
@pytest.mark.parametrize("value", NUMPY_INTS, ids=repr)
def test_a_numpy_int_is_taken_as_its_python_int(site, value):
    got = SITES[site](value)
    assert got == 4 and type(got) is int


@pytest.mark.parametrize("site", sorted(SITES))
@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
def test_bools_floats_and_other_types_stay_refused(site, value):
    if value is None and site in ("LlavaSpace.max_length", "PlannerConfig.samples_per_step", "vocab_size",
                                  "StepOptions.seq_length", "dense_row_length", "llava._dense_length",
                                  "MediaTokens.image_token_id", "pad_to", "make_pack_plan.pad_to",
                                  "StepOptions.pad_to", "TokenCounter.audio_n_window"):
        pytest.skip("None is this option's default")
    if isinstance(value, torch.Tensor) and site == "int_field":
        pytest.skip("int_field reads a one-element integer tensor (a saved batch's field)")
    with pytest.raises(ValueError):
        SITES[site](value)


def test_is_int_and_checked_int():
    assert all(is_int(v) for v in [0, -3, 2**100, *NUMPY_INTS, np.uint64(2**63)])
    assert not any(is_int(v) for v in NOT_INTS)
    assert checked_int(np.int64(-3), "x") == -3 and type(checked_int(np.int64(-3), "x")) is int
    assert checked_int(None, "x", optional=True) is None
    with pytest.raises(ValueError, match=r"^x must be an int >= 1, got np.int64\(0\)$"):
        checked_int(np.int64(0), "x", least=1)
    with pytest.raises(ValueError, match=r"^x must be None or an int >= 1, got True$"):
        checked_int(True, "x", least=1, optional=True)
    with pytest.raises(ValueError, match=r"^x must be an int, got None$"):
        checked_int(None, "x")


def test_numpy_options_pack_as_python_ints():
    """A numpy pad_token_id / cp_size packs as its Python int would (same tensors, same Python-int plan)."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    batch = {"input_ids": ids, "labels": ids + 1, "attention_mask": ids > 0}
    for host_reads in (False, True):
        as_int = pack_batch(dict(batch), pad_token_id=3, cp_size=2, host_reads=host_reads)
        as_numpy = pack_batch(dict(batch), pad_token_id=np.int64(3), cp_size=np.int64(2), host_reads=host_reads)
        assert torch.equal(as_int.input_ids, as_numpy.input_ids) and as_int.plan == as_numpy.plan
        assert all(type(n) is int for n in as_numpy.plan.physical_lengths + (as_numpy.plan.multiples.total,))
    dense = pad_batch(dict(batch), pad_token_id=np.int64(3), seq_length=np.int64(6))
    assert torch.equal(dense.input_ids, pad_batch(dict(batch), pad_token_id=3, seq_length=6).input_ids)


def test_unpack_rows_takes_numpy_sizes_as_python_ints():
    """unpack_rows refused a numpy B or S; as Python ints B*S cannot wrap in the int64 bound check."""
    from megatron_vlm_packing.packing import make_pack_plan, pack_rows, plan_indices, unpack_rows

    rows = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    plan = make_pack_plan([3, 2], row_capacity=4)
    indices = plan_indices(plan, "cpu")
    packed = pack_rows(rows, indices)
    for given_plan in (plan, None):
        back = unpack_rows(packed, indices, batch_size=np.int64(2), row_length=np.int32(4), plan=given_plan)
        assert torch.equal(back, rows)
    with pytest.raises(ValueError, match=r"B\*S = 85070591730234615847396907784232501249, more than torch can index"):
        unpack_rows(packed, indices, batch_size=np.int64(2**63 - 1), row_length=np.int64(2**63 - 1))
    with pytest.raises(ValueError, match=r"row_length must be a positive int, got np.True_"):
        unpack_rows(packed, indices, batch_size=2, row_length=np.bool_(True))


@pytest.mark.parametrize("value", [torch.tensor(8), torch.tensor([8]), torch.tensor(8, dtype=torch.int32)],
                         ids=["0-d", "1-element", "int32"])
def test_a_tensor_length_is_refused_with_how_to_pass_it(value):
    """pad_to and dense_packed_seq_params' sizes took a one-element integer tensor (operator.index), the only
    integer options that did: on an accelerator that read the device at every call. The one rule (`is_int`)
    refuses it, saying to pass a Python int."""
    with pytest.raises(ValueError, match=r"^pad_to must be an int \(the packed length T\) or None, got tensor\(.*\); "
                                         r"pass a Python int \(int\(pad_to\)\), not a tensor$"):
        checked_pad_to(value)
    with pytest.raises(ValueError, match=r"pass a Python int \(int\(pad_to\)\), not a tensor"):
        pack_batch({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long)},
                   pad_to=value)
    with pytest.raises(ValueError, match=r"^dense_packed_seq_params needs int batch_size and seq_length, got "
                                         r"batch_size=2, seq_length=tensor\(.*\); pass Python ints \(int\(\.\.\.\)\), "
                                         r"not tensors$"):
        dense_packed_seq_params(2, value)
    for value in (8, np.int64(8), np.uint8(8)):
        assert checked_pad_to(value) == 8 and type(checked_pad_to(value)) is int
        assert dense_packed_seq_params(value, value).max_seqlen_q == 8
        assert type(dense_packed_seq_params(value, value).max_seqlen_q) is int


@pytest.mark.parametrize("flag", [torch.tensor(True), torch.tensor([True])], ids=["0-d", "1-element"])
def test_a_bool_tensor_is_no_length(flag):
    """operator.index reads a bool tensor as 1: pad_to=tensor(True) was taken as T = 1, and a bool tensor B or S
    of dense_packed_seq_params as 1 row / slot."""
    from megatron_vlm_packing.packing.dense import dense_packed_seq_params
    from megatron_vlm_packing.packing.plan import checked_pad_to

    with pytest.raises(ValueError, match=r"pad_to must be an int \(the packed length T\) or None, got tensor"):
        checked_pad_to(flag)
    with pytest.raises(ValueError, match=r"pad_to must be an int"):
        StepOptions(pad_to=flag)
    with pytest.raises(ValueError, match="dense_packed_seq_params needs int batch_size and seq_length"):
        dense_packed_seq_params(flag, 8)


def test_int32_shapes_price_as_python_ints():
    """A 70B-shaped TransformerShape of numpy int32 sizes (a config read through numpy) priced its linear FLOPs
    in int32, which wrapped: 5.9e9 per token where Python ints give 4.2e11, a 71x error in every balance."""
    sizes = dict(hidden=8192, layers=80, heads=64, head_dim=128, kv_groups=8, ffn=28672, vocab=152064)
    as_int32 = CostModel.from_shapes(TransformerShape(**{k: np.int32(v) for k, v in sizes.items()}))
    assert as_int32 == CostModel.from_shapes(TransformerShape(**sizes))
    assert type(as_int32.lm_linear) is float and as_int32.lm_linear == pytest.approx(4.1818e11, rel=1e-4)


def test_numpy_floats_are_kept_as_python_floats():
    """numpy floats are numbers: taken, and kept as Python floats (np.float32 was refused by MRopeConfig)."""
    cost = CostModel(lm_linear=np.float32(2.5), lm_attention=np.float64(0.5), vision_linear=np.float16(1))
    assert [type(v) for v in vars(cost).values()] == [float] * 7 and cost.lm_linear == 2.5
    seconds = TokenCounter(video_timestamp_seconds=np.float32(2.0)).video_timestamp_seconds
    assert seconds == 2.0 and type(seconds) is float
    config = MRopeConfig(family="qwen2_5_vl", tokens_per_second=np.float32(2.0), position_id_per_seconds=np.int64(25))
    assert (config.tokens_per_second, config.position_id_per_seconds) == (2.0, 25.0)
    assert type(config.tokens_per_second) is float and type(config.position_id_per_seconds) is float
    with pytest.raises(ValueError, match="tokens_per_second must be a finite number > 0, got np.float32"):
        MRopeConfig(family="qwen2_5_vl", tokens_per_second=np.float32("nan"))
    with pytest.raises(ValueError, match="tokens_per_second must be a finite number > 0, got np.True_"):
        MRopeConfig(family="qwen2_5_vl", tokens_per_second=np.bool_(True))


@pytest.mark.parametrize("flag", ["no", 1, None, np.bool_(True)], ids=repr)
def test_parallel_layout_sequence_parallel_is_a_bool(flag):
    """ParallelLayout(sequence_parallel="no") was kept, and read as on wherever the layout is tested for it."""
    with pytest.raises(ValueError, match="sequence_parallel must be a bool"):
        ParallelLayout(tp_size=2, sequence_parallel=flag)
