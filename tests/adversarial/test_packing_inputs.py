"""Bad or unusual inputs through `pack_batch` / `pad_batch` / `unpack_rows`: each gives the exact
error (field and numbers) or the exact correct result.

Every case here failed on bd042f6: there the batch was sorted into `extras` / `passthrough` by
shape, float loss weights were flattened to 1.0, labels and ids were not range-checked, `[B, 3, S]`
positions were read as `[3, B, S]`, pre-packed documents were merged, media were not counted per
sample, and `pad_batch` did not exist (the dense path checked nothing).
"""

import numpy as np
import pytest
import torch

from megatron_vlm_packing import packing
from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

IMG, VID, AUD = 9, 8, 7  # placeholder ids used below


def pad_batch(batch, **kwargs):  # looked up at call time: bd042f6 had no pad_batch
    return packing.pad_batch(batch, **kwargs)


def hf_batch(rows=((11, 12, 13), (21, 22)), row_length=4):
    """Right-padded HF-style batch: labels = ids on real tokens, -100 elsewhere."""
    ids = torch.zeros(len(rows), row_length, dtype=torch.long)
    keep = torch.zeros(len(rows), row_length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        keep[b, :len(row)] = 1
    return {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep}


def megatron_batch():
    ids = torch.tensor([[11, 12, 13, 0], [21, 22, 0, 0]])
    labels = torch.tensor([[12, 13, 14, -100], [22, 23, -100, -100]])
    return {"input_ids": ids, "labels": labels, "attention_mask": (ids != 0).long()}


def image_batch(rows, grids, patch_dim=3):
    batch = hf_batch(rows, max(len(r) for r in rows))
    grid = torch.tensor(grids)
    batch.update(pixel_values=torch.zeros(int(grid.prod(1).sum()), patch_dim), image_grid_thw=grid)
    return batch


def with_(batch, **changes):
    return {**batch, **changes}


# ---- errors: (name, call, regex) -----------------------------------------------------------------------------------

def _block_diagonal_4d():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    allowed = causal.clone()
    allowed[2:, :2] = False  # two documents [0, 2) and [2, 4) in one row
    return {"input_ids": torch.tensor([[11, 12, 13, 14]]), "labels": torch.tensor([[11, 12, 13, 14]]),
            "attention_mask": ~allowed[None, None]}


def _full_attention_4d():
    return {"input_ids": torch.tensor([[11, 12, 13]]), "labels": torch.tensor([[11, 12, 13]]),
            "attention_mask": torch.zeros(1, 1, 3, 3, dtype=torch.bool)}


def _float_positions(channel, row, position, value="nan"):
    """[3, 2, 4] fractional mRoPE positions (Qwen3-Omni's kind) with one entry not finite."""
    positions = torch.arange(4.0).expand(3, 2, 4).clone()
    positions[channel, row, position] = float(value)
    return positions


def test_a_position_not_finite_at_a_pad_slot_is_rebuilt_not_refused():
    # Pad slots get positions after their document's largest real one: what the batch held there is unused.
    for host_reads in (False, True):
        packed = pack_batch(with_(hf_batch(), position_ids=_float_positions(0, 1, 3)), label_style="hf",
                            host_reads=host_reads)
        assert torch.isfinite(packed.position_ids).all()


ERRORS = [
    ("batch_is_a_list", lambda: pack_batch([hf_batch()], label_style="hf"),
     r"batch must be a dict of tensors, got list"),
    ("float_input_ids", lambda: pack_batch(with_(hf_batch(), input_ids=hf_batch()["input_ids"].float()), label_style="hf"),
     r"input_ids must hold integer token ids, got dtype torch\.float32"),
    ("empty_input_ids", lambda: pack_batch({"input_ids": torch.zeros(2, 0, dtype=torch.long),
                                            "labels": torch.zeros(2, 0, dtype=torch.long)}),
     r"input_ids is empty: shape \(2, 0\)"),
    ("unknown_per_token_key", lambda: pack_batch(with_(hf_batch(), token_type_ids=torch.zeros(2, 4)), label_style="hf"),
     r"unknown batch key 'token_type_ids'"),
    ("unknown_per_sample_key_shaped_like_rows", lambda: pack_batch(with_(hf_batch(), sample_weight=torch.ones(2, 4, 7)),
                                                                   label_style="hf"),
     r"unknown batch key 'sample_weight'.*extra_keys="),
    ("extra_key_shadows_labels", lambda: pack_batch(hf_batch(), label_style="hf", extra_keys=("labels",)),
     r"extra_keys \['labels'\] are batch keys pack_batch/pad_batch already read"),
    ("extra_key_not_per_token", lambda: pack_batch(with_(hf_batch(), w=torch.ones(2, 3)), label_style="hf",
                                                   extra_keys=("w",)),
     r"extra key 'w' must be a per-token \[B, S, \.\.\.\] tensor with \[B, S\] = \(2, 4\), got \(2, 3\)"),
    ("float_labels", lambda: pack_batch(with_(hf_batch(), labels=torch.ones(2, 4)), label_style="hf"),
     r"labels must hold integer token ids \(-100 = ignore\), got dtype torch\.float32"),
    ("label_minus_one", lambda: pack_batch(with_(hf_batch(), labels=torch.tensor([[11, 12, -1, -100], [21, 22, -100, -100]])),
                                           label_style="hf"),
     r"labels row 0 position 2 is -1: a label must be -100 \(ignored\) or a token id >= 0; 1 such label"),
    ("label_at_vocab_size", lambda: pack_batch(with_(hf_batch(), labels=torch.tensor([[11, 12, 13, -100], [50, 22, -100, -100]])),
                                               label_style="hf", vocab_size=50),
     r"labels row 1 position 0 is 50: a label must be -100 \(ignored\) or a token id in \[0, 50\)"),
    ("input_id_at_vocab_size", lambda: pack_batch(hf_batch(((11, 12, 60), (21, 22))), label_style="hf", vocab_size=50),
     r"input_ids row 0 position 2 is 60: token ids must lie in \[0, 50\)"),
    ("negative_input_id", lambda: pack_batch(with_(hf_batch(), input_ids=torch.tensor([[11, -5, 13, 0], [21, 22, 0, 0]])),
                                             label_style="hf"),
     r"input_ids row 0 position 1 is -5: token ids must lie in \[0, vocab_size\)"),
    ("hf_labels_as_megatron", lambda: pack_batch(hf_batch()),
     r"labels look like Hugging Face \(unshifted\) labels but label_style=\"megatron\" takes them as next-token "
     r"targets: at all 3 real labels that tell the styles apart .* Pass label_style=\"hf\""),
    ("loss_weight_finite_in_float64_only", lambda: pack_batch(with_(megatron_batch(), loss_mask=torch.tensor(
        [[1.0, 1e39, 1, 0], [1, 1, 0, 0]], dtype=torch.float64))),
     r"loss_mask row 0 position 1 is 1e\+39 \(inf as float32\): loss weights must be finite and >= 0"),
    ("dense_loss_weight_finite_in_float64_only", lambda: pad_batch(with_(megatron_batch(), loss_mask=torch.tensor(
        [[1.0, 1e39, 1, 0], [1, 1, 0, 0]], dtype=torch.float64))),
     r"loss_mask row 0 position 1 is 1e\+39 \(inf as float32\): loss weights must be finite and >= 0"),
    ("negative_loss_weight", lambda: pack_batch(with_(megatron_batch(), loss_mask=torch.tensor([[1.0, -1.0, 1, 0], [1, 1, 0, 0]]))),
     r"loss_mask row 0 position 1 is -1\.0: loss weights must be finite and >= 0"),
    ("nan_loss_weight", lambda: pack_batch(with_(megatron_batch(), loss_mask=torch.tensor([[1.0, 1, 1, 0], [float("nan"), 1, 0, 0]]))),
     r"loss_mask row 1 position 0 is nan"),
    ("positions_b3s_ambiguous_with_three_rows",
     lambda: pack_batch(with_(hf_batch(((1, 2), (3, 4), (5, 6)), 2), position_ids=torch.zeros(3, 3, 2, dtype=torch.long)),
                        label_style="hf"),
     r"position_ids \(3, 3, 2\) is ambiguous with B = 3 rows: \[3, B, S\] or \[B, 3, S\]\? pass position_layout="),
    ("positions_wrong_3d_shape", lambda: pack_batch(with_(hf_batch(), position_ids=torch.zeros(2, 4, 3, dtype=torch.long)),
                                                    label_style="hf"),
     r"position_ids has shape \(2, 4, 3\); mRoPE positions must be \[3, 2, 4\] \(or \[2, 3, 4\]\)"),
    ("positions_3d_bool", lambda: pack_batch(with_(hf_batch(), position_ids=torch.ones(3, 2, 4, dtype=torch.bool)),
                                             label_style="hf"),
     r"position_ids has dtype torch\.bool: mRoPE positions must hold integer or real positions"),
    ("positions_3d_complex", lambda: pack_batch(with_(hf_batch(), position_ids=torch.ones(2, 3, 4, dtype=torch.complex64)),
                                                label_style="hf"),
     r"position_ids has dtype torch\.complex64: mRoPE positions must hold integer or real positions"),
    ("positions_3d_nan_at_a_real_token", lambda: pack_batch(with_(hf_batch(), position_ids=_float_positions(1, 1, 1)),
                                                            label_style="hf"),
     r"position_ids channel 1 row 1 position 1 is nan: mRoPE positions must be finite"),
    ("positions_3d_inf_on_the_host", lambda: pack_batch(with_(hf_batch(), position_ids=_float_positions(2, 0, 2, "inf")),
                                                        label_style="hf", host_reads=True),
     r"position_ids channel 2 row 0 position 2 is inf: mRoPE positions must be finite"),
    ("dense_positions_3d_bool", lambda: pad_batch(with_(hf_batch(), position_ids=torch.ones(3, 2, 4, dtype=torch.bool)),
                                                  label_style="hf"),
     r"position_ids has dtype torch\.bool: mRoPE positions must hold integer or real positions"),
    ("positions_1d_restart_inside_a_row",
     lambda: pack_batch(with_(hf_batch(((1, 2, 3, 4),), 4), position_ids=torch.tensor([[0, 1, 0, 1]])), label_style="hf"),
     r"position_ids row 0 position 2 is 0, expected 2 \(it restarts: a row with several documents\? give document_lengths\)"),
    ("seq_lens_fractional", lambda: pack_batch({**megatron_batch(), "attention_mask": None, "seq_lens": [2.5, 2]}),
     r"seq_lens row 0 is 2\.5: lengths must be whole numbers of tokens"),
    ("seq_lens_fractional_tensor", lambda: pack_batch({**megatron_batch(), "attention_mask": None,
                                                       "seq_lens": torch.tensor([3.0, 1.5])}),
     r"seq_lens row 1 is 1\.5: lengths must be whole numbers of tokens"),
    ("seq_lens_nested_per_row", lambda: pack_batch({**megatron_batch(), "attention_mask": None,
                                                    "seq_lens": torch.tensor([[2, 1], [2, 0]])}),
     r"seq_lens must be \[B\] \(one length per row\), got shape \(2, 2\); several documents per row go in document_lengths"),
    ("pad_to_float", lambda: pack_batch(hf_batch(), label_style="hf", pad_to=8.0),
     r"pad_to must be an int \(the packed length T\) or None, got 8\.0"),
    ("pad_to_string", lambda: pack_batch(hf_batch(), label_style="hf", pad_to="8"),
     r"pad_to must be an int \(the packed length T\) or None, got '8'"),
    ("pad_to_bool", lambda: pack_batch(hf_batch(), label_style="hf", pad_to=True),
     r"pad_to must be an int \(the packed length T\) or None, got True"),
    ("pad_token_id_none", lambda: pack_batch(hf_batch(), label_style="hf", pad_token_id=None),
     r"pad_token_id must be a non-negative int \(the id written at pad slots\), got None"),
    ("block_diagonal_4d_mask", lambda: pack_batch(_block_diagonal_4d(), label_style="hf"),
     r"4D attention_mask row 0 masks real token 2 from real token 0: between real tokens it must be causal; "
     r"several documents in a row are declared with document_lengths"),
    ("non_causal_4d_mask", lambda: pack_batch(_full_attention_4d(), label_style="hf"),
     r"4D attention_mask row 0 lets real token 0 see real token 1"),
    ("rope_only_key_without_mrope", lambda: pack_batch(with_(hf_batch(), use_audio_in_video=True), label_style="hf"),
     r"batch key 'use_audio_in_video' is read only by an mRoPE index, and no mrope= was given"),
    # vision
    ("pixel_values_without_grids", lambda: pack_batch(with_(hf_batch(((IMG, 1), (2, 3))), pixel_values=torch.zeros(4, 3)),
                                                      label_style="hf", image_token_id=IMG),
     r"pixel_values is \[P, C\] = \(4, 3\) patches but the batch has no image_grid_thw"),
    ("grids_as_lists", lambda: pack_batch(with_(image_batch(((IMG, 1), (2, 3)), [[1, 2, 2]]), image_grid_thw=[[1, 2, 2]]),
                                          label_style="hf", image_token_id=IMG),
     r"image_grid_thw must be a \[N, 3\] integer tensor, got list"),
    ("grid_without_pixel_values", lambda: pack_batch(with_(hf_batch(((IMG, 1), (2, 3))), image_grid_thw=torch.tensor([[1, 2, 2]])),
                                                     label_style="hf", image_token_id=IMG),
     r"image_grid_thw has 1 rows but the batch has no pixel_values"),
    ("grid_with_zero_entry", lambda: pack_batch(with_(image_batch(((IMG, 1), (2, 3)), [[1, 2, 2]]),
                                                      image_grid_thw=torch.tensor([[1, 0, 2]])),
                                                label_style="hf", image_token_id=IMG),
     r"image_grid_thw row 0 is \[1, 0, 2\]: every grid entry must be >= 1"),
    ("grid_patches_vs_pixel_values", lambda: pack_batch(with_(image_batch(((IMG, 1), (2, 3)), [[1, 2, 2]]),
                                                              pixel_values=torch.zeros(6, 3)),
                                                        label_style="hf", image_token_id=IMG),
     r"image_grid_thw covers 4 patches but pixel_values has 6"),
    ("image_placeholder_moved_to_another_sample",
     lambda: pack_batch(image_batch(((1, IMG, IMG, IMG), (IMG, IMG, IMG, IMG, IMG, 2)), [[1, 2, 4], [1, 2, 4]]),
                        label_style="hf", image_token_id=IMG),
     r"row 0 has 3 image placeholder tokens, but the images of image_grid_thw in order give it 4 \(2 image\(s\) 0\.\.1 "
     r"with \[2, 2\] tokens; 2 in all\)"),
    ("image_placeholder_moved_across_two_images",
     lambda: pack_batch(image_batch(((1, IMG, IMG, IMG, IMG, IMG), (IMG, IMG, IMG, 2)), [[1, 4, 4], [1, 4, 4]]),
                        label_style="hf", image_token_id=IMG),
     r"row 0 has 5 image placeholder tokens, but the images of image_grid_thw in order give it 8"),
    ("image_grid_rows_left_over", lambda: pack_batch(image_batch(((1, IMG), (2, 3)), [[1, 2, 2], [1, 2, 2]]),
                                                     label_style="hf", image_token_id=IMG),
     r"image_grid_thw has 2 image\(s\) but the rows' image placeholders use only 1 \(1 placeholder tokens\)"),
    ("video_seconds_count", lambda: pack_batch(
        with_(hf_batch(((VID, 1), (VID, 2))), pixel_values_videos=torch.zeros(8, 3),
              video_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]), second_per_grid_ts=torch.tensor([1.0])),
        label_style="hf", video_token_id=VID),
     r"second_per_grid_ts has 1 entries but video_grid_thw has 2 videos"),
    ("video_seconds_nan", lambda: pack_batch(
        with_(hf_batch(((VID, 1), (2, 3))), pixel_values_videos=torch.zeros(4, 3),
              video_grid_thw=torch.tensor([[1, 2, 2]]), second_per_grid_ts=torch.tensor([float("nan")])),
        label_style="hf", video_token_id=VID),
     r"second_per_grid_ts must be finite and >= 0, got \[nan\]"),
    ("image_id_contradicts_mrope_config", lambda: pack_batch(
        image_batch(((IMG, 1), (2, 3)), [[1, 2, 2]]), label_style="hf", image_token_id=5,
        mrope=MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=VID)),
     r"image_token_id=5 contradicts the mrope config's image_token_id=9"),
    # audio
    ("audio_features_without_mask", lambda: pack_batch(with_(hf_batch(), input_features=torch.zeros(1, 4, 10)),
                                                       label_style="hf", audio_token_id=AUD),
     r"audio needs both input_features and feature_attention_mask; feature_attention_mask is missing"),
    ("audio_mask_shape", lambda: pack_batch(with_(hf_batch(), input_features=torch.zeros(1, 4, 10),
                                                  feature_attention_mask=torch.ones(1, 8)),
                                            label_style="hf", audio_token_id=AUD),
     r"feature_attention_mask is \(1, 8\) but input_features \(1, 4, 10\) needs \[A, L\] = \[1, 10\]"),
    ("audio_placeholders_vs_clip_length", lambda: pack_batch(
        with_(hf_batch(((AUD, AUD, AUD, 1), (2, 3))), input_features=torch.zeros(1, 4, 10),
              feature_attention_mask=torch.ones(1, 10, dtype=torch.long)),
        label_style="hf", audio_token_id=AUD),
     r"row 0 has 3 audio placeholder tokens, but the audios of feature_attention_mask in order give it 2"),
    # pre-packed documents
    ("document_lengths_do_not_sum", lambda: pack_batch(with_(hf_batch(((1, 2, 3), (4, 5))), document_lengths=[[1, 2], [3]]),
                                                       label_style="hf"),
     r"document_lengths row 1 sums to 3 tokens \(\[3\]\) but the row has 2 real tokens"),
    ("document_lengths_zero_inside", lambda: pack_batch(with_(hf_batch(((1, 2, 3), (4, 5))),
                                                              document_lengths=torch.tensor([[1, 0, 2], [2, 0, 0]])),
                                                        label_style="hf"),
     r"document_lengths row 0 is \[1, 0, 2\]: document lengths must be >= 1 \(zeros only as trailing padding\)"),
    ("document_lengths_every_row_empty", lambda: pack_batch({"input_ids": torch.zeros(2, 3, dtype=torch.long),
                                                             "labels": torch.zeros(2, 3, dtype=torch.long),
                                                             "seq_lens": [0, 0], "document_lengths": [[0], []]},
                                                            label_style="hf"),
     r"the batch has no real tokens \(2 rows, all empty\): nothing to pack"),
    ("document_lengths_float", lambda: pack_batch(with_(hf_batch(), document_lengths=torch.tensor([[1.5, 1.5], [2.0, 0]])),
                                                  label_style="hf"),
     r"document_lengths must be a \[B, D\] integer tensor \(or B lists of ints\), got shape \(2, 2\) torch\.float32"),
    # an error inside a pre-packed document names the token where the batch has it, not in the split rows
    ("document_bad_label_named_in_its_source_row", lambda: pack_batch(
        with_(hf_batch(((1, 2, 3), (4, 5))), labels=torch.tensor([[1, 2, -7, -100], [4, 5, -100, -100]]),
              document_lengths=[[1, 2], [2]]), label_style="hf"),
     r"labels row 0 position 2 \(document 1 of row 0, its position 1\) is -7"),
    ("document_bad_id_named_in_its_source_row", lambda: pack_batch(
        with_(hf_batch(((1, 2, 3), (4, 5, 6))), document_lengths=[[3], [1, 2]]), label_style="hf", vocab_size=6),
     r"input_ids row 1 position 2 \(document 1 of row 1, its position 1\) is 6: token ids must lie in \[0, 6\)"),
    ("document_bad_position_named_in_its_source_row", lambda: pack_batch(
        with_(hf_batch(((1, 2, 3, 4),)), position_ids=torch.tensor([[0, 1, 0, 2]]), document_lengths=[[2, 2]]),
        label_style="hf"),
     r"position_ids row 0 position 3 \(document 1 of row 0, its position 1\) is 2, expected 1"),
    ("document_bad_loss_weight_named_in_its_source_row", lambda: pack_batch(
        with_(hf_batch(((1, 2, 3), (4, 5))), loss_mask=torch.tensor([[1.0, 1.0, float("nan"), 0.0], [1, 1, 0, 0]]),
              document_lengths=[[2, 1], [2]]), label_style="hf"),
     r"loss_mask row 0 position 2 \(document 1 of row 0, its position 0\) is nan"),
    ("document_image_placeholder_moved_named_in_its_source_row", lambda: pack_batch(
        with_(image_batch(((1, 2, IMG, IMG, IMG, 3), (IMG, 4)), [[1, 2, 4], [1, 2, 4]]), document_lengths=[[2, 4], [2]]),
        label_style="hf", image_token_id=IMG),
     r"row 0 document 1 has 3 image placeholder tokens, but the images of image_grid_thw in order give it 4"),
    ("document_orphan_placeholder_named_in_its_source_row", lambda: pack_batch(
        with_(hf_batch(((1, 2, 3, IMG), (4, 5))), document_lengths=[[2, 2], [2]]), label_style="hf",
        image_token_id=IMG),
     r"input_ids hold 1 image placeholder tokens \(id 9\) in row 0 document 1 but the batch has no pixel_values"),
    ("document_mrope_block_count_named_in_its_source_row", lambda: pack_batch(
        with_(image_batch(((1, 2, 3, 5, IMG, IMG, 4, IMG, IMG, 6),), [[1, 4, 4]]), document_lengths=[[3, 7]]),
        label_style="hf", mrope=MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=VID)),
     r"2 image placeholder blocks in input_ids but 1 rows in image_grid_thw \(blocks at row 0 position 4 \(document 1 "
     r"of row 0, its position 1\), row 0 position 7 \(document 1 of row 0, its position 4\)\)"),
    ("document_mrope_block_size_named_in_its_source_row", lambda: pack_batch(
        with_(image_batch(((1, 2, 5, IMG, IMG, IMG, 4, IMG, 6),), [[1, 2, 4], [1, 2, 4]]), document_lengths=[[2, 7]]),
        label_style="hf", mrope=MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=VID)),
     r"the image block at input_ids row 0 position 3 \(document 1 of row 0, its position 1\) has 3 placeholder "
     r"tokens but its grid \[1, 2, 4\] with merge 2 needs 2"),
    ("document_omni_block_size_named_in_its_source_row", lambda: pack_batch(
        with_(image_batch(((1, 2, 5, IMG, IMG, IMG, 3, 5, IMG, IMG, IMG, 3, 4),), [[1, 4, 4], [1, 2, 4]]),
              document_lengths=[[2, 11]]),
        label_style="hf", mrope=MRopeConfig(family="qwen3_omni", image_token_id=IMG, video_token_id=VID,
                                            vision_start_token_id=5, audio_token_id=AUD, audio_start_token_id=6,
                                            mrope_section=(24, 20, 20), mrope_interleaved=True)),
     r"the image block at input_ids row 0 position 3 \(document 1 of row 0, its position 1\) has 3 placeholder "
     r"tokens but its grid / audio length needs 4"),
    ("fractional_position_shown_as_given", lambda: pack_batch(
        with_(hf_batch(), position_ids=torch.tensor([[0.0, 1.5, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])), label_style="hf"),
     r"position_ids row 0 position 1 is 1.5, expected 1;"),
    ("dense_rows_with_several_documents", lambda: pad_batch(with_(hf_batch(((1, 2, 3), (4, 5))), document_lengths=[[1, 2], [2]]),
                                                            label_style="hf"),
     r"document_lengths gives row 0 2 documents: dense rows attend causally across the whole row"),
    # unpack_rows
    ("unpack_rows_wrong_row_length", lambda: _unpack(row_length=5),
     r"unpack_rows got \(batch_size, row_length\) = \(2, 5\), B\*S = 10, but the plan's indices put pads at slot 8"),
    ("unpack_rows_against_plan", lambda: _unpack(row_length=3, with_plan=True),
     r"unpack_rows got \(batch_size, row_length\) = \(2, 3\) but the plan was made for \(2, 4\)"),
    # unpack_rows' other arguments: were AttributeErrors, TypeErrors from torch.full, a RuntimeError from index_copy,
    # and pad_value=1.5 silently written as 1 into integer rows
    ("unpack_rows_packed_not_a_tensor", lambda: _unpack_with(packed=np.zeros((1, 6))),
     r"unpack_rows' packed must be a \[1, T, ...\] tensor, got ndarray"),
    ("unpack_rows_indices_not_pack_indices", lambda: _unpack_with(indices=None),
     r"unpack_rows' indices must be the PackIndices of the pack \(micro_batch.indices\), got NoneType"),
    ("unpack_rows_plan_not_a_plan", lambda: _unpack_with(plan={}),
     r"unpack_rows' plan must be the PackPlan of the pack \(micro_batch.plan\) or None, got dict"),
    ("unpack_rows_packed_on_another_device", lambda: _unpack_with(packed=torch.zeros(1, 6, device="meta")),
     r"unpack_rows' packed is on meta but the indices are on cpu"),
    ("unpack_rows_fractional_pad_value", lambda: _unpack_with(pad_value=1.5),
     r"pad_value=1.5 cannot be held by the packed torch.int64 values \(integers in \[-9223372036854775808, "
     r"9223372036854775807\]\)"),
    ("unpack_rows_pad_value_past_int64", lambda: _unpack_with(pad_value=2**70),
     r"pad_value=1180591620717411303424 cannot be held by the packed torch.int64 values"),
    ("unpack_rows_nan_pad_value_for_ids", lambda: _unpack_with(pad_value=float("nan")),
     r"pad_value=nan cannot be held by the packed torch.int64 values"),
    ("unpack_rows_pad_value_not_a_number", lambda: _unpack_with(pad_value="pad"),
     r"unpack_rows' pad_value must be a real number \(the value of the rows' pad slots\), got 'pad'"),
    ("unpack_rows_rows_past_int64", lambda: _unpack_with(batch_size=2**70),
     r"unpack_rows got \(batch_size, row_length\) = \(1180591620717411303424, 4\), B\*S = 4722366482869645213696"),
    # the dense path checks what the packed path checks
    ("dense_left_padding", lambda: pad_batch(with_(hf_batch(), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])),
                                             label_style="hf"),
     r"attention_mask rows must be right-padded and contiguous .* row 0: .*left padding: first real token at position 1"),
    ("dense_mask_with_holes", lambda: pad_batch(with_(hf_batch(), attention_mask=torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]])),
                                                label_style="hf"),
     r"row 0: .*holes at positions \[1\]"),
    ("dense_seq_lens_out_of_range", lambda: pad_batch({**hf_batch(), "attention_mask": None, "seq_lens": [3, 5]},
                                                      label_style="hf"),
     r"seq_lens must lie in \[0, 4\] .*\[\(1, 5\)\]"),
    ("dense_seq_length_cuts_real_tokens", lambda: pad_batch(hf_batch(), seq_length=2, label_style="hf"),
     r"seq_length=2 is shorter than the longest row's 3 real tokens; pass truncate=True"),
    ("dense_seq_length_not_aligned", lambda: pad_batch(hf_batch(), seq_length=6, cp_size=2, label_style="hf"),
     r"seq_length=6 must be a positive multiple of 4"),
    ("dense_truncate_through_an_image", lambda: pad_batch(image_batch(((1, IMG, IMG), (2, 3)), [[1, 2, 4]]), seq_length=2,
                                                          truncate=True, label_style="hf", image_token_id=IMG),
     r"truncate=True would cut rows to seq_length=2 below their real tokens \(longest 3\)"),
    ("dense_hf_labels_as_megatron", lambda: pad_batch(hf_batch()),
     r"labels look like Hugging Face \(unshifted\) labels.*at all 3 real labels"),
    ("dense_float_ids", lambda: pad_batch(with_(hf_batch(), input_ids=torch.ones(2, 4)), label_style="hf"),
     r"input_ids must hold integer token ids, got dtype torch\.float32"),
]


