"""The id written at pad slots is never a placeholder id of the media the micro-batch carries.

A model places each kind's embeddings at every token of its placeholder id; `PackedVLM` does so without a read of
its own when packing counted each sample's placeholders (`merge.place_checked_embeddings`), and packing counts the
real tokens only. With `pad_token_id` equal to a placeholder id, the pad slots before a placeholder (a dense row's
tail before the next row, a document's CP / SP alignment) took its embedding, and every placeholder after them the
next one: the real tokens' embeddings of a CP=2 pack off by up to 0.42, silently. The packers now refuse such a pad
id (`MediaTokens.refuse_pad_placeholder`), and the step, which pads with 0, pads with the smallest id that is no
placeholder of the model: a `PackedVLM` whose image id is 0 trained its dense rows to 444.867 instead of 444.751.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing import pack_batch, pad_batch
from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.testing.vlm_parity import DATA, MEDIA, ROPE

IDS = dict(image_token_id=MEDIA.image_token_id, video_token_id=MEDIA.video_token_id,
           audio_token_id=MEDIA.audio_token_id)
PACKERS = {
    "pack_batch": lambda pad, **ids: pack_batch(_batch(), label_style="hf", pad_to=80, pad_token_id=pad, **ids),
    "pack_batch cp=2": lambda pad, **ids: pack_batch(_batch(), label_style="hf", cp_size=2, pad_token_id=pad, **ids),
    "pad_batch": lambda pad, **ids: pad_batch(_batch(), label_style="hf", pad_token_id=pad, **ids),
    "collator": lambda pad, **ids: PackingCollator(label_style="hf", pad_to=80, pad_token_id=pad,
                                                   pack_options=ids)(_batch()),
}


def _batch() -> dict:
    return collate(synthetic_samples(4, seed=3, cfg=MEDIA))


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("kind", ["image", "video", "audio"])
def test_a_pad_id_that_is_a_placeholder_id_is_refused(packer, kind):
    pad = IDS[f"{kind}_token_id"]
    with pytest.raises(ValueError, match=rf"pad_token_id={pad} is also the {kind} placeholder id \({kind}_token_id="
                                         rf"{pad}\): the model would take every pad slot for a {kind} placeholder"):
        PACKERS[packer](pad, **IDS)


@pytest.mark.parametrize("packer", ["pack_batch", "pad_batch"])
def test_the_placeholder_ids_of_an_mrope_config_count_too(packer):
    packers = {"pack_batch": pack_batch, "pad_batch": pad_batch}
    batch = {key: value for key, value in _batch().items() if key not in ("input_features", "feature_attention_mask")}
    with pytest.raises(ValueError, match=rf"pad_token_id={ROPE.video_token_id} is also the video placeholder id"):
        packers[packer](batch, label_style="hf", mrope=ROPE, pad_token_id=ROPE.video_token_id)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_a_pad_id_clear_of_the_placeholders_still_packs(packer):
    micro_batch = PACKERS[packer](MEDIA.vision_start_id, **IDS)  # a special id, but no placeholder
    assert (micro_batch.input_ids[micro_batch.padding_mask] == MEDIA.vision_start_id).all()
    assert micro_batch.padding_mask.any()


def test_the_step_pads_clear_of_a_placeholder_id_0(single_process_megatron):
    """The same weights with image id 0 (the step's pad id before) and 253: the same loss, packed, dense, aligned."""
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.testing.step_models import step_loss
    from megatron_vlm_packing.testing.vlm_parity import LM, build_vlm

    batch = collate(synthetic_samples(4, seed=3, cfg=DATA))  # text ids 1 .. 252: 0 is free for the placeholder
    assert not (batch["input_ids"][batch["attention_mask"].bool()] == 0).any()
    zero = {key: torch.where(batch[key] == DATA.image_token_id, 0, batch[key]) for key in ("input_ids", "labels")}
    model = build_vlm(LM, 0)
    model_zero = PackedVLM(model.language_model, model.vision, image_token_id=0)
    seen = []
    for options in ({}, dict(pack=False), dict(pad_to=200)):
        expected = step_loss(model, batch, **options)
        got = step_loss(model_zero, batch | zero, transform=lambda mb: seen.append(mb) or mb, **options)
        assert got == pytest.approx(expected, rel=1e-6), options
        pads = seen[-1].padding_mask
        assert (seen[-1].input_ids[pads] == 1).all() and bool(pads.any()) == bool(options), options
