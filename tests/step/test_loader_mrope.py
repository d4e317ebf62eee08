"""A micro-batch packed in the DataLoader with mRoPE positions reaches the step with the `MRopeConfig` that
made them (`MicroBatch.mrope_config`), and the step compares it with the model's (`make_forward_step(mrope=)`,
else the adapter's: `PackedVLM(mrope=)`, the Bridge adapters'). Before, a collator built with another config
(another merge size, tokens_per_second, placeholder ids, text offset, family) trained with wrong positions
silently, and `make_forward_step(mrope=X)` was unused for loader-packed micro-batches.

Real Megatron-Core models (tiny, CPU, one process): a GPTModel with mRoPE and a `PackedVLM` with a vision tower.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch

from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.packing import pad_batch
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.rope.config import POSITION_FIELDS
from megatron_vlm_packing.train.step import make_forward_step

DATA = SyntheticVLMConfig(max_text=12, max_images=2, grid_choices=(2, 4))
# The model's config of each family; text ids of the batches are 1..100, so no id below is a text token.
MODEL_ROPE = {
    "qwen2_vl": MRopeConfig(family="qwen2_vl", image_token_id=DATA.image_token_id, video_token_id=DATA.vocab_size + 1,
                            vision_start_token_id=DATA.vision_start_id, mrope_section=(1, 1, 2)),
    "qwen2_5_vl": MRopeConfig(family="qwen2_5_vl", image_token_id=DATA.image_token_id, video_token_id=230,
                              tokens_per_second=2.0, mrope_section=(1, 1, 2)),
    "qwen3_vl": MRopeConfig(family="qwen3_vl", image_token_id=DATA.image_token_id, video_token_id=230,
                            mrope_section=(1, 1, 2), mrope_interleaved=True),
    "qwen3_omni": MRopeConfig(family="qwen3_omni", image_token_id=DATA.image_token_id, video_token_id=230,
                              vision_start_token_id=231, audio_token_id=232, audio_start_token_id=233,
                              mrope_section=(1, 1, 2), mrope_interleaved=True),
}
# Another valid value of each field that makes positions (ids: none a text id, none another field's).
OTHER = dict(spatial_merge_size=4, image_token_id=240, video_token_id=241, vision_start_token_id=242,
             audio_token_id=243, audio_start_token_id=244, position_id_per_seconds=12.5, audio_n_window=20,
             tokens_per_second=1.0, text_offset="max_position")
OTHER_FAMILY = {"qwen2_vl": "qwen2_5_vl", "qwen2_5_vl": "qwen3_vl", "qwen3_vl": "qwen2_vl", "qwen3_omni": "qwen2_vl"}
FIELD_CASES = [(family, name) for family, names in POSITION_FIELDS.items() for name in names]


def _other(config: MRopeConfig, name: str) -> MRopeConfig:
    return dataclasses.replace(config, **{name: OTHER_FAMILY[config.family] if name == "family" else OTHER[name]})


def _text_batch(seed: int = 0) -> dict:
    """Three right-padded text rows (ids 1..100): every family's index gives them positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 101, (3, 10), generator=g)
    mask = torch.zeros(3, 10, dtype=torch.long)
    for row, length in enumerate((10, 7, 4)):
        mask[row, :length] = 1
    return {"input_ids": ids * mask, "labels": ids * mask, "attention_mask": mask}


def _image_batch(seed: int = 3) -> dict:
    return collate(synthetic_samples(4, seed=seed, cfg=DATA))