def _unpack(row_length, with_plan=False):
    packed = pack_batch(hf_batch(), label_style="hf", cp_size=2)  # documents padded: 4 + 2 slots
    extra = {"plan": packed.plan} if with_plan else {}
    return packing.unpack_rows(packed.input_ids, packed.indices, batch_size=2, row_length=row_length, **extra)


def _unpack_with(**kwargs):
    """unpack_rows of a pack without pad slots (cp = 1), with `kwargs` replacing its arguments."""
    packed = pack_batch(hf_batch(), label_style="hf")
    args = {**dict(packed=packed.input_ids, indices=packed.indices, batch_size=2, row_length=4), **kwargs}
    return packing.unpack_rows(args.pop("packed"), args.pop("indices"), **args)


@pytest.mark.parametrize("name, call, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_is_a_value_error_naming_field_and_numbers(name, call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- exact results -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pad_to", [np.int64(8), np.int32(8)], ids=["int64", "int32"])
def test_pad_to_as_a_numpy_int_gives_python_int_lengths(pad_to):
    mb = pack_batch(hf_batch(), label_style="hf", pad_to=pad_to)
    # max_seqlen_* are Python ints (the contract; TE reads them on the host), as is every plan length
    assert type(mb.packed_seq_params.max_seqlen_q) is int and type(mb.plan.total) is int
    assert all(type(n) is int for n in mb.plan.physical_lengths) and mb.plan.physical_lengths == (3, 5)


