"""Bridge's dense Qwen3-Omni path pairs each row's audio placeholders with one clip (`zip(clips, rows,
strict=True)` in the thinker's `get_audio_features`): dense rows where one sample has a clip and another has none
failed inside Bridge with "zip() argument 2 is longer than argument 1". The Omni adapter refuses them, naming
the clips of each row, and runs rows that each hold one clip (refused too where the encoder lets the clips of one
call read each other: `bridge.audio_windows`)."""

import pytest

pytestmark = pytest.mark.bridge


@pytest.fixture(scope="module")
def omni(single_process_megatron):
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, omni_samples
    from megatron_vlm_packing.bridge.truth import build_family

    cfg = TinyOmniConfig()
    return build_family("qwen3_omni", cfg, seed=3), cfg, omni_samples(cfg, 4, seed=3)


def _dense_loss(omni, rows):
    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.bridge.build_omni import collate_omni

    model, cfg, samples = omni
    output, loss_func = make_forward_step(pack=False, label_style="hf", mrope=cfg.mrope_config())(
        iter([collate_omni([samples[i] for i in rows])]), model)
    return loss_func(output)[0]


def test_rows_without_a_clip_beside_rows_with_one_are_refused(omni):
    with pytest.raises(ValueError, match=r"exactly one audio clip in every row once any row has audio "
                                         r"\(audios_per_sample=\[1, 0\]\)"):
        _dense_loss(omni, [0, 2])  # sample 0: an image and a clip; sample 2: text only


def test_rows_that_each_hold_one_clip_run(omni):
    from megatron_vlm_packing.bridge.audio_windows import encoder_keeps_clips_apart

    if encoder_keeps_clips_apart(omni[0].thinker.audio_model):
        assert _dense_loss(omni, [0, 3]).isfinite()  # samples 0 and 3: one clip each
    else:  # transformers 5.8 (eager): Bridge's one encoder call of both clips would let each row read the other's
        with pytest.raises(ValueError, match=r"encodes the micro-batch's 2 audio clips in one call"):
            _dense_loss(omni, [0, 3])
