import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing import shift_labels_within_rows


def make_batch(lengths, seq_len, *, vocab=50, seed=0, pad_id=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), seq_len), generator=g)
    keep = torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, ids, pad_id)
    return ids, keep


def test_three_row_example_both_boundary_sets():
    ids, keep = make_batch([5, 2, 3], 6)
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep.long()}, cp_size=2, label_style="hf")
    params = packed.packed_seq_params
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 5, 7, 10]
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16]
    assert params.cu_seqlens_kv.tolist() == params.cu_seqlens_q.tolist()
    assert params.cu_seqlens_kv_padded.tolist() == params.cu_seqlens_q_padded.tolist()
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q_padded.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 8 and type(params.max_seqlen_q) is int
    assert getattr(params, "pad_between_seqs", True) is True
    assert packed.rope_cu_seqlens.tolist() == [0, 5, 7, 10]
    assert packed.padding_mask.tolist() == [[False] * 5 + [True] * 3 + [False] * 2 + [True] * 2 + [False] * 3 + [True]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert (packed.num_real_tokens, packed.num_physical_tokens) == (10, 16)


def test_pad_id_equal_to_real_tokens_does_not_matter():
    # Bug class 7: a real token equal to the pad id (0 or eos) must stay real.
    ids = torch.tensor([[0, 0, 7, 0], [3, 0, 0, 0]])
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep}, label_style="hf")
    assert packed.padding_mask.sum().item() == 0
    assert packed.packed_seq_params.cu_seqlens_q.tolist() == [0, 4, 6]


def test_hf_labels_shift_inside_each_sample():
    ids = torch.tensor([[11, 12, 13, 0], [21, 22, 23, 24]])
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    labels = torch.where(keep.bool(), ids, -100)
    labels[1, 1] = -100  # a masked target (e.g. an image token)
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": keep}, label_style="hf")
    # Sample 0's last token has no target; it never learns sample 1's first token (bug class 8).
    assert packed.labels.tolist() == [[12, 13, -100, -100, 23, 24, -100]]
    assert packed.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1, 0]]


def test_megatron_labels_and_loss_mask_are_respected():
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    labels = torch.tensor([[2, 3, 9], [5, 6, 9]])
    loss_mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    packed = pack_batch({"tokens": ids, "labels": labels, "loss_mask": loss_mask, "seq_lens": [3, 2]})
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5]]
    assert packed.labels.tolist() == [[2, 3, 9, 5, 6]]
    assert packed.loss_mask.tolist() == [[1, 0, 1, 1, 1]]


def test_declared_extras_are_packed_and_vision_inputs_are_typed_with_per_sample_counts():
    ids = torch.tensor([[5, 9, 0, 0], [9, 9, 9, 9]])  # 9 = image placeholder: row 0 one 1-token image, row 1 a 4-token one
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    weights = torch.arange(8.0).view(2, 4)
    pixel_values = torch.randn(4 + 16, 4)  # [patches, dim]
    grid = torch.tensor([[1, 2, 2], [1, 4, 4]])
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep, "token_weights": weights,
                         "pixel_values": pixel_values, "image_grid_thw": grid},
                        extra_keys=("token_weights",), image_token_id=9, label_style="hf")
    assert packed.extras["token_weights"].tolist() == [[0.0, 1.0, 4.0, 5.0, 6.0, 7.0]]
    assert packed.vision.pixel_values is pixel_values and packed.vision.image_grid_thw is grid
    assert packed.vision.images_per_sample == (1, 1) and packed.vision.pixel_values_videos is None
    assert packed.audio is None and packed.inputs_present() == {"images", "extra:token_weights"}
    assert (packed.stats.real_tokens, packed.stats.physical_tokens, packed.stats.row_tokens) == (6, 6, 8)


def test_precomputed_3d_positions_are_packed_per_sample():
    ids, keep = make_batch([3, 2], 3)
    pos = torch.stack([torch.tensor([[0, 1, 1], [0, 1, 0]]), torch.tensor([[0, 2, 3], [0, 1, 0]]),
                       torch.tensor([[0, 1, 4], [0, 1, 0]])])
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep, "position_ids": pos}, cp_size=2,
                        label_style="hf")
    assert packed.position_ids.shape == (3, 1, 8)
    assert packed.position_ids[0, 0].tolist() == [0, 1, 1, 5, 0, 1, 2, 3]
    assert packed.position_ids[2, 0].tolist() == [0, 1, 4, 5, 0, 1, 2, 3]


