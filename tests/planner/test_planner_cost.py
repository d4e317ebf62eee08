"""Cost model and token counting: vectorised columns equal per-sample formulas; FLOP counts by hand."""

import io
import re

import numpy as np
import pytest
import torch

from megatron_vlm_packing.packing import PackMultiples
from megatron_vlm_packing.planner import (BinLayout, CostModel, PlannerConfig, SampleMetadata, SampleTable, TokenCounter,
                                          TransformerShape, plan_epoch)
from megatron_vlm_packing.planner.metadata import llava_tokens
from megatron_vlm_packing.planner.progress import Progress
from megatron_vlm_packing.planner.synthetic import synthetic_table


def test_flops_of_a_small_shape_by_hand():
    shape = TransformerShape(hidden=8, layers=2, heads=2, head_dim=4, kv_groups=1, ffn=16, gated=False, vocab=10)
    # per layer: q and o 8x8 each, k and v 8x4 each, MLP 2 x 8x16 -> 128 + 64 + 256 = 448; head 80.
    assert shape.linear_flops_per_token() == 6 * (2 * 448 + 80)
    assert shape.attention_flops_per_pair(causal=True) == 3 * 4 * 8 * 2 * 0.5
    assert shape.attention_flops_per_pair(causal=False, layers=1) == 3 * 4 * 8
    default = CostModel.qwen2_5_vl_7b()
    assert default.lm_linear == pytest.approx(4.24e10, rel=0.01)
    assert default.lm_attention == 6 * 28 * 3584
    with pytest.raises(ValueError, match="lm_linear"):
        CostModel(lm_linear=-1.0, lm_attention=0.0)


def _by_hand(sample: SampleMetadata, cost: CostModel, counter: TokenCounter):
    tokens = sample.text_tokens
    extra = 0.0
    for t, h, w in sample.image_grids + sample.video_grids:
        tokens += t * h * w // counter.spatial_merge ** 2 + counter.vision_wrappers
        extra += cost.vision_linear * t * h * w + cost.vision_attention * t * (h * w) ** 2
    for n in sample.audio_frames:
        tokens += n // counter.audio_pool + counter.audio_wrappers
        extra += cost.audio_linear * n + cost.audio_attention * n * n
    return tokens, extra + cost.lm_attention * tokens ** 2


def test_columns_equal_per_sample_formulas():
    table = synthetic_table(200, seed=2)
    cost, counter = CostModel.qwen2_5_vl_7b(), TokenCounter()
    tokens, extra = counter(table), cost.extra_costs(table, counter(table))
    for i in range(0, 200, 7):
        sample = table.sample(i)
        assert SampleTable.from_samples([sample]).sample(0) == sample
        want_tokens, want_extra = _by_hand(sample, cost, counter)
        assert tokens[i] == want_tokens and extra[i] == pytest.approx(want_extra, rel=1e-12)
    assert np.allclose(cost.sample_costs(table, tokens), cost.lm_linear * tokens + extra)


def test_llava_expansion_and_bad_metadata():
    table = SampleTable.from_samples([SampleMetadata(10, image_grids=((1, 4, 4), (1, 2, 2))), SampleMetadata(3)])
    assert llava_tokens(576)(table).tolist() == [10 + 2 * 576 + 1, 3]  # + the slot LLaVA zeroes before an image
    # Bins are sized in the space attention sees: 1163 expanded tokens do not fit 1024 slots.
    config = PlannerConfig(layout=BinLayout(capacity=2048), expanded_tokens=llava_tokens(576))
    assert sorted(b.tokens for b in plan_epoch(table, config).bins()) == [(10 + 2 * 576 + 1, 3)]
    with pytest.raises(ValueError, match=r"sample 0 \(1163 slots\)"):
        plan_epoch(table, PlannerConfig(layout=BinLayout(capacity=1024), expanded_tokens=llava_tokens(576)))
    with pytest.raises(ValueError, match="image_grids"):
        SampleTable.from_samples([SampleMetadata(1, image_grids=((1, 0, 4),))])
    with pytest.raises(ValueError, match="text_tokens"):
        SampleTable(text_tokens=np.asarray([3, -1]))


