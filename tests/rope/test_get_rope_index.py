import pytest
import torch

from megatron_vlm_packing.rope import MRopeConfig, get_rope_index, token_types
from tests.rope.conftest import (IMAGE, hf_config, hf_get_rope_index, hf_reads_fractional_seconds, random_rows,
                                 seconds_as_hf_reads)

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_config(family):
    cfg = MRopeConfig.from_hf_config(hf_config(family))
    assert cfg.family == family and cfg.spatial_merge_size == 2
    assert cfg.image_token_id == 151655 and cfg.video_token_id == 151656
    assert cfg.mrope_section == (2, 1, 1)
    assert cfg.mrope_interleaved == (family == "qwen3_vl")
    assert cfg.tokens_per_second == (2.0 if family == "qwen2_5_vl" else 1.0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(6))
def test_identical_to_the_hf_model(family, seed):
    hf = hf_config(family)
    cfg = MRopeConfig.from_hf_config(hf)
    ids, mask, images, videos, seconds = random_rows(family, 4, seed)
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = seconds_as_hf_reads(seconds)
    ours = get_rope_index(ids, cfg, **kwargs)
    ref_pos, ref_delta = hf_get_rope_index(family, hf)(ids, mm_token_type_ids=token_types(ids, cfg), **kwargs)
    assert torch.equal(ours.position_ids, ref_pos)
    assert torch.equal(ours.deltas, ref_delta.reshape(ours.deltas.shape))


def test_each_row_alone_equals_the_batch():
    cfg = MRopeConfig(family="qwen2_5_vl", tokens_per_second=2.0)
    ids, mask, images, videos, seconds = random_rows("qwen2_5_vl", 5, 11)
    full = get_rope_index(ids, cfg, image_grid_thw=images, video_grid_thw=videos, attention_mask=mask,
                          second_per_grid_ts=seconds).position_ids
    img_i = vid_i = 0
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        row_ids = ids[row:row + 1, :n]
        ni = int(((row_ids == IMAGE) & torch.roll(row_ids != IMAGE, 1, 1)).sum())
        nv = int(((row_ids == 151656) & torch.roll(row_ids != 151656, 1, 1)).sum())
        alone = get_rope_index(row_ids, cfg, image_grid_thw=images[img_i:img_i + ni] if ni else None,
                               video_grid_thw=videos[vid_i:vid_i + nv] if nv else None,
                               second_per_grid_ts=seconds[vid_i:vid_i + nv] if nv else None).position_ids
        assert torch.equal(alone[:, 0], full[:, row, :n])
        img_i, vid_i = img_i + ni, vid_i + nv


def test_max_position_text_offset_differs_only_after_long_videos():
    cfg_new = MRopeConfig(family="qwen2_5_vl", tokens_per_second=4.0)
    cfg_old = MRopeConfig(family="qwen2_5_vl", tokens_per_second=4.0, text_offset="max_position")
    ids = torch.tensor([[5, 151652] + [151656] * 8 + [151653, 7]])  # video t=2, h=w=4 -> 2*2*2 tokens
    video = torch.tensor([[2, 4, 4]])
    new = get_rope_index(ids, cfg_new, video_grid_thw=video, second_per_grid_ts=torch.tensor([1.0])).position_ids
    old = get_rope_index(ids, cfg_old, video_grid_thw=video, second_per_grid_ts=torch.tensor([1.0])).position_ids
    assert new[0, 0, 2:10].tolist() == [2, 2, 2, 2, 6, 6, 6, 6]  # t steps by tokens_per_second * seconds
    assert new[:, 0, 10].tolist() == [4, 4, 4]  # transformers 5: 2 + max(h, w) = 4
    assert old[:, 0, 10].tolist() == [7, 7, 7]  # transformers 4.57: block max (6) + 1


