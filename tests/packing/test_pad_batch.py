import pytest
import torch

from megatron_vlm_packing import pad_batch
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index


def hf_batch():
    ids = torch.tensor([[11, 12, 13, 0, 0], [21, 22, 23, 24, 25]])
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    return {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep}


def test_dense_rows_are_aligned_and_labels_shift_inside_each_row():
    mb = pad_batch(hf_batch(), cp_size=2, label_style="hf", pad_token_id=7)  # multiple 4: L = 8
    assert mb.packed_seq_params is None and mb.rope_cu_seqlens is None and not mb.is_packed
    assert mb.input_ids.tolist() == [[11, 12, 13, 7, 7, 7, 7, 7], [21, 22, 23, 24, 25, 7, 7, 7]]
    assert mb.labels.tolist() == [[12, 13, -100, -100, -100, -100, -100, -100], [22, 23, 24, 25] + [-100] * 4]
    assert mb.loss_mask.tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert mb.padding_mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]]
    assert mb.position_ids.tolist() == [list(range(8))] * 2
    assert (mb.stats.real_tokens, mb.stats.physical_tokens, mb.stats.row_tokens) == (8, 16, 10)


def test_float_loss_weights_are_kept():
    batch = hf_batch()
    batch["loss_mask"] = torch.tensor([[0.5, 2.0, 1.0, 0.0, 0.0], [1.0, 0.25, 1.0, 1.0, 1.0]])
    mb = pad_batch(batch, label_style="hf")
    assert mb.loss_mask.tolist() == [[0.5, 2.0, 0, 0, 0], [1.0, 0.25, 1.0, 1.0, 0]]


def test_seq_length_shorter_than_real_tokens_is_refused_unless_truncate():
    with pytest.raises(ValueError, match=r"seq_length=4 is shorter than the longest row's 5 real tokens"):
        pad_batch(hf_batch(), seq_length=4, label_style="hf")
    mb = pad_batch(hf_batch(), seq_length=4, truncate=True, label_style="hf")
    assert mb.input_ids.tolist() == [[11, 12, 13, 0], [21, 22, 23, 24]]
    assert mb.labels.tolist() == [[12, 13, -100, -100], [22, 23, 24, 25]]
    assert mb.stats.real_tokens == 7


def test_dense_checks_what_pack_checks():
    batch = hf_batch()
    batch["attention_mask"] = torch.tensor([[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"left padding: first real token at position 1"):
        pad_batch(batch, label_style="hf")
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[0, 5\].*\(1, 6\)"):
        pad_batch({**hf_batch(), "attention_mask": None, "seq_lens": [3, 6]}, label_style="hf")


def test_4d_mask_gives_the_same_rows():
    batch = hf_batch()
    keep = batch.pop("attention_mask").bool()
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    allowed = causal[None] & keep[:, None, :] & keep[:, :, None]
    mb = pad_batch({**batch, "attention_mask": ~allowed[:, None]}, label_style="hf")
    assert mb.padding_mask.int().tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]


def test_dense_mrope_positions_are_each_rows_own():
    cfg = MRopeConfig(family="qwen2_vl", image_token_id=9, video_token_id=8)
    ids = torch.tensor([[1, 9, 9, 9, 9, 2, 0], [3, 4, 9, 9, 9, 9, 5]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    grids = torch.tensor([[1, 4, 4], [1, 2, 8]])
    mb = pad_batch({"input_ids": ids, "labels": ids, "attention_mask": keep, "image_grid_thw": grids,
                    "pixel_values": torch.zeros(32, 3)}, mrope=cfg, cp_size=2, label_style="hf")
    assert mb.position_ids.shape == (3, 2, 8) and mb.vision.images_per_sample == (1, 1)
    first = get_rope_index(ids[:1, :6], cfg, image_grid_thw=grids[:1]).position_ids[:, 0]
    second = get_rope_index(ids[1:], cfg, image_grid_thw=grids[1:]).position_ids[:, 0]
    assert torch.equal(mb.position_ids[:, 0, :6], first) and torch.equal(mb.position_ids[:, 1, :7], second)
    # pad slots continue after the row's largest position on every axis
    assert mb.position_ids[:, 0, 6:].tolist() == [[first.max() + 1, first.max() + 2]] * 3
    assert mb.position_ids[:, 1, 7:].tolist() == [[second.max() + 1]] * 3