def test_float_loss_weights_are_kept_packed():
    batch = with_(megatron_batch(), loss_mask=torch.tensor([[0.5, 2.0, 1.0, 0.0], [0.25, 1.0, 0.0, 0.0]]))
    assert pack_batch(batch).loss_mask.tolist() == [[0.5, 2.0, 1.0, 0.25, 1.0]]


def test_float_loss_weights_are_kept_dense():
    batch = with_(megatron_batch(), loss_mask=torch.tensor([[0.5, 2.0, 1.0, 3.0], [0.25, 1.0, 9.0, 0.0]]))
    assert pad_batch(batch).loss_mask.tolist() == [[0.5, 2.0, 1.0, 0.0], [0.25, 1.0, 0.0, 0.0]]


def test_declared_extra_is_packed_per_token():
    batch = with_(hf_batch(), token_weights=torch.arange(8.0).view(2, 4))
    assert pack_batch(batch, label_style="hf", extra_keys=("token_weights",)).extras["token_weights"].tolist() == \
        [[0.0, 1.0, 2.0, 4.0, 5.0]]


def test_positions_given_as_b3s_are_transposed():
    batch = hf_batch(((1, 2), (3, 4)), 2)
    b3s = torch.tensor([[[0, 1], [0, 2], [0, 3]], [[0, 5], [0, 6], [0, 7]]])  # [B=2, 3, S=2]
    packed = pack_batch(with_(batch, position_ids=b3s), label_style="hf")
    assert packed.position_ids[:, 0].tolist() == [[0, 1, 0, 5], [0, 2, 0, 6], [0, 3, 0, 7]]