@pytest.fixture(scope="module")
def models(single_process_megatron):
    """{"gpt": an mRoPE GPTModel (the step's `mrope=` is what it has), "vlm": a PackedVLM with a vision tower
    and the qwen2_vl config}."""
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.models.vision import TinyVisionTower
    from megatron_vlm_packing.rope import use_packed_mrope

    config = TinyGPTConfig(vocab_size=DATA.vocab_size, position_embedding_type="mrope", mrope_section=(1, 1, 2))
    torch.manual_seed(0)
    gpt = build_tiny_gpt(config, scatter_embedding_sequence_parallel=False)
    use_packed_mrope(gpt)
    torch.manual_seed(1)
    tower = TinyVisionTower(patch_features=DATA.patch_features, width=16, out_hidden=config.hidden_size, heads=2)
    vlm = PackedVLM(build_tiny_gpt(config, scatter_embedding_sequence_parallel=False), tower,
                    image_token_id=DATA.image_token_id, mrope=MODEL_ROPE["qwen2_vl"])
    return {"gpt": gpt, "vlm": vlm}


def _loss(step, model, item) -> torch.Tensor:
    output, loss_fn = step(iter([item]), model)
    return loss_fn(output)[0].detach()


def _named(name: str, made, model) -> str:
    return re.escape(f"{name}={made!r} where the model's is {model!r}")


@pytest.mark.parametrize("family, name", FIELD_CASES, ids=[f"{f}-{n}" for f, n in FIELD_CASES])
def test_a_loader_micro_batch_made_with_another_value_of_a_position_field_is_refused(models, family, name):
    model_rope = MODEL_ROPE[family]
    made_with = _other(model_rope, name)
    packed = PackingCollator(label_style="hf", mrope=made_with)(_text_batch())
    assert packed.mrope_config == made_with
    step = make_forward_step(label_style="hf", mrope=model_rope)
    with pytest.raises(ValueError, match=_named(name, getattr(made_with, name), getattr(model_rope, name))) as error:
        _loss(step, models["gpt"], packed)
    assert "make_forward_step(mrope=...)" in str(error.value) and "PackingCollator" in str(error.value)


def test_every_differing_field_is_named_with_both_values(models):
    model_rope = MODEL_ROPE["qwen2_5_vl"]
    made_with = dataclasses.replace(model_rope, spatial_merge_size=4, tokens_per_second=1.0, text_offset="max_position",
                                    mrope_section=(2, 1, 1))  # the rotary's layout: not compared
    packed = PackingCollator(label_style="hf", mrope=made_with)(_text_batch())
    with pytest.raises(ValueError) as error:
        _loss(make_forward_step(label_style="hf", mrope=model_rope), models["gpt"], packed)
    message = str(error.value)
    for name in ("spatial_merge_size", "tokens_per_second", "text_offset"):
        assert re.search(_named(name, getattr(made_with, name), getattr(model_rope, name)), message), name
    assert "mrope_section" not in message


def test_the_models_own_config_is_compared_when_the_step_has_none(models):
    """PackedVLM(mrope=X), make_forward_step() without mrope=: a collator built with Y is refused (adapter.mrope)."""
    made_with = _other(MODEL_ROPE["qwen2_vl"], "spatial_merge_size")
    packed = PackingCollator(label_style="hf", mrope=made_with)(_text_batch())
    with pytest.raises(ValueError, match=_named("spatial_merge_size", 4, 2)) as error:
        _loss(make_forward_step(label_style="hf"), models["vlm"], packed)
    assert "PackedVLM's" in str(error.value)


def test_the_steps_mrope_is_used_for_loader_micro_batches_too(models):
    """make_forward_step(mrope=X) on a PackedVLM whose own config is Y: a loader micro-batch made with Y (the
    model's) is refused, since X is what the step packs with; one made with X passes."""
    step_rope = _other(MODEL_ROPE["qwen2_vl"], "text_offset")
    step = make_forward_step(label_style="hf", mrope=step_rope)
    with pytest.raises(ValueError, match=_named("text_offset", "max_hw", "max_position")):
        _loss(step, models["vlm"], PackingCollator(label_style="hf", mrope=MODEL_ROPE["qwen2_vl"])(_image_batch()))
    batch = _image_batch()
    assert torch.allclose(_loss(step, models["vlm"], PackingCollator(label_style="hf", mrope=step_rope)(batch)),
                          _loss(step, models["vlm"], batch), rtol=1e-6, atol=1e-6)


