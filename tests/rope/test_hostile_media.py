"""Hostile media inputs through the mRoPE index and `pack_batch(mrope=...)` (fuzz round on the mRoPE packing
path): each case is either the Hugging Face model's own positions for the sample alone or a ValueError naming
the field and the numbers. Every case here was a silent wrong result or a crash before its fix."""

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.rope.config import SECONDS_FAMILIES
from megatron_vlm_packing.rope.omni import audio_output_length
from tests.rope.conftest import hf_config, hf_get_rope_index

transformers = pytest.importorskip("transformers")

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653
VL_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _image_row(tokens: int) -> torch.Tensor:
    """[1, L]: text, one image block of `tokens` placeholders, text."""
    return torch.tensor([[5, START] + [IMAGE] * tokens + [END, 7]])


@pytest.mark.parametrize("family", VL_FAMILIES)
def test_a_grid_whose_token_count_wraps_int64_is_refused(family):
    """[1, 2**62 + 2, 16] needs t * (h / 2) * (w / 2) = 2**64 + 8 tokens: int64 arithmetic wrapped it to 8, so an
    8-token block passed the index's count check and got positions from a grid of 2**61 + 1 rows (the HF model
    fails to allocate it). Grids-only batches (a text model with mRoPE) had no other count of it."""
    cfg = MRopeConfig.from_hf_config(hf_config(family))
    ids, grid = _image_row(8), torch.tensor([[1, 2 ** 62 + 2, 16]])
    message = r"image_grid_thw row 0 is \[1, 4611686018427387906, 16\]: t \* h \* w = 73786976294838206496 patches"
    with pytest.raises(ValueError, match=message):
        get_rope_index(ids, cfg, image_grid_thw=grid)
    with pytest.raises(ValueError, match=message):
        pack_batch({"input_ids": ids, "labels": ids, "image_grid_thw": grid}, mrope=cfg, label_style="hf")


def test_a_huge_but_int64_grid_is_counted_exactly():
    """A grid whose patches fit int64 is counted, not refused as an overflow: the block's own count error."""
    cfg = MRopeConfig.from_hf_config(hf_config("qwen2_vl"))
    with pytest.raises(ValueError, match=r"has 8 placeholder tokens but its grid \[1, 1073741824, 16\] with merge 2 "
                                         r"needs 4294967296"):
        get_rope_index(_image_row(8), cfg, image_grid_thw=torch.tensor([[1, 2 ** 30, 16]]))


@pytest.mark.parametrize("seconds", [2e9, 1e10, 3e17])
def test_qwen2_5_vl_video_t_positions_beyond_int32_equal_the_hf_model(seconds):
    """t positions of a video are floor(frame * tokens_per_second * seconds): past 2**31 they wrapped in the
    index's int32 per-token arithmetic (20000000002 came back as -2147483646), silently."""
    hf = hf_config("qwen2_5_vl")
    cfg = MRopeConfig.from_hf_config(hf)
    ids = torch.tensor([[5, START] + [VIDEO] * 8 + [END, 7]])
    grid, per_grid = torch.tensor([[2, 4, 4]]), torch.tensor([seconds])
    from megatron_vlm_packing.rope.index import token_types

    expected = hf_get_rope_index("qwen2_5_vl", hf)(ids, mm_token_type_ids=token_types(ids, cfg), video_grid_thw=grid,
                                                   second_per_grid_ts=per_grid)[0]
    assert int(expected.max()) > 2 ** 31
    assert torch.equal(get_rope_index(ids, cfg, video_grid_thw=grid, second_per_grid_ts=per_grid).position_ids,
                       expected)
    batch = {"input_ids": ids, "labels": ids, "video_grid_thw": grid, "second_per_grid_ts": per_grid,
             "pixel_values_videos": torch.zeros(32, 2)}
    packed = pack_batch(batch, mrope=cfg, label_style="hf", cp_size=2)
    assert torch.equal(packed.position_ids[:, :, :ids.shape[1]], expected)


