"""LLaVA: boundaries after image expansion (bug class 2), the slot before each image (bug class 13),
the expanded-space plan for CP / the shard factor / PP. Pure functions, no process launch; the
model-level parity is tests/llava/test_llava_parity.py."""

import random
from dataclasses import replace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing.models.llava import LlavaSpace, llava_pack_plan
from megatron_vlm_packing.models.llava_expansion import (
    image_expansion, leaking_documents, llava_expanded_lengths, remap_packed_seq_params,
)
from megatron_vlm_packing.models.llava_pack import pack_llava_batch

IMG = 127


def thd(cu, cu_padded):
    cu, cu_padded = torch.tensor(cu, dtype=torch.int32), torch.tensor(cu_padded, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=4, max_seqlen_kv=4)


def test_remap_moves_both_boundary_sets_into_the_expanded_space():
    ids = torch.tensor([[5, IMG, 6, 0, 7, IMG, IMG, 8]])  # doc 0: slots 0-3 (3 real), doc 1: slots 4-7
    params = thd([0, 3, 7], [0, 4, 8])
    out = remap_packed_seq_params(params, ids, torch.tensor([2, 1, 3]), img_seq_len=4, image_token_index=IMG)
    # doc 0 grows by 2*4-1 = 7; doc 1 by (1*4-1) + (3*4-1) = 14
    assert out.cu_seqlens_q.tolist() == [0, 10, 28] and out.cu_seqlens_q_padded.tolist() == [0, 11, 29]
    assert out.cu_seqlens_kv.tolist() == out.cu_seqlens_q.tolist() and out.max_seqlen_q == 18
    assert out.cu_seqlens_q.dtype == torch.int32
    piped = remap_packed_seq_params(params, ids, torch.tensor([2, 1, 3]), img_seq_len=4, image_token_index=IMG,
                                    pad_to=40)
    assert piped.cu_seqlens_q_padded.tolist() == [0, 11, 40]  # LLaVA pads PP rows: the last doc takes it
    assert piped.cu_seqlens_q.tolist() == [0, 10, 28] and piped.max_seqlen_q == 29


def test_remap_refuses_what_llava_would_misalign_or_truncate():
    ids = torch.tensor([[5, IMG, 6, 0, 7, IMG, IMG, 8]])
    params, tiles = thd([0, 3, 7], [0, 4, 8]), torch.tensor([2, 1, 3])
    kw = dict(img_seq_len=4, image_token_index=IMG)
    with pytest.raises(ValueError, match=r"expanded documents \[0, 1\] have physical lengths \[11, 18\] that do not divide by 4"):
        remap_packed_seq_params(params, ids, tiles, segment_multiple=4, **kw)
    with pytest.raises(ValueError, match="29 tokens, not a multiple of LLaVA's shard factor 2"):
        remap_packed_seq_params(params, ids, tiles, total_multiple=2, **kw)
    with pytest.raises(ValueError, match="expands to 29 tokens, more than language_max_sequence_length=28"):
        remap_packed_seq_params(params, ids, tiles, max_length=28, **kw)
    with pytest.raises(ValueError, match="expands to 29 tokens but LLaVA pads rows to 20"):
        remap_packed_seq_params(params, ids, tiles, pad_to=20, **kw)
    with pytest.raises(ValueError, match="3 image tokens in input_ids but 2 entries in num_image_tiles"):
        remap_packed_seq_params(params, ids, tiles[:2], **kw)


def test_leaking_documents_is_llavas_rule_for_the_slot_before_an_image():
    # doc 0 [5, 6] no pad | doc 1 [IMG, 7] opens with an image right after doc 0's last real token
    ids = torch.tensor([[5, 6, IMG, 7, 0, IMG, 8, 9]])
    params = thd([0, 2, 4, 7], [0, 2, 5, 8])  # doc 1 has a pad slot, so doc 2's image is harmless
    assert leaking_documents(ids, params.cu_seqlens_q, params.cu_seqlens_q_padded, None, image_token_index=IMG) == [1]
    weights = torch.ones(1, 8)
    weights[0, 1] = 0  # doc 0's last token carries no loss (Hugging Face labels end a sample with -100)
    assert leaking_documents(ids, params.cu_seqlens_q, params.cu_seqlens_q_padded, weights, image_token_index=IMG) == []
    assert leaking_documents(ids[:, :2], params.cu_seqlens_q[:2], params.cu_seqlens_q_padded[:2], None,
                             image_token_index=IMG) == []