def test_the_matching_config_passes_and_trains_as_the_step_packing_does(models):
    """Images, positions from the model's config: the loader micro-batch's loss is the step packing's, and the
    record changes nothing but the check (the same micro-batch without it gives the same loss)."""
    step = make_forward_step(label_style="hf")
    batch = _image_batch()
    packed = PackingCollator(label_style="hf", mrope=MODEL_ROPE["qwen2_vl"])(batch)
    assert packed.mrope_config is MODEL_ROPE["qwen2_vl"]
    loader = _loss(step, models["vlm"], packed)
    assert torch.equal(loader, _loss(step, models["vlm"], dataclasses.replace(packed, mrope_config=None)))
    assert torch.allclose(loader, _loss(step, models["vlm"], batch), rtol=1e-6, atol=1e-6)


def test_fields_that_make_no_position_are_not_compared(models):
    """The rotary's layout (mrope_section, mrope_interleaved) and fields the family's index never reads
    (a qwen2_vl config's vision_start_token_id, audio ids, tokens_per_second) may differ: same positions."""
    model_rope = MODEL_ROPE["qwen2_vl"]
    made_with = dataclasses.replace(model_rope, mrope_section=(2, 1, 1), mrope_interleaved=True,
                                    vision_start_token_id=7, audio_token_id=243, tokens_per_second=3.0,
                                    position_id_per_seconds=12.5, audio_n_window=20)
    step = make_forward_step(label_style="hf")
    batch = _image_batch()
    other = PackingCollator(label_style="hf", mrope=made_with)(batch)
    same = PackingCollator(label_style="hf", mrope=model_rope)(batch)
    assert torch.equal(other.position_ids, same.position_ids)
    assert torch.equal(_loss(step, models["vlm"], other), _loss(step, models["vlm"], same))


def test_positions_with_no_record_are_accepted_as_before(models):
    """3D positions given in the batch, or made by a callable, carry no config (`mrope_config` None): nothing to
    compare, taken as they are (even when made with another config: the step cannot tell)."""
    batch = _image_batch()
    other = _other(MODEL_ROPE["qwen2_vl"], "text_offset")
    given = dict(batch, position_ids=get_rope_index(batch["input_ids"], other, image_grid_thw=batch["image_grid_thw"],
                                                    attention_mask=batch["attention_mask"]).position_ids)
    by_callable = functools.partial(get_rope_index, config=other)
    step = make_forward_step(label_style="hf")
    ids = dict(image_token_id=DATA.image_token_id)
    for packed in (PackingCollator(label_style="hf", pack_options=ids)(given),
                   PackingCollator(label_style="hf", mrope=by_callable, pack_options=ids)(batch)):
        assert packed.position_ids.dim() == 3 and packed.mrope_config is None
        assert torch.isfinite(_loss(step, models["vlm"], packed))


def test_a_dense_micro_batch_made_with_another_config_is_refused(models):
    """pad_batch(mrope=Y) records Y as pack_batch does; make_forward_step(pack=False, mrope=X) refuses it."""
    made_with = _other(MODEL_ROPE["qwen2_vl"], "image_token_id")
    dense = pad_batch(_text_batch(), label_style="hf", mrope=made_with)
    assert dense.packed_seq_params is None and dense.mrope_config == made_with
    step = make_forward_step(pack=False, label_style="hf", mrope=MODEL_ROPE["qwen2_vl"])
    with pytest.raises(ValueError, match=_named("image_token_id", 240, DATA.image_token_id)):
        _loss(step, models["gpt"], dense)
    assert torch.isfinite(_loss(step, models["gpt"], pad_batch(_text_batch(), label_style="hf",
                                                              mrope=MODEL_ROPE["qwen2_vl"])))