def test_float_counts_are_refused_not_truncated():
    """Counts that are not whole numbers were cast to int64: 10.7 text tokens became 10, a 2.5-patch
    grid side 2, 7.5 expanded tokens 7, and the bins were laid out for lengths the samples do not have."""
    with pytest.raises(ValueError, match="text_tokens must hold whole numbers; entry 1 is 10.7"):
        SampleTable.from_samples([SampleMetadata(3), SampleMetadata(10.7)])
    with pytest.raises(ValueError, match="text_tokens must hold whole numbers; entry 0 is nan"):
        SampleTable(text_tokens=[float("nan")])
    with pytest.raises(ValueError, match="text_tokens must hold integers"):
        SampleTable(text_tokens=["12"])
    with pytest.raises(ValueError, match="image_grids must hold whole numbers; entry 1 is 2.5"):
        SampleTable.from_samples([SampleMetadata(1, image_grids=((1, 2.5, 4),))])
    with pytest.raises(ValueError, match="audio_frames must hold whole numbers; entry 0 is 2.5"):
        SampleTable.from_samples([SampleMetadata(1, audio_frames=(2.5,))])
    with pytest.raises(ValueError, match="image_owner must hold whole numbers"):
        SampleTable(text_tokens=[1, 2], image_grids=[[1, 2, 2]], image_owner=[0.7])
    with pytest.raises(ValueError, match=r"sample 0: image_grids must be a tuple of \(t, h, w\) triples"):
        SampleTable.from_samples([SampleMetadata(1, image_grids=(1, 2, 4))])  # one grid, not a tuple of them
    assert SampleTable(text_tokens=np.asarray([3.0, 4.0])).text_tokens.tolist() == [3, 4]  # whole floats are fine
    # a bool beside ints made an int64 array and True was read as 1 token / a side of 1 patch
    with pytest.raises(ValueError, match="text_tokens must hold integers, not bools; entry 1 is True"):
        SampleTable.from_samples([SampleMetadata(3), SampleMetadata(text_tokens=True)])
    with pytest.raises(ValueError, match="image_grids must hold integers, not bools; entry 1 is True"):
        SampleTable.from_samples([SampleMetadata(1, image_grids=((1, True, 4),))])
    with pytest.raises(ValueError, match="text_tokens must hold integers, not bools; entry 0 is False"):
        SampleTable(text_tokens=[False, 2])
    table = SampleTable(text_tokens=[5, 5, 5])
    half = PlannerConfig(layout=BinLayout(capacity=128), expanded_tokens=lambda t: t.text_tokens * 1.5)
    with pytest.raises(ValueError, match="expanded_tokens must hold whole numbers; entry 0 is 7.5"):
        plan_epoch(table, half)
    with pytest.raises(ValueError, match="tokens_per_image must be an int >= 1, got 1.5"):
        llava_tokens(1.5)


def test_grid_the_merge_does_not_divide_is_refused():
    """A (1, 3, 3) grid under a 2x2 merge counted 9 // 4 = 2 tokens: the model cannot merge it, and
    the planner laid out a bin for a length no processor produces."""
    table = SampleTable.from_samples([SampleMetadata(4), SampleMetadata(1, image_grids=((1, 2, 2), (1, 3, 4)))])
    with pytest.raises(ValueError, match=r"image_grids of sample 1 is \[1, 3, 4\]: h and w must be multiples of "
                                         r"spatial_merge=2"):
        TokenCounter()(table)
    videos = SampleTable.from_samples([SampleMetadata(1, video_grids=((4, 6, 5),))])
    with pytest.raises(ValueError, match=r"video_grids of sample 0 is \[4, 6, 5\]"):
        plan_epoch(videos, PlannerConfig(layout=BinLayout(capacity=128)))
    assert TokenCounter(spatial_merge=1)(table).tolist() == [4, 1 + (4 + 2) + (12 + 2)]
    for field in ("spatial_merge", "audio_pool"):
        with pytest.raises(ValueError, match=f"TokenCounter.{field} must be an int >= 1, got 0"):
            TokenCounter(**{field: 0})  # a // 0 counted every image as 0 tokens


def test_progress_line_only_when_enabled():
    out = io.StringIO()
    bar = Progress(200, enabled=True, label="planning", stream=out, interval_s=0.0)
    bar.update(50)
    bar.close()
    assert "planning:  25% (50/200 samples)" in out.getvalue() and out.getvalue().endswith("100% (200/200 samples)\n")
    quiet = io.StringIO()
    Progress(200, enabled=False, stream=quiet).close()
    assert quiet.getvalue() == ""