def test_position_layout_resolves_three_rows():
    batch = hf_batch(((1, 2), (3, 4), (5, 6)), 2)
    b3s = torch.arange(18).view(3, 3, 2)  # [B, 3, S]: row b, axis c, position s
    packed = pack_batch(with_(batch, position_ids=b3s), label_style="hf", position_layout="B3S")
    assert packed.position_ids[0, 0].tolist() == [0, 1, 6, 7, 12, 13]  # axis 0 of rows 0, 1, 2


def test_images_videos_audio_counted_per_sample_in_token_order():
    from megatron_vlm_packing.rope.omni import audio_output_length

    ids = torch.tensor([[1, IMG, VID, VID, AUD, AUD, 2],
                        [3, 4, 5, 0, 0, 0, 0],
                        [IMG, IMG, IMG, IMG, AUD, 6, 0]])
    keep = (torch.arange(7) < torch.tensor([[7], [3], [6]])).long()
    frames = torch.tensor([[1] * 10, [1] * 2 + [0] * 8])
    assert audio_output_length(frames.sum(1), 50).tolist() == [2, 1]  # placeholders per clip
    batch = {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep,
             "pixel_values": torch.zeros(4 + 16, 3), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]]),
             "pixel_values_videos": torch.zeros(8, 3), "video_grid_thw": torch.tensor([[2, 2, 2]]),
             "input_features": torch.zeros(2, 5, 10), "feature_attention_mask": frames}
    mb = pack_batch(batch, label_style="hf", image_token_id=IMG, video_token_id=VID, audio_token_id=AUD)
    assert mb.vision.images_per_sample == (1, 0, 1)
    assert mb.vision.videos_per_sample == (1, 0, 0)
    assert mb.audio.audios_per_sample == (1, 0, 1) and mb.audio.audio_lengths == (10, 2)
    assert mb.inputs_present() == {"images", "videos", "audio"}


