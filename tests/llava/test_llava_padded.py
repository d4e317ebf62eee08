"""LLaVA with `make_forward_step(pack=False)`: LLaVA's own batched rows through the step (what a user
comparing padded with packed runs). Pure checks here; the model-level parity (pack=False through the
step == the batched reference, on one process and under TP=2 + SP) is in the shared launch of
tests/llava/llava_workers.py."""

import pytest
import torch

from megatron_vlm_packing.models.llava import LlavaRows, LlavaSpace
from megatron_vlm_packing.models.llava_pack import pad_llava_batch
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from tests.llava.exact import assert_equals_batched
from tests.llava.llava_workers import launch

IMG = 127


def _batch():
    ids = torch.tensor([[5, 6, 7, 0], [IMG, 8, 9, 0], [10, IMG, 0, 0]])
    keep = ids != 0
    return {"input_ids": ids, "labels": torch.where(keep & (ids != IMG), ids, -100), "attention_mask": keep.long(),
            "images": torch.zeros(3, 3, 2, 2), "num_image_tiles": torch.tensor([1, 2])}


def test_pad_llava_batch_keeps_the_rows_and_reads_once():
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG, max_length=20)
    with count_host_syncs() as syncs:
        mb = pad_llava_batch(_batch(), space, label_style="hf", seq_length=6)
    assert syncs.total == 1, syncs.report()  # lengths, checks and image counts in one read
    assert mb.packed_seq_params is None and mb.input_ids.shape == (3, 6)
    assert mb.input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [IMG, 8, 9, 0, 0, 0], [10, IMG, 0, 0, 0, 0]]
    assert mb.labels.tolist() == [[6, 7, -100, -100, -100, -100], [8, 9, -100, -100, -100, -100],
                                  [-100, -100, -100, -100, -100, -100]]
    assert mb.padding_mask.int().tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    assert mb.plan == LlavaRows(tiles=(1, 2), expanded_lengths=(3, 6, 9))
    assert mb.vision.images_per_sample == (0, 1, 1) and mb.vision.num_image_tiles.tolist() == [1, 2]
    # LLaVA pads every expanded row to 6 + 7 = 13 slots
    assert (mb.stats.real_tokens, mb.stats.physical_tokens) == (18, 39)


def test_pad_llava_batch_refuses_short_rows_and_silent_truncation():
    space = LlavaSpace(img_seq_len=4, image_token_index=IMG, max_length=12)
    with pytest.raises(ValueError, match="seq_length=2 must be an int >= the longest row's 3 real tokens"):
        pad_llava_batch(_batch(), space, label_style="hf", seq_length=2)
    with pytest.raises(ValueError, match="rows expand to 13 tokens, more than language_max_sequence_length=12"):
        pad_llava_batch(_batch(), space, label_style="hf", seq_length=6)
    sp = LlavaSpace(img_seq_len=4, image_token_index=IMG, total_multiple=4)  # e.g. TP=4 + SP
    assert pad_llava_batch(_batch(), sp, label_style="hf").input_ids.shape == (3, 5)  # 5 + 7 = 12 expanded
    with pytest.raises(ValueError, match="seq_length=6 expands to 13 tokens per row, not a multiple of LLaVA's shard"):
        pad_llava_batch(_batch(), sp, label_style="hf", seq_length=6)
    with pytest.raises(ValueError, match="num_image_tiles sums to 3 tiles but the images hold 2"):
        pad_llava_batch(dict(_batch(), images=torch.zeros(2, 3, 2, 2)), space, label_style="hf")


@pytest.mark.parametrize("layout", ["", "TP=2+SP, "])
@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_pack_false_through_the_step_equals_batched(layout, style):
    result = launch()
    r = result[f"{layout}pack=False, {style} labels"]
    assert_equals_batched(r, result["params"])
    assert [rows for rows, _ in r["shapes"]] == [5, 3], r  # LLaVA's own rows (B, S), not one [1, T] pack
