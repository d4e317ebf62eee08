"""Bad or unusual inputs through `make_forward_step` with real Megatron-Core models (tiny GPTModel,
PackedVLM with vision and audio towers, mRoPE): each gives the exact error (type, field, numbers)
or the exact correct result. One process launch runs every case (tests/adversarial/step_cases.py).

Every case here fails on bd042f6: inputs were dropped by signature sniffing (videos, audio,
packed_seq_params, per-token tensors), mRoPE settings were computed and ignored, the dense path
checked nothing (left padding, holes, seq_lens, a short seq_length) and gave mRoPE models 1D
positions, and media were not checked per sample. Cases that return a result also assert that
media reach the loss, which the old step could not do. Where the packer (`pack_batch` /
`pad_batch`) refuses an input first, its message is the one expected; `PackedVLM` repeats the
per-sample checks for callers that run it directly (tests/step/test_media.py).
"""

import re

import pytest

from megatron_vlm_packing.runtime import run_distributed
from tests.adversarial.step_cases import CASES, run_step_cases

ERR = "error"
EXPECTED = {
    # inputs the model does not consume: a ValueError naming the input (bug class 10)
    "gpt_with_images": (ERR, "ValueError", r"carries \['images'\] but GPTModel's adapter"),
    "gpt_with_videos": (ERR, "ValueError", r"carries \['videos'\] but GPTModel's adapter"),
    "gpt_with_audio": (ERR, "ValueError", r"carries \['audio'\] but GPTModel's adapter"),
    "image_vlm_with_videos": (ERR, "ValueError", r"carries \['videos'\] but PackedVLM's adapter .* consumes only \['images'\]"),
    "image_vlm_with_audio": (ERR, "ValueError", r"carries \['audio'\] but PackedVLM's adapter"),
    "gpt_with_unknown_per_token_tensor": (ERR, "ValueError", r"token_type_ids"),
    # models and adapters
    "model_without_packed_seq_params_unregistered": (ERR, "ValueError", r"no model adapter for .*NoPackedSeqParams"),
    "model_without_packed_seq_params_packed": (ERR, "ValueError", r"NoPackedSeqParams cannot take packed_seq_params"),
    "unknown_model_type": (ERR, "ValueError", r"no model adapter for torch\.nn\.modules\.linear\.Linear"),
    "adapter_not_an_adapter": (ERR, "ValueError", r"adapter must be a ModelAdapter or a factory"),
    "adapter_factory_returns_wrong_type": (ERR, "ValueError", r"the adapter factory returned object, not a ModelAdapter"),
    "wrapped_vlm_found_through_wrappers": ("ok", ("PackedVLMAdapter", True, True)),
    "registered_user_model_equals_gpt": ("ok", True),
    "adapter_consuming_a_per_token_tensor_receives_it": ("ok", True),
    "explicit_adapter_overrides_registry": ("ok", True),
    "with_state_form_equals_plain": ("ok", (True, True)),
    "batch_not_a_dict": (ERR, "ValueError", r"must yield a dict of tensors .* got list"),
    "batch_a_mapping_not_a_dict": ("ok", True),
    "batch_with_a_meta_tensor": (ERR, "ValueError", r"^labels is a meta tensor: it holds no values for "
                                 r"pack_batch/pad_batch to read$"),
    "data_iterator_none": (ERR, "ValueError", r"data_iterator must be an iterator .* got NoneType"),
    "data_iterator_a_list": (ERR, "ValueError", r"data_iterator must be an iterator .* got list; pass iter"),
    "data_iterator_exhausted": (ERR, "StopIteration", r"^$"),
    "megatron_rerun_data_iterator_accepted": ("ok", True),
    "model_without_config": (ERR, "ValueError", r"NoConfig has no Megatron TransformerConfig at \.config \(got NoneType\)"),
    "model_without_parameters": (ERR, "ValueError", r"NoParameters has no parameters"),
    "transform_returns_none": (ERR, "ValueError", r"transform must return a MicroBatch, got NoneType"),
    # micro-batches built before the step: the step's pack / pad_to / seq_length and the layout
    "loader_packed_micro_batch_for_a_dense_step": (ERR, "ValueError", r"yielded a packed micro-batch but the step was made with pack=False"),
    "loader_dense_micro_batch_for_a_packed_step": (ERR, "ValueError", r"yielded a dense micro-batch but the step was made with pack=True"),
    "loader_micro_batch_shorter_than_pad_to": (ERR, "ValueError", r"packed micro-batch from the data iterator has length 13 but the step was made with pad_to=64"),
    "loader_micro_batch_with_pad_to_equals_in_step": ("ok", True),
    # loss weights no packer checked (a hand-built micro-batch, a transform's): checked where they enter
    "hand_built_micro_batch_with_a_negative_loss_weight": (ERR, "ValueError", r"loss_mask row 0 position 2 is -1\.0: loss weights must be finite and >= 0"),
    "transform_giving_a_nan_loss_weight": (ERR, "ValueError", r"loss_mask row 0 position 3 is nan: loss weights must be finite and >= 0"),
    "loader_dense_micro_batch_other_than_seq_length": (ERR, "ValueError", r"dense micro-batch .* has length 6 but the step was made with seq_length=8"),
    "loader_dense_rows_that_sp_cannot_split": (ERR, "ValueError", r"dense micro-batch .* has length 5, not a multiple of 2 that the model's layout needs"),
    # rotary kind (bug class 1)
    "mrope_for_1d_gpt": (ERR, "ValueError", r"mrope=\.\.\.\) was given but GPTModel's rotary is 1D"),
    "mrope_for_1d_vlm": (ERR, "ValueError", r"mrope=\.\.\.\) was given but PackedVLM's rotary is 1D"),
    "positions_3d_for_1d_gpt": (ERR, "ValueError", r"position_ids"),
    "mrope_gpt_without_mrope": (ERR, "ValueError", r"GPTModel uses mRoPE but the micro-batch has 1D position_ids of shape \(1, 13\)"),
    "mrope_vlm_uses_its_own_config": ("ok", True),
    "mrope_vlm_positions_matter": ("ok", True),
    "mrope_vlm_with_collated_3d_positions": ("ok", True),
    "vlm_mrope_with_1d_lm": (ERR, "ValueError", r"mrope=MRopeConfig given but the language model's rotary is 'rope'"),
    "vlm_mrope_lm_without_config": (ERR, "ValueError", r"pass PackedVLM\(mrope=MRopeConfig"),
    # media placement, per sample
    "image_placeholders_moved_to_another_sample": (ERR, "ValueError", r"row 0 has 1 image placeholder tokens, but the images of image_grid_thw in order give it 2"),
    "image_tokens_without_pixel_values": (ERR, "ValueError", r"input_ids hold 2 image placeholder tokens \(id 253\) in rows \[3\] but the batch has no pixel_values"),
    "image_tokens_loader_packed_with_another_image_id": (ERR, "ValueError", r"input_ids hold image placeholder tokens \(id 253\) but no image inputs"),
    "video_grid_one_frame_short": (ERR, "ValueError", r"row 0 has 4 video placeholder tokens, but the videos of video_grid_thw in order give it 2"),
    "audio_mask_with_a_hole": (ERR, "ValueError", r"feature_attention_mask rows must be right-padded .* bad row\(s\) \[0\].* holes at positions \[1\]"),
    "audio_clip_shorter_than_its_placeholders": (ERR, "ValueError", r"row 1 has 2 audio placeholder tokens, but the audios of feature_attention_mask in order give it 5"),
    "video_content_reaches_the_loss": ("ok", True),
    "audio_content_reaches_the_loss": ("ok", True),
    "all_media_packed_equals_each_sample_alone": ("ok", (True, True)),
    # packing off: pad_batch, the same checks and positions as packing
    "dense_left_padding": (ERR, "ValueError", r"attention_mask rows must be right-padded .* bad row\(s\) \[0, 1\].* left padding: first real token at position 2"),
    "dense_mask_with_a_hole": (ERR, "ValueError", r"attention_mask rows must be right-padded .* bad row\(s\) \[2\].* holes at positions \[3\]"),
    "dense_seq_length_shorter_than_a_row": (ERR, "ValueError", r"seq_length=4 is shorter than the longest row's 6 real tokens"),
    "dense_seq_lens_equal_the_attention_mask": ("ok", True),
    "dense_mrope_equals_packed_mrope": ("ok", True),
    "float_input_ids": (ERR, "ValueError", r"input_ids must hold integer token ids, got dtype torch.float32"),
    # options
    "pack_with_seq_length": (ERR, "ValueError", r"seq_length=16 is the dense row length"),
    "dense_with_pad_to": (ERR, "ValueError", r"pad_to=16 is the fixed packed length"),
    "bad_label_style": (ERR, "ValueError", r"label_style must be 'megatron' or 'hf', got 'shifted'"),
}


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(run_step_cases, 1)


def test_every_case_has_an_expectation():
    assert sorted(EXPECTED) == sorted(CASES) and len(CASES) >= 30


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_step_input(outcomes, name):
    got, want = outcomes[name], EXPECTED[name]
    if want[0] == "ok":
        assert got == want, got
    else:
        assert got[0] == ERR and got[1] == want[1], got
        assert re.search(want[2], got[2]), got[2]