def test_stats_count_real_physical_and_row_slots():
    mb = pack_batch(hf_batch(), label_style="hf", cp_size=2)
    assert (mb.stats.real_tokens, mb.stats.physical_tokens, mb.stats.row_tokens) == (5, 8, 8)


def test_pre_packed_documents_each_become_a_segment():
    # row 0 holds two documents (3 + 2 tokens), row 1 one (3 tokens)
    batch = hf_batch(((11, 12, 13, 21, 22), (31, 32, 33)), 5)
    mb = pack_batch(with_(batch, document_lengths=[[3, 2], [3]]), label_style="hf")
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    # HF labels shift inside each document: 13 never learns 21
    assert mb.labels.tolist() == [[12, 13, -100, 22, -100, 32, 33, -100]]


def test_pre_packed_documents_survive_alignment_padding():
    batch = hf_batch(((11, 12, 13, 21, 22), (31, 32, 33)), 5)
    mb = pack_batch(with_(batch, document_lengths=torch.tensor([[3, 2], [3, 0]])), label_style="hf", cp_size=2)
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5, 8]
    assert mb.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 4, 8, 12]
    assert mb.stats.row_tokens == 10


def test_pre_packed_documents_get_their_own_mrope_positions():
    cfg = MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=VID)
    doc_a, doc_b = [1, IMG, IMG, 2], [3, IMG, IMG, IMG, IMG, 4]
    ids = torch.tensor([doc_a + doc_b])
    grids = torch.tensor([[1, 2, 4], [1, 4, 4]])
    batch = {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.zeros(8 + 16, 3), "image_grid_thw": grids,
             "document_lengths": [[4, 6]]}
    mb = pack_batch(batch, label_style="hf", mrope=cfg)
    alone_a = get_rope_index(torch.tensor([doc_a]), cfg, image_grid_thw=grids[:1]).position_ids[:, 0]
    alone_b = get_rope_index(torch.tensor([doc_b]), cfg, image_grid_thw=grids[1:]).position_ids[:, 0]
    assert torch.equal(mb.position_ids[:, 0], torch.cat([alone_a, alone_b], dim=1))
    assert mb.vision.images_per_sample == (1, 1)


