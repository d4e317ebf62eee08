"""Bad or unusual inputs through the mRoPE index, `MRopeConfig` and the CLI: each gives the exact
error (field and numbers) or the exact correct result.

Every case here failed on bd042f6: negative / zero grids and NaN seconds gave garbage positions or
unclear errors, a Qwen3-Omni block one token short of its grid was silently mis-positioned,
transformers' own default configs were refused (no mrope_section) or got vision_start_token_id -1,
and `demo --steps -1` exited 0.
"""

import pytest
import torch

from megatron_vlm_packing.cli import main
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

transformers = pytest.importorskip("transformers")

QWEN2 = MRopeConfig(family="qwen2_vl", image_token_id=9, video_token_id=8)
QWEN25 = MRopeConfig(family="qwen2_5_vl", image_token_id=9, video_token_id=8, tokens_per_second=2.0)
OMNI = MRopeConfig(family="qwen3_omni", image_token_id=9, video_token_id=8, vision_start_token_id=5,
                   audio_token_id=7, audio_start_token_id=6, mrope_section=(24, 20, 20), mrope_interleaved=True)
IMAGE_ROW = torch.tensor([[1, 9, 9, 2]])  # one image of grid [1, 2, 4] (2 placeholders)
VIDEO_ROW = torch.tensor([[1, 8, 8, 2]])  # one video of grid [1, 2, 4]


def omni_row(body):
    """[1, L] ids: text, one block opened by `body[0]` (start id), its placeholders, an end id, text."""
    return torch.tensor([[1, *body, 3, 4]])


