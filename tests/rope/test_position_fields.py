"""`rope.config.POSITION_FIELDS`: exactly the `MRopeConfig` fields `get_rope_index` reads for each family.

The step compares a loader micro-batch's recorded config with the model's on these fields only
(`models.adapter.check_loader_mrope`): a field missing here would let wrong positions train silently, a
field listed here that the family never reads would refuse a collator that made the right positions.
Both directions are checked on real rows: changing any other field leaves every position as it was,
and changing a listed field changes positions (or makes the index refuse the rows).
"""

import dataclasses

import pytest
import torch

from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.rope.config import FAMILIES, POSITION_FIELDS, SECONDS_FAMILIES, position_differences
from tests.rope.conftest import IMAGE, START, VIDEO, random_rows
from tests.rope.test_omni import random_rows as omni_rows
from tests.rope.test_omni import thinker

END = START + 1
# Another valid value of each field (every MRopeConfig field must be here: a new field needs a decision).
OTHER = dict(spatial_merge_size=1, image_token_id=7, video_token_id=8, vision_start_token_id=9, audio_token_id=10,
             audio_start_token_id=11, position_id_per_seconds=13.0, audio_n_window=7, tokens_per_second=3.5,
             mrope_section=(1, 1, 2), text_offset="max_position")


def _other(config: MRopeConfig, name: str):
    if name == "mrope_interleaved":
        return not config.mrope_interleaved
    if name == "family":
        return next(f for f in FAMILIES if f != config.family)
    return OTHER[name]


def _configs_and_rows():
    """(MRopeConfig, get_rope_index keywords) of random rows of every family (videos, seconds, audio)."""
    cases = []
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        config = MRopeConfig(family=family, tokens_per_second=2.0)
        for seed in range(3):
            ids, mask, images, videos, seconds = random_rows(family, 3, seed)
            read_seconds = dict(second_per_grid_ts=seconds) if family in SECONDS_FAMILIES else {}  # else refused
            cases.append((config, dict(input_ids=ids, attention_mask=mask, image_grid_thw=images, video_grid_thw=videos,
                                       **read_seconds)))
    hf, _ = thinker()
    config = MRopeConfig.from_hf_config(hf)
    for seed, in_video in ((0, True), (3, False)):  # videos of 2 and 3 frames (time positions), audio in both
        ids, mask, images, videos, seconds, audio = omni_rows(hf, 3, seed, in_video)
        cases.append((config, dict(input_ids=ids, attention_mask=mask, image_grid_thw=images, video_grid_thw=videos,
                                   second_per_grid_ts=seconds, audio_seqlens=audio)))
    return cases


CASES = _configs_and_rows()


def _positions(config: MRopeConfig, inputs: dict):
    """[3, B, S] positions, or "refused" when the index raises for these rows under `config`."""
    try:
        return get_rope_index(config=config, **inputs).position_ids
    except ValueError:
        return "refused"


def test_every_family_lists_its_fields_and_never_the_rotary_layout():
    assert set(POSITION_FIELDS) == set(FAMILIES)
    names = {f.name for f in dataclasses.fields(MRopeConfig)}
    for family, fields in POSITION_FIELDS.items():
        assert set(fields) <= names and "family" in fields, family
        assert not {"mrope_section", "mrope_interleaved"} & set(fields), family  # the rotary's, not the positions'


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_field_not_listed_for_the_family_changes_no_position(case):
    config, inputs = CASES[case]
    expected = _positions(config, inputs)
    assert isinstance(expected, torch.Tensor)
    unread = [f.name for f in dataclasses.fields(MRopeConfig) if f.name not in POSITION_FIELDS[config.family]]
    for name in unread:
        other = dataclasses.replace(config, **{name: _other(config, name)})
        assert torch.equal(_positions(other, inputs), expected), name
        assert position_differences(other, config) == (), name


def _vision_row(family: str) -> dict:
    """One row: text, an image of grid [2, 2, 2] (t = 2 frames of 1 merged token: "max_position" resumes after
    t, "max_hw" after h and w), text, a video of 3 frames with 1.5 s per frame, text."""
    if family == "qwen3_vl":  # one block per frame
        video = [t for _ in range(3) for t in (5, START, VIDEO, END)]
    else:
        video = [START, VIDEO, VIDEO, VIDEO, END]
    tokens = [1, 2, START, IMAGE, IMAGE, END, 3] + video + [4]
    seconds = dict(second_per_grid_ts=torch.tensor([1.5])) if family in SECONDS_FAMILIES else {}  # else refused
    return dict(input_ids=torch.tensor([tokens]), image_grid_thw=torch.tensor([[2, 2, 2]]),
                video_grid_thw=torch.tensor([[3, 2, 2]]), **seconds)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_listed_field_changes_positions_or_is_refused(family):
    """Each field listed for `family` is read: some rows' positions change (or the index refuses them)."""
    if family == "qwen3_omni":
        cases = [(config, inputs) for config, inputs in CASES if config.family == family]
    else:
        config = MRopeConfig(family=family, image_token_id=IMAGE, video_token_id=VIDEO)
        cases = [(config, _vision_row(family))] + [(c, i) for c, i in CASES if c.family == family]
    for name in POSITION_FIELDS[family]:
        read = False
        for config, inputs in cases:
            other = dataclasses.replace(config, **{name: _other(config, name)})
            changed = _positions(other, inputs)
            read = read or isinstance(changed, str) or not torch.equal(changed, _positions(config, inputs))
        assert read, name


def test_differences_name_each_field_with_both_values_in_field_order():
    model = MRopeConfig(family="qwen2_5_vl", tokens_per_second=2.0)
    made = dataclasses.replace(model, spatial_merge_size=4, tokens_per_second=1.0, mrope_section=(1, 1, 2))
    assert position_differences(made, model) == (("spatial_merge_size", 4, 2), ("tokens_per_second", 1.0, 2.0))
    # another family: the fields of both families are compared
    omni = MRopeConfig(family="qwen3_omni", audio_token_id=5)
    assert position_differences(omni, model) == (("family", "qwen3_omni", "qwen2_5_vl"), ("audio_token_id", 5, None),
                                                 ("tokens_per_second", 1.0, 2.0))