def test_dense_rows_with_one_document_each_are_accepted():
    batch = hf_batch()
    plain = pad_batch(batch, label_style="hf")
    declared = pad_batch(with_(batch, document_lengths=[[3], [2]]), label_style="hf")
    assert torch.equal(plain.labels, declared.labels) and torch.equal(plain.position_ids, declared.position_ids)


def test_dense_rows_with_one_document_each_keep_their_empty_rows():
    batch = {**hf_batch(((11, 12, 13), (21, 22))), "attention_mask": torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])}
    plain = pad_batch(batch, label_style="hf")
    for empty in ([], [0]):  # an empty row declares no document: it stays a row (B = 2), as without them
        declared = pad_batch(with_(batch, document_lengths=[[3], empty]), label_style="hf")
        assert declared.input_ids.shape == plain.input_ids.shape == (2, 4)
        assert torch.equal(plain.labels, declared.labels) and torch.equal(plain.padding_mask, declared.padding_mask)


def test_dense_truncate_flag_cuts_text():
    mb = pad_batch(hf_batch(), seq_length=2, truncate=True, label_style="hf")
    assert mb.input_ids.tolist() == [[11, 12], [21, 22]] and mb.labels.tolist() == [[12, 13], [22, -100]]


def test_dense_mrope_positions_are_each_rows_own():
    cfg = MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=VID)
    batch = image_batch(((1, IMG, IMG, 2), (3, 4)), [[1, 2, 4]])
    mb = pad_batch(batch, label_style="hf", mrope=cfg, cp_size=2)
    alone = get_rope_index(torch.tensor([[1, IMG, IMG, 2]]), cfg, image_grid_thw=batch["image_grid_thw"]).position_ids
    assert mb.position_ids.shape == (3, 2, 4)
    assert torch.equal(mb.position_ids[:, 0], alone[:, 0])
    assert mb.position_ids[:, 1].tolist() == [[0, 1, 2, 3]] * 3  # text row; its pads continue after it