@pytest.mark.parametrize(
    "ids, kwargs, expected",
    [
        ([[1, IMAGE, IMAGE, IMAGE, IMAGE, 2]], dict(), r"1 image placeholder blocks in input_ids but 0 rows in image_grid_thw"),
        ([[1, IMAGE, IMAGE, 2]], dict(image_grid_thw=torch.tensor([[1, 4, 4]])), r"has 2 placeholder tokens but its grid \[1, 4, 4\] with merge 2 needs 4"),
        ([[1, 2]], dict(image_grid_thw=torch.tensor([[1, 4, 4]])), r"0 image placeholder blocks in input_ids but 1 rows"),
    ],
)
def test_count_mismatches_raise_with_both_numbers(ids, kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        get_rope_index(torch.tensor(ids), MRopeConfig(family="qwen2_vl"), **kwargs)


def _one_video_per_row(fps_values, frames: int = 30):
    """Rows `text, <vision_start>, frames x (1 merged token), <vision_end>, text`, one video each."""
    ids = torch.tensor([[5, 151652] + [151656] * frames + [151653, 7]] * len(fps_values))
    return ids, torch.tensor([[frames, 2, 2]] * len(fps_values))


@pytest.mark.parametrize("tokens_per_second", [2, 7, 25])
@pytest.mark.parametrize("kind", ["float32", "float64", "list"])
def test_fractional_seconds_truncate_like_the_hf_model(tokens_per_second, kind):
    """t = floor(k * tokens_per_second * seconds) in transformers' own dtype: float64 seconds and Python
    floats round differently from float32, which moves floor() for some fps (e.g. 25 t/s at fps 0.375)."""
    hf = hf_config("qwen2_5_vl")
    hf.vision_config.tokens_per_second = tokens_per_second
    cfg = MRopeConfig.from_hf_config(hf)
    fps = [x / 8 for x in range(1, 161)]
    seconds = [2 / f for f in fps]
    if kind != "list":
        seconds = torch.tensor(seconds, dtype=getattr(torch, kind))
    seconds = seconds_as_hf_reads(seconds)  # whole seconds only where this transformers truncates them
    ids, videos = _one_video_per_row(fps)
    ours = get_rope_index(ids, cfg, video_grid_thw=videos, second_per_grid_ts=seconds)
    ref_pos, ref_delta = hf_get_rope_index("qwen2_5_vl", hf)(ids, mm_token_type_ids=token_types(ids, cfg),
                                                             video_grid_thw=videos, second_per_grid_ts=seconds)
    assert torch.equal(ours.position_ids, ref_pos)
    assert torch.equal(ours.deltas, ref_delta.reshape(ours.deltas.shape))


@pytest.mark.skipif(hf_reads_fractional_seconds(), reason="this transformers reads fractional seconds: the parity "
                                                          "tests above compare them")
def test_truncating_transformers_differs_only_by_the_truncation():
    """Under a transformers whose Qwen2.5-VL truncates `second_per_grid_ts` (Megatron-Bridge 0.6.2's range, whose
    Qwen25VLModel computes its positions with it), ours keeps the fraction, as the model's formula and later
    transformers do: given the truncated seconds ours equals that transformers on every row, given the real ones it
    differs exactly on videos of fractional seconds. 0.5 s per grid at 2 tokens per second steps t by 1 for us, 0 there."""
    hf = hf_config("qwen2_5_vl")
    cfg = MRopeConfig.from_hf_config(hf)
    ids, mask, images, videos, seconds = random_rows("qwen2_5_vl", 4, 3)
    assert not torch.equal(seconds, seconds.trunc())  # fractional seconds among these videos
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
    reference = hf_get_rope_index("qwen2_5_vl", hf)(ids, mm_token_type_ids=token_types(ids, cfg),
                                                    second_per_grid_ts=seconds, **kwargs)[0]
    assert torch.equal(get_rope_index(ids, cfg, second_per_grid_ts=seconds.trunc(), **kwargs).position_ids, reference)
    assert not torch.equal(get_rope_index(ids, cfg, second_per_grid_ts=seconds, **kwargs).position_ids, reference)
    ids, videos = _one_video_per_row([4.0])  # 2 / 4 fps = 0.5 s per grid
    half = dict(video_grid_thw=videos, second_per_grid_ts=torch.tensor([0.5]))
    ours = get_rope_index(ids, cfg, **half).position_ids[0, 0]
    theirs = hf_get_rope_index("qwen2_5_vl", hf)(ids, mm_token_type_ids=token_types(ids, cfg), **half)[0][0, 0]
    video = ids[0] == 151656
    assert len(set(theirs[video].tolist())) == 1 and len(set(ours[video].tolist())) == int(videos[0, 0])


def _move_real_tokens(ids, mask, pattern: str, seed: int):
    """Same rows with the real tokens left-padded, or scattered over the row with masked holes between."""
    g = torch.Generator().manual_seed(seed)
    new_ids, new_mask = torch.full_like(ids, 3), torch.zeros_like(mask)
    width = ids.shape[1]
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        slots = torch.arange(width - n, width) if pattern == "left" else \
            torch.sort(torch.randperm(width, generator=g)[:n]).values
        new_ids[row, slots], new_mask[row, slots] = ids[row, :n], 1
    return new_ids, new_mask


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pattern", ["left", "holes"])
def test_any_attention_mask_pattern_matches_the_hf_model(family, pattern):
    """transformers keeps the tokens where the mask is 1, in order, and gives masked slots 0: so do we."""
    hf = hf_config(family)
    cfg = MRopeConfig.from_hf_config(hf)
    for seed in range(3):
        ids, mask, images, videos, seconds = random_rows(family, 4, seed)
        ids, mask = _move_real_tokens(ids, mask, pattern, seed)
        kwargs = dict(image_grid_thw=images, video_grid_thw=videos, attention_mask=mask)
        if family == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = seconds_as_hf_reads(seconds)
        ours = get_rope_index(ids, cfg, **kwargs)
        ref_pos, ref_delta = hf_get_rope_index(family, hf)(ids, mm_token_type_ids=token_types(ids, cfg), **kwargs)
        assert torch.equal(ours.position_ids, ref_pos)
        assert torch.equal(ours.deltas, ref_delta.reshape(ours.deltas.shape))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(3))