def test_plan_example_and_refusals():
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG, segment_multiple=4, total_multiple=4)
    plan = llava_pack_plan([3, 2], row_capacity=4, row_expansion=[0, 3], opens_with_image=[False, True], space=space)
    assert plan.physical_lengths == (4, 5) and plan.real_lengths == (3, 2)
    piped = llava_pack_plan([3, 2], row_capacity=4, row_expansion=[0, 3], opens_with_image=[False, True],
                            space=LlavaSpace(img_seq_len=4, image_token_index=IMG, pipeline_length=20))
    assert piped.physical_lengths == (4, 13)  # 4 + (13 + 3) = 20 expanded: LLaVA's fixed PP length
    with pytest.raises(ValueError, match="expands to 9 tokens, more than language_max_sequence_length=8"):
        llava_pack_plan([3, 2], row_capacity=4, row_expansion=[0, 3], opens_with_image=[False, True],
                        space=LlavaSpace(img_seq_len=4, image_token_index=IMG, max_length=8))
    with pytest.raises(ValueError, match="no real tokens"):
        llava_pack_plan([0], row_capacity=4, row_expansion=[0], opens_with_image=[False], space=space)


@pytest.mark.parametrize("seed", range(20))
def test_plan_aligns_every_expanded_document_and_pads_before_image_openers(seed):
    rng = random.Random(seed)
    cp, tp, sp = rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.random() < 0.5
    total = tp * cp * 2 if cp > 1 and sp else 2 * cp if cp > 1 else tp if sp else 1
    space = LlavaSpace(img_seq_len=rng.choice([1, 4, 9]), image_token_index=IMG,
                       segment_multiple=2 * cp if cp > 1 else 1, total_multiple=total)
    rows = [rng.randint(0, 12) for _ in range(rng.randint(1, 6))]
    rows[rng.randrange(len(rows))] = max(1, rows[0])
    expansion = [rng.randint(0, 30) if n else 0 for n in rows]
    opens = [bool(n) and rng.random() < 0.5 for n in rows]
    plan = llava_pack_plan(rows, row_capacity=12, row_expansion=expansion, opens_with_image=opens, space=space)
    docs = [b for b, n in enumerate(rows) if n]
    expanded = [p + expansion[b] for p, b in zip(plan.physical_lengths, docs)]
    assert all(e % space.segment_multiple == 0 for e in expanded) and sum(expanded) % total == 0
    for k in range(len(docs) - 1):
        pads = plan.physical_lengths[k] - plan.real_lengths[k]
        assert pads < space.segment_multiple + 1  # the fewest pads
        if opens[docs[k + 1]]:
            assert pads >= 1  # the slot LLaVA zeroes is a pad


def _tiled_batch():
    """Three rows: text only, an image first (1 tile), an image second (2 tiles); 4 embeddings a tile."""
    ids = torch.tensor([[5, 6, 7, 0], [IMG, 8, 9, 0], [10, IMG, 0, 0]])
    keep = ids != 0
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG, segment_multiple=4, total_multiple=4)
    batch = {"input_ids": ids, "labels": torch.where(keep, ids + 1, -100), "attention_mask": keep.long(),
             "images": torch.zeros(3, 3, 2, 2), "num_image_tiles": torch.tensor([1, 2])}
    return batch, space


def test_pack_llava_batch_lays_out_both_label_styles_and_counts_tiles():
    batch, space = _tiled_batch()
    ids = batch["input_ids"]
    keep = ids != 0
    mb = pack_llava_batch(batch, space)
    # doc 0: 3 real + 1 pad (doc 1 opens with an image); doc 1: 3 + 3 = 6 expanded -> 8: 2 pads;
    # doc 2: 2 + 7 = 9 expanded -> 12: 3 pads
    assert mb.plan.physical_lengths == (4, 5, 5)
    assert mb.input_ids.tolist() == [[5, 6, 7, 0, IMG, 8, 9, 0, 0, 10, IMG, 0, 0, 0]]
    assert mb.labels.tolist() == [[6, 7, 8, -100, 128, 9, 10, -100, -100, 11, 128, -100, -100, -100]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]
    assert mb.padding_mask.int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1]]
    assert mb.vision.num_image_tiles.tolist() == [1, 2] and mb.vision.images_per_sample == (0, 1, 1)
    assert (mb.stats.real_tokens, mb.stats.physical_tokens) == (3 + 6 + 9, 4 + 8 + 12)
    hf = pack_llava_batch(dict(batch, labels=torch.where(keep & (ids != IMG), ids, -100)), space, label_style="hf")
    assert hf.labels.tolist() == [[6, 7, -100, -100, 8, 9, -100, -100, -100, -100, -100, -100, -100, -100]]
    with pytest.raises(ValueError, match="num_image_tiles sums to 3 tiles but the images hold 2"):
        pack_llava_batch(dict(batch, images=torch.zeros(2, 3, 2, 2)), space)
    with pytest.raises(ValueError, match="2 image tokens in input_ids but 3 entries in num_image_tiles"):
        pack_llava_batch(dict(batch, num_image_tiles=torch.tensor([1, 1, 1])), space)
    stray = ids.clone()
    stray[2, 3] = IMG  # row 2 has 2 real tokens: slot 3 is padding
    with pytest.raises(ValueError, match="1 image tokens lie in the padding"):
        pack_llava_batch(dict(batch, input_ids=stray), space)
    with pytest.raises(ValueError, match="pad_token_id=127 is LLaVA's image token"):
        pack_llava_batch(batch, space, pad_token_id=IMG)