def test_counts_numpy_cannot_hold_and_tables_of_the_wrong_shape_are_named():
    """[2**70] and [None] (object arrays) were an AttributeError ('int' object has no attribute 'item') raised while
    building the error; a [2, 2] text_tokens was flattened into 4 samples; from_samples took audio_frames=5 (a
    TypeError: 'int' object is not iterable) and None for a sample (an AttributeError)."""
    with pytest.raises(ValueError, match=rf"text_tokens must hold integers, got dtype object \(e.g. {2**70}\)"):
        SampleTable(text_tokens=[2**70])
    with pytest.raises(ValueError, match=r"text_tokens must hold integers, got dtype object \(e.g. None\)"):
        SampleTable(text_tokens=[None])
    with pytest.raises(ValueError, match=r"text_tokens must be one count per sample \(\[N\]\), got shape \(2, 2\)"):
        SampleTable(text_tokens=[[1, 2], [3, 4]])
    with pytest.raises(ValueError, match=r"sample 0: audio_frames must be a tuple of frame counts; got 5"):
        SampleTable.from_samples([SampleMetadata(3, audio_frames=5)])
    with pytest.raises(ValueError, match=r"sample 1 is NoneType, not a SampleMetadata"):
        SampleTable.from_samples([SampleMetadata(3), None])
    assert SampleTable(text_tokens=5).text_tokens.tolist() == [5]  # one sample's count as a scalar, as before


def test_cost_coefficients_and_shapes_of_the_wrong_type_are_named():
    """CostModel(lm_linear='1') and None were TypeErrors ('>=' not supported), True and inf were taken;
    TransformerShape took anything (hidden=0 or 1.5 priced every token wrong, '2' was a TypeError in the FLOPs)."""
    from megatron_vlm_packing.planner import TransformerShape

    for value in ("1", None, True, float("inf")):
        with pytest.raises(ValueError, match=rf"cost coefficients must be finite numbers >= 0; got \{{'lm_linear': "
                                             rf"{value!r}\}}"):
            CostModel(lm_linear=value, lm_attention=1.0)
    assert CostModel(lm_linear=np.float64(2.0), lm_attention=0).lm_linear == 2.0  # numpy numbers as before
    shape = dict(hidden=8, layers=2, heads=2, head_dim=4, kv_groups=1, ffn=16)
    for name, value in (("hidden", 0), ("layers", 1.5), ("heads", "2"), ("vocab", -1), ("gated", "no")):
        with pytest.raises(ValueError, match=rf"TransformerShape.{name} must be .*, got {value!r}$"):
            TransformerShape(**{**shape, name: value})


def test_token_counts_past_int64_are_refused_not_wrapped():
    """A (2**40)^3 video grid wrapped int64's product to 0 (the sample was planned as 5 tokens), four 2**62-token
    LLaVA images wrapped to 0 extra tokens, and a float sum past int64 became -2**63."""
    huge_video = SampleTable.from_samples([SampleMetadata(3, video_grids=((2**40, 2**40, 2**40),)), SampleMetadata(5)])
    with pytest.raises(ValueError, match=r"sample 0 takes about 3.3e\+35 tokens: more than 2\*\*53, which the planner "
                                         r"cannot count exactly"):
        TokenCounter()(huge_video)
    images = SampleTable.from_samples([SampleMetadata(3, image_grids=((1, 2, 2),) * 4)])
    with pytest.raises(ValueError, match=r"sample 0 takes about 1.8e\+19 tokens: more than 2\*\*53"):
        llava_tokens(2**62)(images)
    assert TokenCounter()(SampleTable.from_samples([SampleMetadata(3, video_grids=((2, 4, 4),))])).tolist() == [13]


def test_audio_token_counts_past_int64_are_refused_not_wrapped():
    """Audio clips were counted in int64: frames + audio_wrappers past 2**63 wrapped to about -2**63, so a sample
    of 2**53 - 1 text tokens and a 2**63 - 1 frame clip (audio_wrappers=2**63 - 1) was planned as 9007199254740989
    tokens, and a plain clip of 2**63 - 1 frames (audio_pool=1) made a sample of negative tokens."""
    counter = TokenCounter(audio_pool=1, audio_wrappers=2**63 - 1)
    wrapped = SampleTable.from_samples([SampleMetadata(2**53 - 1, audio_frames=(2**63 - 1,))])
    with pytest.raises(ValueError, match=r"sample 0 takes about 1.8e\+19 tokens: more than 2\*\*53"):
        counter(wrapped)
    long_clip = SampleTable.from_samples([SampleMetadata(1, audio_frames=(2**63 - 1,))])
    with pytest.raises(ValueError, match=r"sample 0 takes about 9.2e\+18 tokens: more than 2\*\*53"):
        TokenCounter(audio_pool=1)(long_clip)
    with pytest.raises(ValueError, match=r"sample 0 takes about 1.8e\+19 tokens"):  # an OverflowError before
        TokenCounter(audio_wrappers=2**64)(SampleTable.from_samples([SampleMetadata(1, audio_frames=(4,))]))
    assert TokenCounter(audio_pool=1)(SampleTable.from_samples([SampleMetadata(1, audio_frames=(2**52,))])).tolist() \
        == [1 + 2**52 + 2]