def test_max_position_text_after_a_long_video_does_not_wrap():
    """text_offset="max_position" resumes text at 1 + the video's largest t position: past 2**31 the run starts
    wrapped in int32 too."""
    cfg = MRopeConfig(family="qwen2_5_vl", tokens_per_second=2.0, text_offset="max_position")
    ids = torch.tensor([[5, START] + [VIDEO] * 8 + [END, 7]])
    positions = get_rope_index(ids, cfg, video_grid_thw=torch.tensor([[2, 4, 4]]),
                               second_per_grid_ts=torch.tensor([1e10])).position_ids[0, 0].tolist()
    assert positions == [0, 1] + [2] * 4 + [20000000002] * 4 + [20000000003, 20000000004]


def _omni():
    from tests.rope.test_omni import thinker

    hf, reference = thinker()
    return hf, reference, MRopeConfig.from_hf_config(hf)


@pytest.mark.parametrize("audio_in_video", [False, True])
def test_omni_video_block_shorter_than_a_huge_grid_is_a_value_error_before_any_allocation(audio_in_video):
    """A Qwen3-Omni video block was positioned (a [3, t*h*w/4] tensor built) before its length was checked
    against the grid: a grid of 2**44 tokens was a RuntimeError (cannot allocate), not the block's count error."""
    hf, _, cfg = _omni()
    body = [START, VIDEO, VIDEO, END] if not audio_in_video else \
        [START, cfg.audio_start_token_id] + [cfg.audio_token_id] * 2 + [VIDEO, VIDEO, hf.audio_end_token_id, END]
    ids = torch.tensor([[5, *body, 7]])
    kwargs = dict(video_grid_thw=torch.tensor([[2 ** 10, 2 ** 18, 2 ** 18]]), second_per_grid_ts=torch.tensor([0.5]))
    if audio_in_video:
        kwargs |= dict(audio_seqlens=torch.tensor([10]), use_audio_in_video=True)
    what = "video with audio" if audio_in_video else "video"
    message = rf"the {what} block at input_ids row 0 position {2 + audio_in_video} has \d+ placeholder tokens but "
    with pytest.raises(ValueError, match=message + r"its grid / audio length needs \d{14}"):
        get_rope_index(ids, cfg, **kwargs)


@pytest.mark.parametrize("kind", ["image", "video", "audio"])
def test_omni_placeholder_outside_every_block_is_refused(kind):
    """A Qwen3-Omni placeholder in text (no start token before it) took text positions; the other families count
    it as a block of its own and refuse it, and the HF model cannot place its embedding. With grids alone (a text
    model with mRoPE, or a position callable's batch) nothing else counted it."""
    hf, _, cfg = _omni()
    stray = {"image": IMAGE, "video": VIDEO, "audio": cfg.audio_token_id}[kind]
    ids = torch.tensor([[5, START] + [IMAGE] * 4 + [END, 9, stray, 7]])
    grid = torch.tensor([[1, 4, 4]])
    message = rf"input_ids row 0 position 8 is an? {kind} placeholder \({stray}\) outside every block"
    with pytest.raises(ValueError, match=message):
        get_rope_index(ids, cfg, image_grid_thw=grid)
    if kind == "image":  # a stray video or audio placeholder is the packing's orphan error first (no such media)
        with pytest.raises(ValueError, match=message):
            pack_batch({"input_ids": ids, "labels": ids, "image_grid_thw": grid}, mrope=cfg, label_style="hf")


def _video_batch(per_grid) -> dict:
    ids = torch.tensor([[5, START] + [VIDEO] * 8 + [END, 7]])
    return {"input_ids": ids, "labels": ids, "video_grid_thw": torch.tensor([[2, 4, 4]]),
            "second_per_grid_ts": per_grid, "pixel_values_videos": torch.zeros(32, 2)}


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_omni"])
@pytest.mark.parametrize("how", ["index", "pack", "callable"])
def test_seconds_that_are_not_real_numbers_are_refused(dtype, family, how):
    """Complex seconds lost their imaginary part without a word (a warning at most) and bool seconds were read as
    1 second, through the index, pack_batch and a position callable alike."""
    cfg = _omni()[2] if family == "qwen3_omni" else MRopeConfig.from_hf_config(hf_config(family))
    batch = _video_batch(torch.tensor([1.5]).to(dtype))
    message = rf"second_per_grid_ts must hold real numbers of seconds, got dtype {dtype}"
    with pytest.raises(ValueError, match=message):
        if how == "index":
            get_rope_index(batch["input_ids"], cfg, video_grid_thw=batch["video_grid_thw"],
                           second_per_grid_ts=batch["second_per_grid_ts"])
        elif how == "pack":
            pack_batch(batch, mrope=cfg, label_style="hf")
        else:
            def positions(input_ids, attention_mask=None, video_grid_thw=None, second_per_grid_ts=None):
                return get_rope_index(input_ids, cfg, attention_mask=attention_mask, video_grid_thw=video_grid_thw,
                                      second_per_grid_ts=None if second_per_grid_ts is None
                                      else second_per_grid_ts.real.float())
            pack_batch(batch, mrope=positions, label_style="hf", video_token_id=VIDEO)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_omni"])
