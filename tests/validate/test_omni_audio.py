"""The validator on Qwen3-Omni packs that hold audio: a real pack from `pack_batch` (audio-only,
image + video + audio, two images with two clips, and a video with its audio track) validates clean
against the model's own index, per document, from a `MicroBatch`, from a saved batch and from
keywords; a planted wrong position or swapped audio lengths is named; audio the index cannot be
asked about is said so, never passed.

Samples: `tests/models/test_packed_vlm_omni.py` (the Omni end-to-end test's mix), and for parity with
transformers' own Qwen3-Omni index, `tests/rope/test_omni.py`'s rows with audio in video.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.validate import validate_packed_batch
from megatron_vlm_packing.validate.saved import load_saved_batch

from tests.models.test_packed_vlm_omni import _audio_in_video_samples, _collate, _omni_cfg, _samples


def only(report, check):
    assert report.failed_checks == {check}, str(report)
    return report


@pytest.fixture(scope="module")
def omni():
    """(cfg, mrope config, packs): the four-sample mix at CP=2 and the audio-in-video trio at CP=1."""
    cfg = _omni_cfg()
    mrope = cfg.mrope_config()
    mix = pack_batch(_collate(_samples(cfg)), mrope=mrope, label_style="hf", cp_size=2)
    av = pack_batch(_collate(_audio_in_video_samples(cfg), audio_in_video=True), mrope=mrope, label_style="hf")
    return cfg, mrope, {"mix": mix, "audio_in_video": av}


def saved_fields(packed) -> dict:
    """The saved-batch keys (validate.saved_keys.SAVED_KEYS) of a packed micro-batch, as another packer writes them."""
    params, vision, audio = packed.packed_seq_params, packed.vision, packed.audio
    rows = packed.plan.segment_rows
    return dict(input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
                position_ids=packed.position_ids, padding_mask=packed.padding_mask,
                cu_seqlens=params.cu_seqlens_q, cu_seqlens_padded=params.cu_seqlens_q_padded,
                max_seqlen=params.max_seqlen_q, image_grid_thw=vision.image_grid_thw,
                video_grid_thw=vision.video_grid_thw, second_per_grid_ts=vision.second_per_grid_ts,
                audio_seqlens=torch.tensor(audio.audio_lengths),
                audios_per_document=[audio.audios_per_sample[r] for r in rows])


def audio_documents(packed, audio_token_id: int) -> list[int]:
    cu = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    ids = packed.input_ids[0]
    return [d for d in range(len(cu) - 1) if bool((ids[cu[d]:cu[d + 1]] == audio_token_id).any())]


def test_a_real_omni_pack_with_audio_validates_clean(omni, tmp_path):
    cfg, mrope, packs = omni
    audio_id = cfg.token_ids["audio_token_id"]
    for name, packed in packs.items():
        assert len(audio_documents(packed, audio_id)) >= 2, name  # audio in several documents
        report = validate_packed_batch(packed, mrope=mrope)
        assert report.ok, f"{name}: {report}"
        assert {"mrope_positions", "audio_placeholders", "vision_placeholders"} <= set(report.checked), name
        assert not [s for s in report.skipped if s[0] in ("mrope_positions", "audio_placeholders")], report
        path = tmp_path / f"{name}.pt"  # the same pack saved by another packer, read back by the CLI's loader
        torch.save({**saved_fields(packed), "audio_token_id": audio_id}, path)
        assert validate_packed_batch(load_saved_batch(path), mrope=mrope).ok, name
    # audio in video: the video's block holds both kinds, interleaved in one run
    ids = packs["audio_in_video"].input_ids[0]
    kinds = (ids == cfg.token_ids["video_token_id"]).long() - (ids == audio_id).long()
    assert bool((kinds[1:] * kinds[:-1] < 0).any())


def first_audio_slot(packed, audio_token_id: int, document: int) -> int:
    start = int(packed.packed_seq_params.cu_seqlens_q_padded[document])
    return start + int((packed.input_ids[0, start:] == audio_token_id).nonzero()[0])


def test_half_a_position_on_one_audio_token_is_named(omni):
    cfg, mrope, packs = omni
    audio_id = cfg.token_ids["audio_token_id"]
    for name, packed in packs.items():
        for document in audio_documents(packed, audio_id):
            positions = packed.position_ids.clone()
            slot = first_audio_slot(packed, audio_id, document) + 1  # inside the run, not the document's first
            positions[0, 0, slot] += 0.5
            report = only(validate_packed_batch(packed, mrope=mrope, position_ids=positions), "mrope_positions")
            assert report.violations[0].documents == (document,), (name, str(report))
            assert f"document {document} token" in str(report) and "where the model's index gives" in str(report)


def test_swapped_audio_lengths_are_named(omni):
    cfg, mrope, packs = omni
    packed = packs["mix"]
    lengths, per_row = list(packed.audio.audio_lengths), packed.audio.audios_per_sample
    assert len(lengths) >= 4 and per_row[MIX_AUDIO_ONLY] == 1
    # between documents: the audio-only sample's clip and the first clip of the next sample with audio
    first, second = 0, 1
    assert lengths[first] != lengths[second]
    swapped = list(lengths)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    report = only(validate_packed_batch(packed, mrope=mrope, audio_seqlens=torch.tensor(swapped)),
                  "audio_placeholders")
    assert "audio_seqlens" in str(report) and set(report.violations[0].documents) == {1, 2}, str(report)
    # within one document: the two clips of the images + audio sample (same total, other order)
    a, b = len(lengths) - 2, len(lengths) - 1
    assert lengths[a] != lengths[b]
    swapped = list(lengths)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    report = only(validate_packed_batch(packed, mrope=mrope, audio_seqlens=torch.tensor(swapped)),
                  "audio_placeholders")
    assert report.violations[0].documents == (3,) and "placeholder runs" in str(report), str(report)


def test_seconds_per_video_that_do_not_fit_the_videos_are_named(omni):
    cfg, mrope, packs = omni
    packed = packs["mix"]
    seconds = packed.vision.second_per_grid_ts
    assert seconds.numel() == 1
    report = only(validate_packed_batch(packed, mrope=mrope, second_per_grid_ts=torch.cat([seconds, seconds])),
                  "vision_placeholders")
    assert "second_per_grid_ts has 2 entries for 1 videos in video_grid_thw" in str(report)
    assert report.violations[0].documents == (2,), str(report)
    half = only(validate_packed_batch(packed, mrope=mrope, second_per_grid_ts=seconds * 2), "mrope_positions")
    assert half.violations[0].documents == (2,), str(half)  # the video's t positions step twice as far


MIX_AUDIO_ONLY = 1  # _samples: text_only, audio_only, image_video_audio, images_audio


def test_audio_the_index_cannot_be_asked_about_is_said_so(omni):
    cfg, mrope, packs = omni
    packed = packs["mix"]
    fields = saved_fields(packed)
    del fields["audio_seqlens"], fields["audios_per_document"]
    report = validate_packed_batch(fields, mrope=mrope)  # no lengths: not a violation, and not an OK in silence
    skipped = dict(report.skipped)
    assert "no audio_seqlens given" in skipped["audio_placeholders"]
    assert "documents [1, 2, 3]" in skipped["mrope_positions"] and "no audio_seqlens" in skipped["mrope_positions"]
    assert "not checked: mrope_positions (documents [1, 2, 3]" in str(report)

    def index_without_audio(input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None):
        from megatron_vlm_packing.rope import get_rope_index

        return get_rope_index(input_ids, mrope, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                              second_per_grid_ts=second_per_grid_ts)

    report = validate_packed_batch(packed, mrope=index_without_audio, audio_token_id=cfg.token_ids["audio_token_id"])
    assert "mrope_positions" in report.checked and "takes none of ['audio_seqlens']" in dict(report.skipped)[
        "mrope_positions"], str(report)
    report = validate_packed_batch(saved_fields(packed), mrope=index_without_audio)  # no id to split lengths by
    assert "no audio_token_id" in dict(report.skipped)["audio_placeholders"], str(report)
    assert "documents [0, 1, 2, 3]: audio_seqlens given but no audio_token_id" in str(report)


def test_parity_with_transformers_index_on_audio_in_video():
    """transformers' own Qwen3-Omni index as the validator's callable (seconds as `second_per_grids`,
    `use_audio_in_video` told per document) on a pack of `tests/rope/test_omni.py`'s rows."""
    pytest.importorskip("transformers.models.qwen3_omni_moe", reason="transformers without Qwen3-Omni")
    from megatron_vlm_packing.rope import MRopeConfig
    from tests.rope.test_omni import random_rows, thinker

    config, reference = thinker()
    ids, mask, images, videos, seconds, audios = random_rows(config, 3, 1, True)
    features = torch.zeros(len(audios), 2, int(audios.max()))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": mask, "image_grid_thw": images,
             "video_grid_thw": videos, "second_per_grid_ts": seconds, "use_audio_in_video": True,
             "pixel_values": torch.zeros(int(images.prod(1).sum()), 2),
             "pixel_values_videos": torch.zeros(int(videos.prod(1).sum()), 2), "input_features": features,
             "feature_attention_mask": (torch.arange(features.shape[2])[None] < audios[:, None]).long()}
    mrope = MRopeConfig.from_hf_config(config)
    packed = pack_batch(batch, mrope=mrope, cp_size=2, label_style="hf")
    ours = validate_packed_batch(packed, mrope=mrope)
    theirs = validate_packed_batch(packed, mrope=reference, image_token_id=config.image_token_id,
                                   video_token_id=config.video_token_id, audio_token_id=config.audio_token_id)
    for report in (ours, theirs):
        assert report.ok and "mrope_positions" in report.checked and not report.skipped[1:], str(report)
    positions = packed.position_ids.clone()
    slot = int((packed.input_ids[0] == config.audio_token_id).nonzero()[3])
    positions[0, 0, slot] += 0.5
    assert only(validate_packed_batch(packed, mrope=reference, position_ids=positions,
                                      image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                                      audio_token_id=config.audio_token_id), "mrope_positions")