def test_audio_tokens_are_qwen2_5_omni_s_for_odd_frame_counts():
    """TokenCounter's audio rule claims Qwen2.5-Omni's (audio_pool=2 over the frames after the input convolution),
    whose encoder pools them with AvgPool1d(2, 2): (F - 2) // 2 + 1 = F // 2 tokens (HF's
    `_get_feat_extract_output_lengths`). The ceiling counted one token more for every odd F (3 frames: 2, not 1),
    so bins were laid out for lengths the samples do not have."""
    for raw in range(1, 400):  # mel frames; the input convolution (stride 2) keeps (raw - 1) // 2 + 1
        frames = (raw - 1) // 2 + 1
        hf_tokens = (frames - 2) // 2 + 1
        table = SampleTable.from_samples([SampleMetadata(5, audio_frames=(frames,))])
        assert TokenCounter()(table).tolist() == [5 + hf_tokens + 2], raw


def test_audio_tokens_of_the_packer_s_qwen3_omni_rule():
    """`pack_batch` counts a clip's placeholders with Qwen3-Omni's rule (`rope.omni.audio_output_length` of its mel
    frames and the encoder window), which no audio_pool reproduces (100 frames: 13 tokens; 8: 1; 200: 26), so a
    bin of omni samples was laid out for lengths pack_batch does not make. With `audio_n_window` the counter uses
    that rule on the clips' mel frames, and every bin's plan is the one pack_batch builds."""
    from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
    from megatron_vlm_packing.packing import pack_batch

    cfg = SyntheticVLMConfig(max_text=30, grid_choices=(2, 4), max_videos=1, max_audios=3, audio_frames=(1, 260))
    samples = synthetic_samples(24, seed=5, cfg=cfg)
    special = (cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id, cfg.vision_start_id, cfg.vision_end_id,
               cfg.audio_start_id, cfg.audio_end_id)

    def known_before_loading(sample: dict) -> SampleMetadata:  # text ids, grids and mel frame counts
        text = sum(int(t) not in special for t in sample["input_ids"])
        return SampleMetadata(text, image_grids=tuple(map(tuple, sample["image_grid_thw"].tolist())),
                              video_grids=tuple(map(tuple, sample["video_grid_thw"].tolist())),
                              audio_frames=tuple(clip.shape[1] for clip in sample["audio"]))

    table = SampleTable.from_samples([known_before_loading(s) for s in samples])
    assert len(table.audio_frames) > 10
    counter = TokenCounter(audio_n_window=cfg.audio_n_window)
    assert counter(table).tolist() == [len(s["input_ids"]) for s in samples]
    config = PlannerConfig(layout=BinLayout(capacity=256), expanded_tokens=counter)
    pack = dict(label_style="hf", image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                audio_token_id=cfg.audio_token_id)  # the window: 50, pack_batch's default (cfg.audio_n_window)
    for planned in plan_epoch(table, config).bins():
        packed = pack_batch(collate([samples[i] for i in planned.samples]), pad_to=planned.physical, **pack)
        assert packed.plan == planned.plan(config.layout)
    assert TokenCounter(audio_n_window=50)(SampleTable.from_samples(
        [SampleMetadata(0, audio_frames=(100, 8, 200))])).tolist() == [13 + 1 + 26 + 3 * 2]
    with pytest.raises(ValueError, match="TokenCounter.audio_n_window must be None or an int >= 1, got 0"):
        TokenCounter(audio_n_window=0)