def test_dense_4d_mask_reads_lengths_from_the_diagonal():
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()[None] & keep[:, None, :] & keep[:, :, None]
    batch = with_(hf_batch(), attention_mask=~allowed[:, None])
    assert pad_batch(batch, label_style="hf").padding_mask.int().tolist() == [[0, 0, 0, 1], [0, 0, 1, 1]]


def test_micro_batch_keeps_packed_batch_name():
    assert packing.PackedBatch is packing.MicroBatch


def test_pre_packed_rows_with_per_document_positions_are_accepted():
    # a packed-SFT row: position_ids restart per document, declared by document_lengths
    batch = hf_batch(((11, 12, 13, 21, 22),), 5)
    mb = pack_batch(with_(batch, position_ids=torch.tensor([[0, 1, 2, 0, 1]]), document_lengths=[[3, 2]]),
                    label_style="hf")
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 5] and mb.labels.tolist() == [[12, 13, -100, 22, -100]]


def test_grids_without_pixels_are_position_inputs_with_mrope_only():
    cfg = MRopeConfig(family="qwen2_vl", image_token_id=IMG, video_token_id=VID)
    batch = with_(hf_batch(((1, IMG, IMG, 2), (3, 4))), image_grid_thw=torch.tensor([[1, 2, 4]]))
    mb = pack_batch(batch, label_style="hf", mrope=cfg)  # a text model with mRoPE: grids only place positions
    alone = get_rope_index(torch.tensor([[1, IMG, IMG, 2]]), cfg, image_grid_thw=batch["image_grid_thw"]).position_ids
    assert mb.vision is None and torch.equal(mb.position_ids[:, 0, :4], alone[:, 0])
    with pytest.raises(ValueError, match=r"image_grid_thw has 1 rows but the batch has no pixel_values \(grids alone "
                                         r"are read only by an mRoPE index: pass mrope=\)"):
        pack_batch(batch, label_style="hf", image_token_id=IMG)