def test_without_attention_mask_every_token_is_real(family, seed):
    hf = hf_config(family)
    cfg = MRopeConfig.from_hf_config(hf)
    ids, mask, images, videos, seconds = random_rows(family, 1, seed, pad=False)
    assert bool(mask.all())
    kwargs = dict(image_grid_thw=images, video_grid_thw=videos)
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = seconds_as_hf_reads(seconds)
    ours = get_rope_index(ids, cfg, **kwargs)
    ref_pos, ref_delta = hf_get_rope_index(family, hf)(ids, mm_token_type_ids=token_types(ids, cfg), **kwargs)
    assert torch.equal(ours.position_ids, ref_pos)
    assert torch.equal(ours.position_ids, get_rope_index(ids, cfg, attention_mask=mask, **kwargs).position_ids)


def test_second_per_grid_ts_count_must_match_the_videos():
    cfg = MRopeConfig(family="qwen2_5_vl")
    ids, videos = _one_video_per_row([1.0, 2.0])
    with pytest.raises(ValueError, match=r"1 entries in second_per_grid_ts but 2 video blocks"):
        get_rope_index(ids, cfg, video_grid_thw=videos, second_per_grid_ts=torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"1 video placeholder blocks in input_ids but 2 rows in video_grid_thw"):
        get_rope_index(ids[:1], cfg, video_grid_thw=videos)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("host_reads", [False, True])
def test_pre_packed_documents_with_mm_token_type_ids_equal_the_hf_model_per_document(family, host_reads):
    """`document_lengths` with the `mm_token_type_ids` transformers 5 processors return: each document's
    positions are the HF model's for that document alone (the types were not split per document: an
    IndexError)."""
    from megatron_vlm_packing import pack_batch

    hf = hf_config(family)
    cfg = MRopeConfig.from_hf_config(hf)
    docs, mask, images, videos, seconds = random_rows(family, 5, 3, pad=False)
    seconds = seconds_as_hf_reads(seconds)
    lengths = mask.sum(1).tolist()
    docs = [docs[i, :n] for i, n in enumerate(lengths)]
    ids = torch.cat(docs)[None]  # one row holding the five documents
    batch = dict(input_ids=ids, labels=ids, mm_token_type_ids=token_types(ids, cfg),
                 document_lengths=torch.tensor([lengths]), image_grid_thw=images, video_grid_thw=videos)
    if family == "qwen2_5_vl":
        batch["second_per_grid_ts"] = seconds
    packed = pack_batch(batch, label_style="hf", mrope=cfg, host_reads=host_reads)
    cu = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    image_at = video_at = 0
    for doc, start in zip(docs, cu):
        doc = doc[None]
        blocks = lambda token: int(((doc == token) & (torch.roll(doc, 1, 1) != token)).sum())  # noqa: E731
        n_images, n_videos = blocks(IMAGE), blocks(151656)
        if family == "qwen3_vl":  # one block per frame: count whole videos by their frames
            frames = torch.cumsum(videos[video_at:, 0], 0).tolist() if n_videos else []
            n_videos = frames.index(n_videos) + 1 if n_videos else 0
        kwargs = dict(image_grid_thw=images[image_at:image_at + n_images] if n_images else None,
                      video_grid_thw=videos[video_at:video_at + n_videos] if n_videos else None)
        if family == "qwen2_5_vl" and n_videos:
            kwargs["second_per_grid_ts"] = seconds[video_at:video_at + n_videos]
        expected = hf_get_rope_index(family, hf)(doc, mm_token_type_ids=token_types(doc, cfg), **kwargs)[0]
        assert torch.equal(packed.position_ids[:, 0, start:start + doc.shape[1]], expected[:, 0])
        image_at, video_at = image_at + n_images, video_at + n_videos
    assert image_at == (0 if images is None else len(images)) and video_at == (0 if videos is None else len(videos))