def test_counts_past_int64_are_named_as_given_not_wrapped():
    """A uint64 count of 2**63 or more, or a whole float of 2**63 or more, was cast to int64 and wrapped negative:
    the error then named a number the caller never gave ('sample 1 has -1' for 2**64 - 1, 'have no tokens' for an
    expanded_tokens hook returning 1e30)."""
    for values, shown in ((np.array([5, 2**64 - 1], dtype=np.uint64), "18446744073709551615"),
                          (np.array([5.0, 1e19]), "1e+19"), ([5.0, 2.0**63], "9.223372036854776e+18")):
        with pytest.raises(ValueError, match=rf"text_tokens must hold counts below 2\*\*63; entry 1 is "
                                             rf"{re.escape(shown)}$"):
            SampleTable(text_tokens=values)
    with pytest.raises(ValueError, match=r"audio_frames must hold counts below 2\*\*63; entry 0 is 922337203685477581"):
        SampleTable(text_tokens=[5], audio_frames=np.array([2**63 + 5], dtype=np.uint64), audio_owner=[0])
    config = PlannerConfig(layout=BinLayout(capacity=64), expanded_tokens=lambda table: np.array([5, 1e30]))
    with pytest.raises(ValueError, match=r"expanded_tokens must hold counts below 2\*\*63; entry 1 is 1e\+30"):
        plan_epoch(SampleTable(text_tokens=[5, 6]), config)
    assert SampleTable(text_tokens=np.array([5, 2**63 - 1], dtype=np.uint64)).text_tokens.tolist() == [5, 2**63 - 1]
    assert SampleTable(text_tokens=[5.0, 2.0**62]).text_tokens.tolist() == [5, 2**62]


@pytest.mark.parametrize("index", [-1, 3, 1.0, True])
def test_sample_of_an_index_outside_the_table_is_refused(index):
    """table.sample(-1) gave the last sample's text tokens with no media (images are matched by owner == -1), and 3
    (past the end) or 1.0 failed inside numpy; True was sample 1."""
    table = SampleTable.from_samples([SampleMetadata(1), SampleMetadata(2, image_grids=((1, 2, 2),)),
                                      SampleMetadata(3, audio_frames=(4,))])
    with pytest.raises(ValueError, match=rf"index={index!r} must be an int in \[0, 3\)"):
        table.sample(index)
    assert table.sample(np.int64(1)) == SampleMetadata(2, image_grids=((1, 2, 2),))