def test_mrope_callable_gets_each_sample_alone():
    ids, keep = make_batch([3, 2], 4)
    seen = {}

    def fake_index(input_ids, attention_mask=None, image_grid_thw=None):
        seen["mask"], seen["grid"] = attention_mask.clone(), image_grid_thw
        base = torch.cumsum(attention_mask, dim=1) - 1
        return torch.stack([base, base * 2, base * 3]), None

    grid = torch.tensor([[1, 2, 2]])
    ids[0, 1] = 7  # one 1-token image in row 0
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep, "image_grid_thw": grid,
                         "pixel_values": torch.zeros(4, 3)}, mrope=fake_index, image_token_id=7, label_style="hf")
    assert seen["mask"].tolist() == keep.long().tolist() and seen["grid"] is grid
    assert packed.position_ids[:, 0].tolist() == [[0, 1, 2, 0, 1], [0, 2, 4, 0, 2], [0, 3, 6, 0, 3]]


def test_mrope_callable_that_cannot_read_a_grid_the_batch_carries_is_refused():
    ids, keep = make_batch([3, 2], 4)
    ids[0, 1] = 7  # one 1-token image in row 0

    def text_only_index(input_ids, attention_mask=None):  # would give the image token text positions
        base = torch.cumsum(attention_mask, dim=1) - 1
        return torch.stack([base, base, base])

    batch = {"input_ids": ids, "labels": ids, "attention_mask": keep, "image_grid_thw": torch.tensor([[1, 2, 2]]),
             "pixel_values": torch.zeros(4, 3)}
    with pytest.raises(ValueError, match=r"carries \['image_grid_thw'\] but the mrope callable text_only_index "
                                         r"takes none of them"):
        pack_batch(batch, mrope=text_only_index, image_token_id=7, label_style="hf")
    any_keywords = lambda input_ids, **kw: text_only_index(input_ids, kw["attention_mask"])  # noqa: E731
    assert pack_batch(batch, mrope=any_keywords, image_token_id=7, label_style="hf").position_ids.shape == (3, 1, 5)


def test_mrope_callable_that_cannot_read_the_processors_token_types_is_refused():
    """mm_token_type_ids (transformers 5 processors) and use_audio_in_video were dropped unread when the callable
    did not take them: its positions then came from its own guess of each token's kind."""
    ids, keep = make_batch([3, 2], 4)

    def index_without_types(input_ids, attention_mask=None, image_grid_thw=None):
        base = torch.cumsum(attention_mask, dim=1) - 1
        return torch.stack([base, base, base])

    batch = {"input_ids": ids, "labels": ids, "attention_mask": keep, "mm_token_type_ids": torch.zeros_like(ids)}
    with pytest.raises(ValueError, match=r"carries \['mm_token_type_ids'\] but the mrope callable index_without_types "
                                         r"takes none of them by name: its positions would be made without them"):
        pack_batch(batch, mrope=index_without_types, label_style="hf")
    with pytest.raises(ValueError, match=r"carries \['use_audio_in_video'\] but the mrope callable"):
        pack_batch({**batch, "mm_token_type_ids": None, "use_audio_in_video": False}, mrope=index_without_types,
                   label_style="hf")

    def index_with_types(input_ids, attention_mask=None, mm_token_type_ids=None):
        return index_without_types(input_ids, attention_mask)

    assert pack_batch(batch, mrope=index_with_types, label_style="hf").position_ids.shape == (3, 1, 5)


