"""Qwen3-Omni `audio_seqlens` (raw audio lengths, read by the mRoPE index) against the audio placeholder
tokens of each row: clip k takes `audio_output_length(audio_seqlens[k])` tokens, whatever else the batch
holds. Before this check a batch with no image or video grid was never compared (the index walks its
blocks only beside grids), so a wrong length reached the model silently."""

import pytest
import torch

from megatron_vlm_packing import packing
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.rope.omni import audio_output_length

OMNI = MRopeConfig(family="qwen3_omni", image_token_id=9, video_token_id=8, vision_start_token_id=5,
                   audio_token_id=7, audio_start_token_id=6, mrope_section=(24, 20, 20), mrope_interleaved=True)
TEN, ONE = 10, 1  # raw lengths of 2 and 1 audio tokens (window 50)
assert int(audio_output_length(torch.tensor(TEN), 50)) == 2 and int(audio_output_length(torch.tensor(ONE), 50)) == 1


def _batch(rows, **extra):
    """Right-padded rows of ids (0 fills), labels = ids on real tokens."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([list(r) + [0] * (width - len(r)) for r in rows])
    keep = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "labels": torch.where(keep.bool(), ids, -100), "attention_mask": keep, **extra}


ONE_TOKEN = (1, 6, 7, 3, 4)  # an audio block of 1 placeholder
TWO_TOKENS = (1, 6, 7, 7, 3)  # an audio block of 2 placeholders
PACKERS = {"pack": packing.pack_batch, "pack_host": lambda b, **kw: packing.pack_batch(b, host_reads=True, **kw),
           "pad": packing.pad_batch}
_MISMATCH = (r"row 1 has 1 audio placeholder tokens, but the audios of audio_seqlens in order give it 2 "
             r"\(1 audio\(s\) 1..1")


def _features(*frames):
    width = max(frames)
    return {"input_features": torch.zeros(len(frames), 2, width),
            "feature_attention_mask": (torch.arange(width)[None] < torch.tensor(frames)[:, None]).long()}


CASES = {
    # audio lengths alone (a text model with mRoPE positions)
    "no_grids": (dict(audio_seqlens=torch.tensor([TEN, TEN])), _MISMATCH),
    # the features agree with the placeholders; audio_seqlens (what the positions read) does not
    "features_agree": (dict(audio_seqlens=torch.tensor([TEN, TEN]), **_features(TEN, ONE)), _MISMATCH),
    "empty_image_grid": (dict(audio_seqlens=torch.tensor([TEN, TEN]),
                              image_grid_thw=torch.zeros(0, 3, dtype=torch.long)), _MISMATCH),
    "clip_left_over": (dict(audio_seqlens=torch.tensor([TEN, ONE, ONE])),
                       r"audio_seqlens has 3 audio\(s\) but the rows' audio placeholders use only 2 \(3 placeholder"),
    "length_zero": (dict(audio_seqlens=torch.tensor([TEN, 0])),
                    r"audio_seqlens entry 1 is 0: raw audio lengths must be >= 1"),
    "float_lengths": (dict(audio_seqlens=torch.tensor([10.0, 1.5])),
                      r"audio_seqlens must hold integer raw audio lengths, got dtype torch.float32"),
    "list_of_floats": (dict(audio_seqlens=[10, 1.5]), r"audio_seqlens entry 1 is 1.5: raw audio lengths must be ints"),
}


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_audio_seqlens_disagreeing_with_the_placeholders_is_a_value_error(case, packer):
    extra, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        PACKERS[packer](_batch([TWO_TOKENS, ONE_TOKEN], **extra), label_style="hf", mrope=OMNI)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_audio_seqlens_that_agree_are_accepted_with_the_references_positions(packer):
    batch = _batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=torch.tensor([TEN, ONE]))
    expected = get_rope_index(batch["input_ids"], OMNI, attention_mask=batch["attention_mask"],
                              audio_seqlens=batch["audio_seqlens"]).position_ids
    given = {k: batch[k] for k in ("input_ids", "labels", "attention_mask")} | {"position_ids": expected}
    ours = PACKERS[packer](batch, label_style="hf", mrope=OMNI)
    assert torch.equal(ours.position_ids, PACKERS[packer](given, label_style="hf", position_layout="3BS").position_ids)


def test_audio_seqlens_without_an_audio_token_id_is_refused():
    """A position callable with no audio id known cannot count the clips: refused, not skipped."""
    batch = _batch([ONE_TOKEN], audio_seqlens=torch.tensor([ONE]))
    rope = lambda ids, attention_mask=None, audio_seqlens=None: get_rope_index(  # noqa: E731
        ids, OMNI, attention_mask=attention_mask, audio_seqlens=audio_seqlens)
    with pytest.raises(ValueError, match=r"the batch has audio_seqlens but no audio_token_id is known"):
        packing.pack_batch(batch, label_style="hf", mrope=rope)
    assert packing.pack_batch(batch, label_style="hf", mrope=rope, audio_token_id=7).position_ids.shape[0] == 3


def test_get_rope_index_checks_audio_seqlens_without_grids():
    ids = torch.tensor([ONE_TOKEN])
    with pytest.raises(ValueError, match=r"the audio block at input_ids row 0 position 2 has 1 placeholder tokens but "
                                         r"its grid / audio length needs 2"):
        get_rope_index(ids, OMNI, audio_seqlens=torch.tensor([TEN]))
    with pytest.raises(ValueError, match=r"2 blocks in input_ids use audio_seqlens, which has 3 entries"):
        get_rope_index(torch.tensor([TWO_TOKENS, ONE_TOKEN]), OMNI, audio_seqlens=torch.tensor([TEN, ONE, ONE]))
    text = get_rope_index(ids, OMNI, audio_seqlens=torch.tensor([ONE])).position_ids
    assert torch.equal(text, torch.arange(5.0).expand(3, 1, 5))  # audio runs are 1D: the text positions


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_audio_seqlens_disagreeing_with_the_feature_mask_is_a_value_error(packer):
    """Raw lengths 12 and 10 both give 2 audio tokens, so each input agrees with the placeholders;
    but the mRoPE index would read 12 and the audio tower 10 frames: refused, naming both."""
    assert int(audio_output_length(torch.tensor(12), 50)) == int(audio_output_length(torch.tensor(TEN), 50))
    batch = _batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=torch.tensor([12, ONE]), **_features(TEN, ONE))
    with pytest.raises(ValueError, match=r"audio 0: audio_seqlens\[0\] is 12 but feature_attention_mask\[0\] sums "
                                         r"to 10"):
        PACKERS[packer](batch, label_style="hf", mrope=OMNI)
    batch = _batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=[TEN, ONE], **_features(TEN, ONE))
    assert PACKERS[packer](batch, label_style="hf", mrope=OMNI).audio.audio_lengths == (TEN, ONE)


def test_audio_seqlens_and_feature_mask_with_different_clip_counts_are_refused():
    """Refused naming both inputs (before the mRoPE index, which would name only audio_seqlens)."""
    batch = _batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=torch.tensor([TEN, ONE, ONE]), **_features(TEN, ONE))
    rope = lambda ids, attention_mask=None, audio_seqlens=None: get_rope_index(  # noqa: E731
        ids, OMNI, attention_mask=attention_mask, audio_seqlens=audio_seqlens)
    with pytest.raises(ValueError, match=r"audio_seqlens has 3 entries but feature_attention_mask has 2 clips"):
        packing.pack_batch(batch, label_style="hf", mrope=rope, require_media_counts=False)


@pytest.mark.parametrize("packer", sorted(PACKERS) + ["get_rope_index"])
@pytest.mark.parametrize("seqlens, shown", [
    (10, "int 10"),  # a TypeError: 'int' object is not iterable
    (10.0, "float 10.0"),
    (b"\n", r"bytes b'\\n'"),  # iterated as [10]: one clip of 10 raw frames, silently
    ({10}, r"set \{10\}"),  # no order: clips matched to lengths in hash order
    ({10: 1}, r"dict \{10: 1\}"),  # its keys read as the lengths
    ("10", "str '10'"),
])
def test_audio_seqlens_that_is_no_sequence_of_lengths_is_named(packer, seqlens, shown):
    batch = _batch([TWO_TOKENS], audio_seqlens=seqlens)
    with pytest.raises(ValueError, match=rf"audio_seqlens must be \[A\], one raw length per audio clip \(an integer "
                                         rf"tensor, or a list or tuple of ints\), got {shown}"):
        if packer == "get_rope_index":
            get_rope_index(batch["input_ids"], OMNI, audio_seqlens=seqlens)
        else:
            PACKERS[packer](batch, label_style="hf", mrope=OMNI)
    for good in ([TEN], (TEN,), torch.tensor([TEN])):  # what it takes, as before
        PACKERS["pack"](_batch([TWO_TOKENS], audio_seqlens=good), label_style="hf", mrope=OMNI)