@pytest.mark.parametrize("fields, words", [
    (dict(audio_seqlens=torch.tensor([95.0, 98.0, 20.0, 30.0])), "integer raw lengths"),
    (dict(audio_seqlens=torch.ones(2, 2, dtype=torch.long)), "integer raw lengths"),
    (dict(audio_seqlens=torch.tensor([0, 98, 20, 30])), "are < 1"),
    (dict(audio_seqlens=torch.tensor([], dtype=torch.long)), "does not fit 4 documents and 0 audios"),
    (dict(audios_per_document=[1, 1, 1, 1]), "(0, [], [7])"),
    (dict(audio_n_window=1), "audio_seqlens entries need"),
    # beyond int64 once doubled (the encoder's chunk): was an OverflowError in the tensor arithmetic
    (dict(audio_n_window=2**62), "audio_seqlens entries need"),
    (dict(audio_n_window=2**70), "audio_seqlens entries need"),
    (dict(audio_seqlens=torch.tensor([2**62, 98, 20, 30])), "audio_seqlens entries need"),
])
def test_bad_audio_inputs_are_named_not_raised(omni, fields, words):
    cfg, mrope, packs = omni
    # A window other than the config's contradicts it (below): bad windows are given without the config.
    report = only(validate_packed_batch(packs["mix"], mrope=None if "audio_n_window" in fields else mrope, **fields),
                  "audio_placeholders")
    assert words in str(report), str(report)