@pytest.mark.parametrize(
    "batch, kwargs, expected",
    [
        ({"labels": torch.full((2, 3), 2)}, {}, r"exactly one of 'input_ids' or 'tokens', found neither"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "tokens": torch.ones(2, 3)}, {}, r"found \['input_ids', 'tokens'\]"),
        ({"input_ids": torch.ones(6, dtype=torch.long), "labels": torch.ones(6)}, {}, r"input_ids must be a \[B, S\] tensor"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long)}, {}, r"no 'labels'"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 4)}, {}, r"labels has shape \(2, 4\) but input_ids is \(2, 3\)"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2), "loss_mask": torch.ones(3, 3)}, {}, r"loss_mask has shape \(3, 3\)"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2), "attention_mask": torch.tensor([[1, 0, 1], [1, 1, 1]])}, {}, r"attention_mask rows must be right-padded.*row 0.*holes at positions \[1\]"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}, {}, r"left padding"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2), "attention_mask": torch.zeros(2, 3)}, {}, r"no real tokens"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2)}, {"pad_to": 4}, r"pad_to=4 is smaller than the 6 physical tokens"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2)}, {"label_style": "torch"}, r"label_style must be 'megatron' or 'hf'"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2)}, {"cp_size": 0}, r"cp_size must be a positive int"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2), "position_ids": torch.zeros(3, 2, 4, dtype=torch.long)}, {}, r"mRoPE positions must be \[3, 2, 3\]"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2), "position_ids": torch.zeros(3, 2, 3, dtype=torch.long)}, {"mrope": lambda ids, **kw: None}, r"pass one of them"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2)}, {"mrope": lambda ids, **kw: torch.zeros(2, 3)}, r"mrope positions must be \[3, B, S\] = \[3, 2, 3\], got \(2, 3\)"),
        ({"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.full((2, 3), 2)}, {"mrope": 3}, r"mrope must be an MRopeConfig or a callable"),
    ],
)
def test_bad_batches_raise_naming_the_field(batch, kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        pack_batch(batch, **kwargs)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any),
    tp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2, 3]), sp=st.booleans(), fp8=st.booleans(),
    style=st.sampled_from(["megatron", "hf"]),
)
def test_pack_batch_contract(lengths, tp, cp, sp, fp8, style):
    sp = sp and tp > 1  # SP needs TP (Megatron-Core refuses it at tp=1)
    ids, keep = make_batch(lengths, 9)
    labels = torch.where(keep, ids, -100)
    if style == "megatron":  # Megatron labels are the next token already
        labels = torch.where(keep, torch.roll(ids, -1, dims=1), -100)
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": keep.long()},
                        tp_size=tp, cp_size=cp, sequence_parallel=sp, fp8=fp8, label_style=style)
    plan, params = packed.plan, packed.packed_seq_params
    total = plan.total
    # Shapes and dtypes.
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
        assert getattr(packed, name).shape == (1, total), name
    assert packed.padding_mask.dtype == torch.bool and packed.loss_mask.dtype == torch.float32
    # Boundaries: real counts real tokens, padded counts slots; both start at 0, end at totals.
    assert params.cu_seqlens_q[-1].item() == sum(lengths) and params.cu_seqlens_q_padded[-1].item() == total
    # Padding mask is True exactly at slots outside every document's real span.
    cu, cu_p = params.cu_seqlens_q.tolist(), params.cu_seqlens_q_padded.tolist()
    expected_pad = torch.ones(total, dtype=torch.bool)
    for i in range(len(cu) - 1):
        expected_pad[cu_p[i]: cu_p[i] + cu[i + 1] - cu[i]] = False
    assert torch.equal(packed.padding_mask[0], expected_pad)
    # No target crosses a boundary: every labelled token's target is the next token of its own sample.
    real_ids = packed.input_ids[0][~expected_pad]
    real_labels = packed.labels[0][~expected_pad]
    hf_shifted = shift_labels_within_rows(labels, keep)[keep] if style == "hf" else labels[keep]
    assert torch.equal(real_labels, hf_shifted)
    assert torch.equal(real_ids, ids[keep])
    assert bool((packed.loss_mask[0][expected_pad] == 0).all()) and bool((packed.labels[0][expected_pad] == -100).all())


def test_mrope_config_packs_each_samples_own_positions():
    from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

    cfg = MRopeConfig(family="qwen2_vl", image_token_id=9, video_token_id=8)
    ids = torch.tensor([[1, 9, 9, 9, 9, 2, 0], [3, 4, 9, 9, 9, 9, 5]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    grids = torch.tensor([[1, 4, 4], [1, 2, 8]])
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep, "image_grid_thw": grids,
                         "pixel_values": torch.zeros(32, 3)}, mrope=cfg, cp_size=2, label_style="hf")
    first = get_rope_index(ids[:1, :6], cfg, image_grid_thw=grids[:1]).position_ids[:, 0]
    second = get_rope_index(ids[1:], cfg, image_grid_thw=grids[1:]).position_ids[:, 0]
    cu_p = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    assert torch.equal(packed.position_ids[:, 0, :6], first)
    assert torch.equal(packed.position_ids[:, 0, cu_p[1]:cu_p[1] + 7], second)
    # pads never restart at 0: they continue after the document's largest position
    assert packed.position_ids[:, 0, 6:8].tolist() == [[first.max() + 1, first.max() + 2]] * 3