@pytest.mark.parametrize("segment, total", [(1, 1), (4, 4), (4, 8)])  # (4, 8): LlavaSpace.of at TP=2, CP=2, SP
def test_llava_bins_hold_the_slot_llava_zeroes_before_an_image(segment, total):
    """LLaVA zeroes the loss of the slot before each image, so its packer gives the document before one that
    opens with an image a pad slot (bug class 13). llava_tokens did not count it: a bin filled to the capacity
    (8 text tokens, then a sample opening with an image, 6 expanded tokens, capacity 14) expanded to 15 and
    LlavaPackingCollator(pad_to=capacity) refused it in the loader ('it would truncate'), mid-epoch. A sample
    with an image now reserves one segment more, and every bin of random samples packs at its planned length."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator

    image, per_image = 127, 4
    space = LlavaSpace(img_seq_len=per_image, image_token_index=image, segment_multiple=segment,
                       total_multiple=total)
    rng = np.random.default_rng(segment)
    samples = [torch.arange(10, 18), torch.tensor([image, 20, 21])]  # the bin that overflowed
    for _ in range(60):  # text with 0-2 images anywhere, an image first in about a third of them
        row = [int(t) for t in rng.integers(1, 100, int(rng.integers(1, 12)))]
        for _ in range(int(rng.integers(0, 3))):
            row.insert(0 if rng.random() < .4 else int(rng.integers(0, len(row) + 1)), image)
        samples.append(torch.tensor(row))

    def collate(group):
        ids = torch.zeros(len(group), max(map(len, group)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(group):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask,
                "images": torch.zeros(int((ids == image).sum()), 3, 2, 2)}

    images = [int((s == image).sum()) for s in samples]
    table = SampleTable.from_samples([SampleMetadata(len(s) - n, image_grids=((1, 2, 2),) * n)
                                      for s, n in zip(samples, images)])
    multiples = space.multiples  # LLaVA's own shard factor, not the language model's PackMultiples.for_parallel
    assert multiples == PackMultiples(segment=segment, total=total)
    for capacity, shuffle in ((-(-(12 + 2 * segment) // total) * total, False), (48, True), (48, False)):
        config = PlannerConfig(layout=BinLayout(capacity=capacity, multiples=multiples, oversize="own_bin"),
                               shuffle=shuffle, expanded_tokens=llava_tokens(per_image, segment_multiple=segment))
        for planned in plan_epoch(table, config).bins():
            collator = LlavaPackingCollator(space=space, collate=collate, pad_to=planned.physical)
            packed = collator([samples[i] for i in planned.samples])
            assert packed.stats.physical_tokens == planned.physical
    with pytest.raises(ValueError, match="segment_multiple must be an int >= 1, got 0"):
        llava_tokens(per_image, segment_multiple=0)


@pytest.mark.parametrize("flag", [torch.tensor(True), np.array(True)])
def test_a_bool_tensor_or_array_among_counts_is_refused(flag):
    """True and np.True_ were refused, but a torch bool scalar (a mask's .sum() > 0, an .any()) or a 0-d numpy bool
    array beside ints made an int64 array and was planned as 1 token / a side of 1 patch, silently."""
    with pytest.raises(ValueError, match=r"text_tokens must hold integers, not bools; entry 0 is "):
        SampleTable.from_samples([SampleMetadata(flag), SampleMetadata(3)])
    with pytest.raises(ValueError, match=r"image_grids must hold integers, not bools; entry 1 is "):
        SampleTable.from_samples([SampleMetadata(3, image_grids=((1, flag, 2),))])
    counts = SampleTable.from_samples([SampleMetadata(torch.tensor(4)), SampleMetadata(np.array(3))]).text_tokens
    assert counts.tolist() == [4, 3]  # integer tensors and arrays are counts, as before


def _qwen3_vl_video_ids(t: int, h: int, w: int, seconds: list[float]) -> list[str]:
    """A Qwen3-VL video as its processor expands it (transformers' `Qwen3VLProcessor.replace_video_token`): the
    chat template's vision_start / vision_end around, and per temporal grid step `<{s:.1f} seconds>`, then
    vision_start, h*w/4 placeholders (merge 2), vision_end. The timestamp is tokenized as Qwen's tokenizer
    splits it: '<', one token per digit, '.', ' seconds', '>'."""
    ids = ["<|vision_start|>"]
    for step in range(t):
        whole, tenth = f"{seconds[step]:.1f}".split(".")
        ids += ["<", *whole, ".", tenth, " seconds", ">", "<|vision_start|>"] + ["<|video_pad|>"] * (h * w // 4)
        ids += ["<|vision_end|>"]
    return ids + ["<|vision_end|>"]


def test_qwen3_vl_video_timestamps_and_frame_blocks_are_counted():
    """Qwen3-VL's processor writes a timestamp and a vision_start / vision_end pair per temporal grid step of a
    video; the counter counted one block of t*h*w/4 placeholders and 2 wrappers per video, so a 4-step 16x16
    video took 290 tokens where 258 were planned, and bins overflowed the capacity pack_batch was given.
    `video_frame_tokens` counts them: 2 + the timestamp's tokens (6 below 10 s, 7 below 100 s)."""
    grids = [(4, 16, 16), (2, 8, 4)]
    seconds = [[0.5, 1.5, 2.5, 3.5], [1.0, 3.0]]  # the processor's mean time of each step's two frames
    text = 11  # tokens outside the videos
    ids = ["x"] * text + _qwen3_vl_video_ids(*grids[0], seconds[0]) + _qwen3_vl_video_ids(*grids[1], seconds[1])
    table = SampleTable.from_samples([SampleMetadata(text, video_grids=tuple(grids))])
    assert len(ids) == 11 + (2 + 4 * (6 + 2 + 64)) + (2 + 2 * (6 + 2 + 8)) == 335
    assert TokenCounter(video_frame_tokens=8)(table).tolist() == [len(ids)]
    assert TokenCounter()(table).tolist() == [11 + (2 + 256) + (2 + 16)]  # Qwen2-VL / Qwen2.5-VL: one block
    long = _qwen3_vl_video_ids(3, 4, 4, [8.5, 10.5, 12.5])  # 7 tokens from 10 s on: the longest's count bounds it
    counted = TokenCounter(video_frame_tokens=9)(SampleTable.from_samples([SampleMetadata(0, video_grids=((3, 4, 4),))]))
    assert counted.tolist() == [2 + 3 * (9 + 4)] and counted[0] - len(long) == 1  # over by the first step's digit
    with pytest.raises(ValueError, match="TokenCounter.video_frame_tokens must be an int >= 0, got -1"):
        TokenCounter(video_frame_tokens=-1)