def test_expanded_lengths_check_counts():
    ids = torch.tensor([[5, IMG, 6, 0], [IMG, IMG, 7, 8]])
    assert llava_expanded_lengths(ids, [3, 4], torch.tensor([3, 1, 2]), img_seq_len=4, image_token_index=IMG) == [14, 14]
    with pytest.raises(ValueError, match="3 image tokens in input_ids but 2 entries in num_image_tiles"):
        image_expansion(ids, torch.tensor([1, 1]), img_seq_len=4, image_token_index=IMG)


def _adapter(space):
    from megatron_vlm_packing.models.llava import LLaVAAdapter

    adapter = LLaVAAdapter.__new__(LLaVAAdapter)  # the checks read only the space (no model needed)
    adapter.model_name, adapter.space = "LLaVAModel", space
    return adapter


def test_adapter_refuses_leaking_packs_and_keeps_everything_full_under_cp():
    from megatron_vlm_packing.packing import pack_batch
    from megatron_vlm_packing.packing.localize import localize
    from megatron_vlm_packing.packing.micro_batch import VisionInputs
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.train.build import StepOptions

    ids = torch.tensor([[5, 6, 7], [IMG, 8, 9]])
    batch = {"input_ids": ids, "labels": ids + 1, "images": torch.zeros(1, 3, 2, 2)}
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG, segment_multiple=4, total_multiple=4)
    adapter = _adapter(space)
    plain = replace(pack_batch({"input_ids": ids, "labels": ids + 1}, label_style="megatron"),
                    vision=VisionInputs(pixel_values=torch.zeros(1, 3, 2, 2), images_per_sample=(0, 1)))
    with pytest.raises(ValueError, match=r"documents \[1\] open with an image right after"):
        adapter.check(plain)
    mb = adapter.build_micro_batch(batch, ParallelLayout(cp_size=2), StepOptions(label_style="megatron"))
    adapter.check(mb)
    assert mb.plan.physical_lengths == (4, 5)  # one pad before the image-opening document; 8 expanded
    local = localize(mb, ParallelLayout(cp_size=2, cp_rank=1), adapter.needs)
    assert local.cp_index is None and local.labels is mb.labels and local.loss_mask is mb.loss_mask
    assert {"input_ids", "position_ids", "labels", "loss_mask"} <= local.full_fields
    with pytest.raises(ValueError, match="num_image_tiles sums to 1 tiles but the images hold 2"):
        adapter.check(replace(mb, vision=VisionInputs(pixel_values=torch.zeros(2, 3, 2, 2), images_per_sample=(0, 1))))
    dense = adapter.build_micro_batch(batch, ParallelLayout(), StepOptions(pack=False, label_style="megatron"))
    assert dense.packed_seq_params is None  # LLaVA's own batched rows, grown so 5 + 3 expands to 8 = 2 * 4
    assert dense.input_ids.tolist() == [[5, 6, 7, 0, 0], [IMG, 8, 9, 0, 0]]
    adapter.check(dense)