ERRORS = [
    ("negative_grid", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1, -2, 4]])),
     r"image_grid_thw row 0 is \[1, -2, 4\]: t, h, w must be >= 1 and h, w multiples of spatial_merge_size=2"),
    ("zero_grid", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[0, 2, 4]])),
     r"image_grid_thw row 0 is \[0, 2, 4\]"),
    ("grid_not_a_multiple_of_merge", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1, 3, 4]])),
     r"image_grid_thw row 0 is \[1, 3, 4\]: .*multiples of spatial_merge_size=2"),
    ("negative_video_grid", lambda: get_rope_index(VIDEO_ROW, QWEN2, video_grid_thw=torch.tensor([[-1, 2, 4]])),
     r"video_grid_thw row 0 is \[-1, 2, 4\]"),
    ("float_grid", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1.0, 2.0, 4.0]])),
     r"image_grid_thw must be a \[N, 3\] integer tensor, got shape \(1, 3\) torch\.float32"),
    ("grid_as_list", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=[[1, 2, 4]]),
     r"image_grid_thw must be a \[N, 3\] integer tensor, got list"),
    ("nan_seconds", lambda: get_rope_index(VIDEO_ROW, QWEN25, video_grid_thw=torch.tensor([[1, 2, 4]]),
                                           second_per_grid_ts=torch.tensor([float("nan")])),
     r"second_per_grid_ts entry 0 is nan: seconds per grid step must be finite and >= 0"),
    ("negative_seconds", lambda: get_rope_index(VIDEO_ROW, QWEN25, video_grid_thw=torch.tensor([[1, 2, 4]]),
                                                second_per_grid_ts=[-0.5]),
     r"second_per_grid_ts entry 0 is -0\.5"),
    ("infinite_seconds", lambda: get_rope_index(VIDEO_ROW, QWEN25, video_grid_thw=torch.tensor([[1, 2, 4]]),
                                                second_per_grid_ts=torch.tensor([float("inf")], dtype=torch.float64)),
     r"second_per_grid_ts entry 0 is inf"),
    ("float_input_ids", lambda: get_rope_index(IMAGE_ROW.float(), QWEN2, image_grid_thw=torch.tensor([[1, 2, 4]])),
     r"input_ids must be a \[B, S\] integer tensor, got \(1, 4\) torch\.float32"),
    # complex ids were read as positions (complex mRoPE ids came back) before the shared integer check
    ("complex_input_ids", lambda: get_rope_index(IMAGE_ROW.to(torch.complex64), QWEN2,
                                                 image_grid_thw=torch.tensor([[1, 2, 4]])),
     r"input_ids must be a \[B, S\] integer tensor, got \(1, 4\) torch\.complex64"),
    ("mask_shape", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1, 2, 4]]),
                                          attention_mask=torch.ones(1, 3)),
     r"attention_mask must be \[B, S\] = \(1, 4\) like input_ids, got \(1, 3\)"),
    ("config_not_an_mrope_config", lambda: get_rope_index(IMAGE_ROW, {"family": "qwen2_vl"}),
     r"config must be an MRopeConfig, got dict"),
    # mm_token_type_ids (transformers 5 processors return it): a [B, S] tensor of 0 / 1 / 2 on kept tokens.
    # Before the rope audit another shape was an IndexError, a list an AttributeError, -1 silently text
    # and 3 "a video block with grid [0, 0, 0]"
    ("types_shorter_than_ids", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1, 2, 4]]),
                                                      mm_token_type_ids=torch.tensor([[0, 1, 1]])),
     r"mm_token_type_ids must be a \[B, S\] = \(1, 4\) tensor like input_ids, got \(1, 3\)"),
    ("types_as_list", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1, 2, 4]]),
                                             mm_token_type_ids=[[0, 1, 1, 0]]),
     r"mm_token_type_ids must be a \[B, S\] = \(1, 4\) tensor like input_ids, got list"),
    ("types_minus_one", lambda: get_rope_index(IMAGE_ROW, QWEN2, image_grid_thw=torch.tensor([[1, 2, 4]]),
                                               mm_token_type_ids=torch.tensor([[0, 1, 1, -1]])),
     r"mm_token_type_ids row 0 position 3 is -1: token types must be 0 \(text\), 1 \(image\) or 2 \(video\)"),
    ("types_three", lambda: get_rope_index(IMAGE_ROW, QWEN25, image_grid_thw=torch.tensor([[1, 2, 4]]),
                                           mm_token_type_ids=torch.tensor([[3, 1, 1, 0]])),
     r"mm_token_type_ids row 0 position 0 is 3: token types must be 0"),
    # Qwen3-Omni blocks must hold exactly the placeholders their grid / audio length needs
    ("omni_image_block_one_token_short",
     lambda: get_rope_index(omni_row([5, 9, 9, 9]), OMNI, image_grid_thw=torch.tensor([[1, 4, 4]])),
     r"the image block at input_ids row 0 position 2 has 3 placeholder tokens but its grid / audio length needs 4"),
    ("omni_image_block_one_token_long",
     lambda: get_rope_index(omni_row([5, 9, 9, 9]), OMNI, image_grid_thw=torch.tensor([[1, 2, 4]])),
     r"the image block at input_ids row 0 position 2 has 3 placeholder tokens but its grid / audio length needs 2"),
    ("omni_video_block_short",
     lambda: get_rope_index(omni_row([5, 8]), OMNI, video_grid_thw=torch.tensor([[1, 2, 4]]),
                            second_per_grid_ts=torch.tensor([1.0])),
     r"the video block at input_ids row 0 position 2 has 1 placeholder tokens but its grid / audio length needs 2"),
    ("omni_audio_block_short",
     lambda: get_rope_index(omni_row([6, 7]), OMNI, image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
                            audio_seqlens=torch.tensor([10])),
     r"the audio block at input_ids row 0 position 2 has 1 placeholder tokens but its grid / audio length needs 2"),
    ("omni_nan_seconds",
     lambda: get_rope_index(omni_row([5, 8, 8]), OMNI, video_grid_thw=torch.tensor([[1, 2, 4]]),
                            second_per_grid_ts=torch.tensor([float("nan")])),
     r"second_per_grid_ts entry 0 is nan"),
    # Qwen3-Omni: a vision-start as a row's last kept token, and a raw audio length < 1 (0 output
    # tokens), were an IndexError / RuntimeError (the reference's own errors) before the rope audit
    ("omni_vision_start_last_token",
     lambda: get_rope_index(torch.tensor([[1, 2, 5]]), OMNI, image_grid_thw=torch.zeros(0, 3, dtype=torch.long)),
     r"input_ids row 0 position 2 is a vision_start_token_id \(5\) with no image or video placeholder after it"),
    ("omni_vision_start_last_kept_token_after_an_image",
     lambda: get_rope_index(torch.tensor([[5, 9, 9, 3, 5, 0]]), OMNI, image_grid_thw=torch.tensor([[1, 2, 4]]),
                            attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]])),
     r"input_ids row 0 position 4 is a vision_start_token_id \(5\)"),
    ("omni_audio_length_zero",
     lambda: get_rope_index(omni_row([6]), OMNI, image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
                            audio_seqlens=torch.tensor([0])),
     r"audio_seqlens entry 0 is 0: raw audio lengths must be >= 1 \(the audio block opening at input_ids row 0 "
     r"position 1\)"),
    ("omni_audio_length_negative_in_video",
     lambda: get_rope_index(omni_row([5, 6, 8, 8]), OMNI, video_grid_thw=torch.tensor([[1, 2, 4]]),
                            second_per_grid_ts=torch.tensor([1.0]), audio_seqlens=torch.tensor([-3])),
     r"audio_seqlens entry 0 is -3: raw audio lengths must be >= 1"),
    # MRopeConfig
    ("config_zero_section", lambda: MRopeConfig(family="qwen2_vl", mrope_section=(16, 0, 24)),
     r"mrope_section must be 3 positive ints, got \(16, 0, 24\)"),
    ("config_negative_image_id", lambda: MRopeConfig(family="qwen2_vl", image_token_id=-1),
     r"image_token_id must be a non-negative int, got -1"),
    ("config_nan_tokens_per_second", lambda: MRopeConfig(family="qwen2_5_vl", tokens_per_second=float("nan")),
     r"tokens_per_second must be a finite number > 0, got nan"),
    # counts computed from these: 0 / 2.0 were a ZeroDivisionError / TypeError at the first block, -1 wrong counts
    ("config_zero_audio_window", lambda: MRopeConfig(family="qwen3_omni", audio_n_window=0),
     r"audio_n_window must be a positive int, got 0"),
    ("config_float_merge", lambda: MRopeConfig(family="qwen2_vl", spatial_merge_size=2.0),
     r"spatial_merge_size must be a positive int, got 2\.0"),
    ("config_bool_merge", lambda: MRopeConfig(family="qwen2_vl", spatial_merge_size=True),
     r"spatial_merge_size must be a positive int, got True"),
    ("config_negative_audio_start", lambda: MRopeConfig(family="qwen3_omni", audio_start_token_id=-1),
     r"audio_start_token_id must be None or a non-negative int, got -1"),
    ("config_zero_position_per_seconds", lambda: MRopeConfig(family="qwen3_omni", position_id_per_seconds=0),
     r"position_id_per_seconds must be a finite number > 0, got 0"),
    # each was accepted and read as a number / truth value (a string "no" interleaved, True a rate of 1), or a
    # TypeError from comparing None / a str with 1
    ("config_str_interleaved", lambda: MRopeConfig(family="qwen2_vl", mrope_interleaved="no"),
     r"mrope_interleaved must be True or False, got 'no'"),
    ("config_bool_tokens_per_second", lambda: MRopeConfig(family="qwen2_5_vl", tokens_per_second=True),
     r"tokens_per_second must be a finite number > 0, got True"),
    ("config_bool_position_per_seconds", lambda: MRopeConfig(family="qwen3_omni", position_id_per_seconds=True),
     r"position_id_per_seconds must be a finite number > 0, got True"),
    ("config_str_merge", lambda: MRopeConfig(family="qwen2_vl", spatial_merge_size="2"),
     r"spatial_merge_size must be a positive int, got '2'"),
    ("config_none_section", lambda: MRopeConfig(family="qwen2_vl", mrope_section=None),
     r"mrope_section must be 3 positive ints, got None"),
]