def test_seconds_in_a_batch_without_videos_are_refused_with_mrope(family):
    """Without mrope= seconds beside no video were refused; with it (the index reads the grids) they were dropped
    without a word whenever the batch had no video grid at all."""
    cfg = _omni()[2] if family == "qwen3_omni" else MRopeConfig.from_hf_config(hf_config(family))
    ids = torch.tensor([[5, START] + [IMAGE] * 4 + [END, 7]])
    batch = {"input_ids": ids, "labels": ids, "image_grid_thw": torch.tensor([[1, 4, 4]]),
             "pixel_values": torch.zeros(16, 2), "second_per_grid_ts": torch.tensor([0.5, 1.0])}
    for call in (pack_batch, __import__("megatron_vlm_packing").pad_batch):
        with pytest.raises(ValueError, match=r"second_per_grid_ts has 2 entries but the batch has no videos"):
            call(batch, mrope=cfg, label_style="hf")


@pytest.mark.parametrize("value", [2, -1, 0.5])
def test_omni_attention_mask_values_other_than_one_are_masked_like_the_hf_thinker(value):
    """The Qwen3-Omni thinker keeps exactly the tokens whose mask is 1 (the Qwen-VL models keep any nonzero, and so
    does the index for them); the Omni index kept every nonzero, so get_rope_index gave other positions than the
    HF model for the same call."""
    hf, reference, cfg = _omni()
    ids = torch.tensor([[5, START] + [IMAGE] * 4 + [END, 7, 8, 9, 10, 11]])
    grid, mask = torch.tensor([[1, 4, 4]]), torch.tensor([[1] * 8 + [value] * 4])
    expected = reference(ids, image_grid_thw=grid, attention_mask=mask)[0]
    assert torch.equal(get_rope_index(ids, cfg, image_grid_thw=grid, attention_mask=mask).position_ids, expected)