def test_pack_llava_batch_refuses_bad_tiles_images_and_pad_to():
    # Each was accepted (0 / -1 tiles expanded an image to -1 / -5 embeddings; 1.5 tiles became 1;
    # pad_to other than LLaVA's PP length gave boundaries ending before the sequence) or an internal error.
    batch, space = _tiled_batch()
    ids = batch["input_ids"]
    with pytest.raises(ValueError, match=r"num_image_tiles must be >= 1 per image: images \[0\] have \[0\] tiles"):
        pack_llava_batch(dict(batch, num_image_tiles=torch.tensor([0, 3])), space)
    with pytest.raises(ValueError, match=r"images \[0\] have \[-1\] tiles"):
        pack_llava_batch(dict(batch, num_image_tiles=torch.tensor([-1, 4])), space)
    with pytest.raises(ValueError, match="num_image_tiles must hold integer tile counts, got dtype torch.float32"):
        pack_llava_batch(dict(batch, num_image_tiles=torch.tensor([1.5, 1.5])), space)
    with pytest.raises(ValueError, match=r"images must be one \[tiles, C, H, W\] tensor, got list"):
        pack_llava_batch(dict(batch, images=[torch.zeros(3, 2, 2)] * 3), space)
    with pytest.raises(ValueError, match=r"pixel_values must be one \[tiles, C, H, W\] tensor, got \(3,\)"):
        pack_llava_batch(dict(batch, images=None, pixel_values=torch.zeros(3)), space)
    with pytest.raises(ValueError, match="pad_to must be an int"):
        pack_llava_batch(batch, space, pad_to=40.0)
    piped = LlavaSpace(img_seq_len=4, image_token_index=IMG, pipeline_length=40, max_length=40)
    with pytest.raises(ValueError, match="pad_to=32 but under pipeline parallelism LLaVAModel pads every row to "
                                         "language_max_sequence_length=40"):
        pack_llava_batch(batch, piped, pad_to=32)
    assert pack_llava_batch(batch, piped, pad_to=40).plan.physical_lengths == pack_llava_batch(batch, piped).plan.physical_lengths
    text = {"input_ids": ids[:1], "labels": ids[:1] + 1, "num_image_tiles": []}  # [] is float32 to torch
    assert pack_llava_batch(text, space).plan.tiles == ()
    from megatron_vlm_packing.models.llava_pack import pad_llava_batch
    with pytest.raises(ValueError, match=r"images \[0\] have \[0\] tiles"):
        pad_llava_batch(dict(batch, num_image_tiles=torch.tensor([0, 3])), space)


def test_llavas_default_negative_image_token_packs_like_any_other():
    # LLaVAModel's default image_token_index is -200 (it never embeds it); the id screen refused such ids.
    from megatron.core.models.multimodal.llava_model import DEFAULT_IMAGE_TOKEN_INDEX as NEG

    from megatron_vlm_packing.models.llava_pack import pad_llava_batch

    ids = torch.tensor([[5, 6, 7, 0], [IMG, 8, 9, 0], [10, IMG, 0, 0]])
    keep = ids != 0
    batch = {"input_ids": ids, "labels": torch.where(keep & (ids != IMG), ids, -100), "attention_mask": keep.long(),
             "images": torch.zeros(3, 3, 2, 2), "num_image_tiles": torch.tensor([1, 2])}
    negative = dict(batch, input_ids=torch.where(ids == IMG, NEG, ids))
    for pack in (pack_llava_batch, pad_llava_batch):
        space = LlavaSpace(img_seq_len=4, image_token_index=IMG, segment_multiple=4, total_multiple=4)
        want = pack(batch, space, label_style="hf")
        got = pack(negative, replace(space, image_token_index=NEG), label_style="hf")
        assert torch.equal(got.input_ids, torch.where(want.input_ids == IMG, NEG, want.input_ids))
        assert torch.equal(got.labels, want.labels) and torch.equal(got.loss_mask, want.loss_mask)
        assert got.plan.tiles == want.plan.tiles == (1, 2)
    with pytest.raises(ValueError, match="input_ids row 0 position 1 is -3"):  # other negative ids: still refused
        pack_llava_batch(dict(negative, input_ids=torch.where(ids == 6, -3, negative["input_ids"])),
                         LlavaSpace(img_seq_len=4, image_token_index=NEG), label_style="hf")


def test_more_or_fewer_images_than_placeholders_without_tiles_names_the_tokens():
    ids = torch.tensor([[5, IMG, 7], [IMG, 8, IMG]])
    batch = {"input_ids": ids, "labels": ids + 1}
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG)
    for count in (0, 2, 4):  # no num_image_tiles: LLaVA's one tile per image token
        with pytest.raises(ValueError, match=rf"^3 image tokens in input_ids \(one tile each: no num_image_tiles "
                                             rf"given\) but the images hold {count} tiles$"):
            pack_llava_batch(dict(batch, images=torch.zeros(count, 3, 2, 2)), space)
    assert pack_llava_batch(dict(batch, images=torch.zeros(3, 3, 2, 2)), space).plan.tiles == (1, 1, 1)