@pytest.mark.parametrize("name, call, message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_rope_input_is_a_value_error_naming_field_and_numbers(name, call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("host_reads", [False, True])
@pytest.mark.parametrize("ids, rope, message", [
    ([[1, 2, 5]], dict(image_grid_thw=torch.zeros(0, 3, dtype=torch.long)),
     r"input_ids row 0 position 2 is a vision_start_token_id \(5\) with no image or video placeholder"),
    ([[1, 6, 3, 4]], dict(image_grid_thw=torch.zeros(0, 3, dtype=torch.long), audio_seqlens=torch.tensor([0])),
     r"audio_seqlens entry 0 is 0: raw audio lengths must be >= 1"),
], ids=["vision_start_last", "audio_length_zero"])
def test_pack_batch_omni_bad_blocks_are_the_index_value_errors_on_both_read_paths(ids, rope, message, host_reads):
    from megatron_vlm_packing import pack_batch

    ids = torch.tensor(ids)
    with pytest.raises(ValueError, match=message):
        pack_batch({"input_ids": ids, "labels": ids, **rope}, label_style="hf", mrope=OMNI, host_reads=host_reads)


@pytest.mark.parametrize("host_reads", [False, True])
@pytest.mark.parametrize("types, message", [
    (torch.tensor([[0, 1, 1]]), r"mm_token_type_ids must be a \[B, S\] = \(1, 4\) tensor like input_ids, got \(1, 3\)"),
    (torch.tensor([[0, 1, 1, 3]]), r"mm_token_type_ids row 0 position 3 is 3: token types must be 0"),
], ids=["shape", "value"])
def test_pack_batch_bad_mm_token_type_ids_are_value_errors_on_both_read_paths(types, message, host_reads):
    from megatron_vlm_packing import pack_batch

    batch = {"input_ids": IMAGE_ROW, "labels": IMAGE_ROW, "image_grid_thw": torch.tensor([[1, 2, 4]]),
             "mm_token_type_ids": types}
    with pytest.raises(ValueError, match=message):
        pack_batch(batch, label_style="hf", mrope=QWEN2, host_reads=host_reads)


@pytest.mark.parametrize("config_name, section, interleaved", [
    ("Qwen2VLConfig", (16, 24, 24), False),
    ("Qwen2_5_VLConfig", (16, 24, 24), False),
    ("Qwen3VLConfig", (24, 20, 20), True),
    ("Qwen3OmniMoeConfig", (24, 20, 20), True),
])
def test_transformers_default_configs_are_read_with_transformers_default_sections(config_name, section, interleaved):
    config = getattr(transformers, config_name)()
    ours = MRopeConfig.from_hf_config(config)
    assert ours.mrope_section == section and ours.mrope_interleaved is interleaved
    assert ours.vision_start_token_id == 151652 and ours.image_token_id == 151655


def _qwen25(**edits):
    config = transformers.Qwen2_5_VLConfig()
    for path, value in edits.items():
        *owners, name = path.split("__")
        target = config
        for owner in owners:
            target = getattr(target, owner)
        fields = target if isinstance(target, dict) else vars(target)  # past transformers' strict setattr
        if value is _DELETE:
            del fields[name]
        else:
            fields[name] = value
    return config


_DELETE = object()
_SECTION = "text_config__rope_parameters__mrope_section"


@pytest.mark.parametrize("edits, message", [
    # silently wrong before: int() / float() / bool() truncated or coerced each of these
    ({"vision_config__spatial_merge_size": 2.5}, r"vision_config.spatial_merge_size must be an int, got 2\.5"),
    ({"vision_config__spatial_merge_size": True}, r"vision_config.spatial_merge_size must be an int, got True"),
    ({"vision_config__spatial_merge_size": "2"}, r"vision_config.spatial_merge_size must be an int, got '2'"),
    ({"image_token_id": 151655.5}, r"image_token_id must be an int, got 151655\.5"),
    ({"image_token_id": True}, r"image_token_id must be an int, got True"),
    ({"vision_start_token_id": 1.5}, r"vision_start_token_id must be an int, got 1\.5"),
    ({"vision_config__tokens_per_second": 0}, r"tokens_per_second must be a finite number > 0, got 0"),
    ({"vision_config__tokens_per_second": "2"}, r"vision_config.tokens_per_second must be a number, got '2'"),
    ({"vision_config__tokens_per_second": True}, r"vision_config.tokens_per_second must be a number, got True"),
    ({_SECTION: [16.5, 24, 24]}, r"mrope_section entry 0 must be an int, got 16\.5"),
    ({_SECTION: ["16", "24", "24"]}, r"mrope_section entry 0 must be an int, got '16'"),
    ({_SECTION: [True, 24, 24]}, r"mrope_section entry 0 must be an int, got True"),
    ({_SECTION: "162"}, r"mrope_section must be a list of 3 ints, got '162'"),
    ({_SECTION: []}, r"mrope_section must be a list of 3 ints, got \[\]"),
    ({"text_config__rope_parameters__mrope_interleaved": "false"},
     r"mrope_interleaved must be true or false, got 'false'"),
    ({"position_id_per_seconds": True}, r"position_id_per_seconds must be a number, got True"),
    ({"position_id_per_seconds": "25"}, r"position_id_per_seconds must be a number, got '25'"),
    # read as 1.0 before: video t positions transformers' own index never computes (it fails on null)
    ({"vision_config__tokens_per_second": None}, r"vision_config.tokens_per_second is null or missing"),
    # AttributeError / TypeError before
    ({"text_config__rope_parameters": "x"}, r"rope_parameters must be a dict, got 'x'"),
    ({"vision_config__spatial_merge_size": None}, r"vision_config.spatial_merge_size must be an int, got None"),
    ({"image_token_id": None}, r"image_token_id must be an int, got None"),
], ids=lambda v: repr(v)[:40] if isinstance(v, dict) else "")
def test_from_hf_config_refuses_odd_fields_naming_them(edits, message):
    with pytest.raises(ValueError, match=message):
        MRopeConfig.from_hf_config(_qwen25(**edits))


def test_from_hf_config_keeps_integral_float_ids_and_refuses_configs_without_parts():
    ours = MRopeConfig.from_hf_config(_qwen25(vision_config__spatial_merge_size=2.0, image_token_id=151655.0))
    assert (ours.spatial_merge_size, ours.image_token_id) == (2, 151655)
    assert ours.tokens_per_second == 4.0 and isinstance(ours.tokens_per_second, float)
    with pytest.raises(ValueError, match=r"hf_config has no vision_config"):
        MRopeConfig.from_hf_config(_qwen25(vision_config=_DELETE))
    with pytest.raises(ValueError, match=r"model_type \['x'\]"):
        MRopeConfig.from_hf_config(_qwen25(model_type=["x"]))
    omni = transformers.Qwen3OmniMoeConfig()
    del vars(omni)["thinker_config"]
    with pytest.raises(ValueError, match=r"hf_config of model_type 'qwen3_omni_moe' has no thinker_config"):
        MRopeConfig.from_hf_config(omni)


def test_default_omni_thinker_never_gets_vision_start_minus_one():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    ours = MRopeConfig.from_hf_config(Qwen3OmniMoeThinkerConfig())
    assert ours.family == "qwen3_omni" and ours.vision_start_token_id == 151652
    assert (ours.audio_token_id, ours.audio_start_token_id) == (151646, 151647)


@pytest.mark.parametrize("argv, message", [
    (["demo", "--steps", "-1"], "--steps must be >= 1, got -1"),
    (["demo", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["demo", "--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["demo", "--tp", "-2"], "--tp must be >= 1, got -2"),
])
def test_cli_demo_refuses_non_positive_counts_with_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "5,3", "--cp", "0"], "argument --cp: must be a positive int (>= 1), got 0"),
    (["inspect", "5,3", "--seq", "0"], "argument --seq: must be a positive int (>= 1), got 0"),
    (["inspect", "5,3", "--tp", "-1"], "argument --tp: must be a positive int (>= 1), got -1"),
])
def test_cli_inspect_refuses_non_positive_counts_with_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)])
@pytest.mark.parametrize("grids", [{}, {"image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}], ids=["no_grids", "grids"])
@pytest.mark.parametrize("config", [QWEN2, OMNI], ids=["qwen2_vl", "qwen3_omni"])
def test_an_index_of_no_tokens_is_empty_in_every_family(config, grids, shape):
    """Qwen3-Omni's was an IndexError (a max over no columns) or a RuntimeError (a stack of no rows)."""
    index = get_rope_index(torch.zeros(shape, dtype=torch.long), config, **grids)
    assert index.position_ids.shape == (3, *shape) and index.deltas.shape == (shape[0], 1)


def test_from_hf_config_reads_no_tokens_per_second_for_families_without_one():
    """Qwen2-VL's videos step by 1: its config has no tokens_per_second, and none is needed."""
    qwen2 = transformers.Qwen2VLConfig()
    assert getattr(qwen2.vision_config, "tokens_per_second", None) is None
    assert MRopeConfig.from_hf_config(qwen2).tokens_per_second == 1.0