GET_ROPE_INDEX_INPUTS = ["input_ids", "attention_mask", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
                         "mm_token_type_ids", "audio_seqlens"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_omni"])
@pytest.mark.parametrize("kind", ["meta", "sparse", "nested"])
@pytest.mark.parametrize("name", GET_ROPE_INDEX_INPUTS)
def test_get_rope_index_inputs_without_dense_values_are_refused(family, kind, name):
    """A meta or sparse input of get_rope_index was a NotImplementedError / RuntimeError from deep inside it."""
    cfg = _omni()[2] if family == "qwen3_omni" else MRopeConfig.from_hf_config(hf_config(family))
    if family != "qwen3_omni" and name == "audio_seqlens" or family == "qwen3_omni" and name == "mm_token_type_ids":
        pytest.skip("not read by this family")
    ids = torch.tensor([[5, START] + [VIDEO] * 8 + [END, 7], [5, START] + [IMAGE] * 4 + [END, 7, 0, 0, 0, 0]])
    kwargs = dict(input_ids=ids, attention_mask=torch.tensor([[1] * 12, [1] * 8 + [0] * 4]),
                  image_grid_thw=torch.tensor([[1, 4, 4]]), video_grid_thw=torch.tensor([[2, 4, 4]]),
                  second_per_grid_ts=torch.tensor([0.5]))
    from megatron_vlm_packing.rope.index import token_types

    if name == "mm_token_type_ids":
        kwargs[name] = token_types(ids, cfg)
    if name == "audio_seqlens":
        kwargs[name] = torch.tensor([100])
    value = kwargs[name]
    kwargs[name] = value.to("meta") if kind == "meta" else value.to_sparse() if kind == "sparse" \
        else torch.nested.nested_tensor(list(value) if value.dim() > 1 else [value])
    message = {"meta": "is a meta tensor: it holds no values", "sparse": "has layout torch.sparse_coo",
               "nested": "is a nested tensor"}[kind]
    with pytest.raises(ValueError, match=rf"^{name} {message}"):
        get_rope_index(config=cfg, **kwargs)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_omni"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32])
def test_unsigned_grids_give_the_positions_of_int64_grids(family, dtype):
    """uint16 / uint32 grids were a NotImplementedError ("lt_cpu" not implemented for 'UInt32') in the grid check;
    they read as int64, like the other integer fields."""
    cfg = _omni()[2] if family == "qwen3_omni" else MRopeConfig.from_hf_config(hf_config(family))
    ids = torch.tensor([[5, START] + [IMAGE] * 4 + [END, 7, START] + [VIDEO] * 2 + [END, 8]])
    if family == "qwen3_vl":  # one block per frame: the video's two frames, timestamp text between
        ids = torch.tensor([[5, START] + [IMAGE] * 4 + [END, 7, START, VIDEO, END, 9, START, VIDEO, END, 8]])
    grids = dict(image_grid_thw=torch.tensor([[1, 4, 4]]), video_grid_thw=torch.tensor([[2, 2, 2]]))
    seconds = {"second_per_grid_ts": torch.tensor([0.5])} if family in SECONDS_FAMILIES else {}  # else refused
    expected = get_rope_index(ids, cfg, **seconds, **grids).position_ids
    unsigned = {k: v.to(dtype) for k, v in grids.items()}
    assert torch.equal(get_rope_index(ids, cfg, **seconds, **unsigned).position_ids, expected)
    batch = {"input_ids": ids, "labels": ids, **seconds, "pixel_values": torch.zeros(16, 2),
             "pixel_values_videos": torch.zeros(8, 2)}
    packed = pack_batch({**batch, **unsigned}, mrope=cfg, label_style="hf")
    assert torch.equal(packed.position_ids, expected)


def test_uint64_grids_are_refused():
    cfg = MRopeConfig.from_hf_config(hf_config("qwen2_vl"))
    with pytest.raises(ValueError, match=r"image_grid_thw has dtype torch.uint64"):
        get_rope_index(_image_row(4), cfg, image_grid_thw=torch.tensor([[1, 4, 4]]).to(torch.uint64))


@pytest.mark.parametrize("value", [2, -1, 0.5])
def test_omni_text_only_rows_with_odd_mask_values_equal_the_hf_thinker(value):
    """Without grids the thinker numbers tokens by the cumulative sum of the mask as given (and writes 1 where it
    is 0); the index summed a bool mask instead."""
    _, reference, cfg = _omni()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, value, 1, 1, 1], [1, 1, 1, value, 0, 0]])
    expected, expected_deltas = reference(ids, attention_mask=mask)
    ours = get_rope_index(ids, cfg, attention_mask=mask)
    assert torch.equal(ours.position_ids, expected)
    assert torch.equal(ours.deltas.reshape(-1), expected_deltas.reshape(-1).to(ours.deltas.dtype))


def _omni_video_rows(hf, cfg, *, with_audio: bool):
    """[1, L] ids holding one video of grid [1, 4, 4] (4 tokens), with its audio (raw length 100) interleaved or
    not, and the index's keywords for it."""
    if with_audio:
        n_audio = int(audio_output_length(torch.tensor(100), 50))
        body = [START, cfg.audio_start_token_id] + [cfg.audio_token_id] * n_audio + [VIDEO] * 4 \
            + [hf.audio_end_token_id, END]
    else:
        body = [START] + [VIDEO] * 4 + [END]
    kwargs = dict(video_grid_thw=torch.tensor([[1, 4, 4]]), second_per_grid_ts=torch.tensor([0.5]))
    if with_audio:
        kwargs["audio_seqlens"] = torch.tensor([100])
    return torch.tensor([[5, *body, 7]]), kwargs