@pytest.mark.parametrize("name", ["audio_n_window", "audio_token_id", "spatial_merge_size"])
def test_a_value_contradicting_the_mrope_config_is_refused(omni, name):
    """Counted with one value and the index asked with the other, the report would blame the pack."""
    cfg, mrope, packs = omni
    other = getattr(mrope, name) + 1
    with pytest.raises(ValueError, match=rf"{name}={other} contradicts the mrope config's {name}="
                                         rf"{getattr(mrope, name)}"):
        validate_packed_batch(packs["mix"], mrope=mrope, **{name: other})
    assert validate_packed_batch(packs["mix"], mrope=mrope, **{name: getattr(mrope, name)}).ok


@pytest.mark.parametrize("result, named", [
    (lambda ids: torch.zeros(3, 1, 1), r"\(3, 1, 1\)"),  # compared by broadcasting: an IndexError, or a pass
    (lambda ids: torch.zeros(3, 1, ids.shape[-1] - 1), r"\(3, 1, \d+\)"),
    (lambda ids: [0] * 3, "list"),  # an AttributeError
])
def test_an_index_callable_giving_the_wrong_positions_is_named(omni, result, named):
    cfg, mrope, packs = omni

    def index(input_ids, **kwargs):
        return result(input_ids)

    report = only(validate_packed_batch(packs["mix"], mrope=index), "mrope_index")
    assert len(report.violations) == 1 and "the mrope callable" in str(report), str(report)
    assert re.search(r"gave " + named + r" for \d+ tokens, not \[3, 1, \d+\] positions", str(report)), str(report)
    assert [why for check, why in report.skipped if check == "mrope_positions"], str(report)


def test_an_index_callable_without_a_readable_signature_is_given_every_input(omni):
    """inspect.signature raises ValueError for a builtin or extension callable: that escaped
    validate_packed_batch ('no signature found'); such an index is now called with every input."""
    from megatron_vlm_packing.rope import get_rope_index

    cfg, mrope, packs = omni

    class Opaque:  # as a C-implemented index: no signature to read
        @property
        def __signature__(self):
            raise ValueError("no signature found for builtin")

        def __call__(self, input_ids, **kwargs):
            return get_rope_index(input_ids, mrope, **kwargs)

    report = validate_packed_batch(packs["mix"], mrope=Opaque())
    assert report.ok and "mrope_positions" in report.checked, str(report)
    assert not [s for s in report.skipped if s[0] == "mrope_positions"], report