@pytest.mark.parametrize("with_audio", [True, False])
def test_omni_use_audio_in_video_contradicting_the_tokens_is_refused(with_audio):
    """The index tells an audio-in-video block by its tokens; the thinker follows the flag, and gives other
    positions when the flag says otherwise (an audio-in-video block under use_audio_in_video=False is read as
    text, then an audio block). A flag that contradicts the tokens is a ValueError; no flag: the tokens decide."""
    hf, reference, cfg = _omni()
    ids, kwargs = _omni_video_rows(hf, cfg, with_audio=with_audio)
    expected = reference(ids, attention_mask=torch.ones_like(ids), use_audio_in_video=with_audio,
                         second_per_grids=kwargs["second_per_grid_ts"],
                         **{k: v for k, v in kwargs.items() if k != "second_per_grid_ts"})[0]
    assert torch.equal(get_rope_index(ids, cfg, **kwargs).position_ids, expected)
    assert torch.equal(get_rope_index(ids, cfg, use_audio_in_video=with_audio, **kwargs).position_ids, expected)
    message = (r"use_audio_in_video=False but the video block at input_ids row 0 position 1 has its audio "
               r"interleaved") if with_audio else \
        r"use_audio_in_video=True but the video block at input_ids row 0 position 1 has no audio interleaved"
    with pytest.raises(ValueError, match=message):
        get_rope_index(ids, cfg, use_audio_in_video=not with_audio, **kwargs)
    batch = {"input_ids": ids, "labels": ids, "use_audio_in_video": not with_audio, **kwargs}
    with pytest.raises(ValueError, match=message):
        pack_batch(batch, mrope=cfg, label_style="hf")
    assert torch.equal(pack_batch({**batch, "use_audio_in_video": with_audio}, mrope=cfg,
                                  label_style="hf").position_ids, expected)


@pytest.mark.parametrize("flag", ["no", 1, torch.tensor([True, False])])
def test_omni_use_audio_in_video_that_is_not_a_bool_is_refused(flag):
    hf, _, cfg = _omni()
    ids, kwargs = _omni_video_rows(hf, cfg, with_audio=True)
    with pytest.raises(ValueError, match=r"use_audio_in_video must be True, False or None"):
        get_rope_index(ids, cfg, use_audio_in_video=flag, **kwargs)


def test_check_grid_reads_an_unsigned_grid_as_int64():
    from megatron_vlm_packing.rope.index_checks import check_grid

    with pytest.raises(ValueError, match=r"image_grid_thw row 0 is \[1, 3, 4\]"):
        check_grid(torch.tensor([[1, 3, 4]], dtype=torch.uint32), "image_grid_thw", 2)
    assert check_grid(torch.tensor([[1, 2, 4]], dtype=torch.uint32), "image_grid_thw", 2).dtype == torch.long


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_omni"])
@pytest.mark.parametrize("name", ["input_ids", "attention_mask", "mm_token_type_ids"])
def test_get_rope_index_reads_uint32_ids_masks_and_types_as_int64(family, name):
    """uint16 / uint32 inputs of get_rope_index were a NotImplementedError ('index_copy_cpu' not implemented for
    'UInt32') or a RuntimeError (promotion of UInt32 and Long in the index's one read); pack_batch widens them."""
    if family == "qwen3_omni" and name == "mm_token_type_ids":
        pytest.skip("not read by this family")
    cfg = _omni()[2] if family == "qwen3_omni" else MRopeConfig.from_hf_config(hf_config(family))
    ids = torch.tensor([[5, START] + [IMAGE] * 4 + [END, 7], [5, START] + [IMAGE] * 4 + [END, 0]])
    from megatron_vlm_packing.rope.index import token_types

    kwargs = dict(input_ids=ids, attention_mask=torch.tensor([[1] * 8, [1] * 7 + [0]]),
                  image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]))
    if name == "mm_token_type_ids":
        kwargs[name] = token_types(ids, cfg)
    expected = get_rope_index(config=cfg, **kwargs)
    kwargs[name] = kwargs[name].to(torch.uint32)
    ours = get_rope_index(config=cfg, **kwargs)
    assert torch.equal(ours.position_ids, expected.position_ids) and torch.equal(ours.deltas, expected.deltas)
