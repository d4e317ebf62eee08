"""Inputs that the mRoPE index of the model's family reads nothing of are a ValueError naming them and the family,
on every packing path and in `get_rope_index`, as in transformers: `audio_seqlens` and `use_audio_in_video` are
read by Qwen3-Omni's index only, `mm_token_type_ids` by all but Qwen3-Omni's (it tells blocks by their tokens).
Before, the index took them and read nothing (the positions were made without them).
"""

import pytest
import torch

from megatron_vlm_packing.rope import get_rope_index
from tests.adversarial.test_audio_seqlens import OMNI, ONE, ONE_TOKEN, TEN, TWO_TOKENS, _batch
from tests.packing.test_unread_seconds import CONFIGS, PACKERS, _videos

VIDEOS_ONLY = {k: v for k, v in _videos().items() if k != "second_per_grid_ts"}
NOT_OMNI = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


def _unread(names: list[str], family: str) -> str:
    return rf"^{names}".replace("[", r"\[").replace("]", r"\]") + rf" given to the {family} mRoPE index, which reads none"


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("family", NOT_OMNI)
def test_use_audio_in_video_for_a_family_without_audio_is_refused(packer, family):
    with pytest.raises(ValueError, match=_unread(["use_audio_in_video"], family)):
        PACKERS[packer]({**VIDEOS_ONLY, "use_audio_in_video": True}, label_style="hf", mrope=CONFIGS[family])


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("family", NOT_OMNI)
def test_use_audio_in_video_false_for_a_family_without_audio_is_taken(packer, family):
    """False says what is true of every video of such a family (no audio in it): nothing is dropped. A generic
    collate that always sets the flag packs as without it."""
    without = PACKERS[packer](VIDEOS_ONLY, label_style="hf", mrope=CONFIGS[family])
    with_false = PACKERS[packer]({**VIDEOS_ONLY, "use_audio_in_video": False}, label_style="hf",
                                 mrope=CONFIGS[family])
    assert torch.equal(with_false.position_ids, without.position_ids)


@pytest.mark.parametrize("family", NOT_OMNI)
def test_audio_seqlens_for_a_family_without_audio_is_refused(family):
    """Counts not required (a model adapter checks media): the lengths reached the index, which read nothing."""
    from megatron_vlm_packing import packing

    with pytest.raises(ValueError, match=_unread(["audio_seqlens"], family)):
        packing.pack_batch({**VIDEOS_ONLY, "audio_seqlens": torch.tensor([TEN])}, label_style="hf",
                           mrope=CONFIGS[family], require_media_counts=False)
    ids, grid = VIDEOS_ONLY["input_ids"], VIDEOS_ONLY["video_grid_thw"]
    for lengths in (torch.tensor([TEN]), [TEN]):
        with pytest.raises(ValueError, match=_unread(["audio_seqlens"], family)):
            get_rope_index(ids, CONFIGS[family], video_grid_thw=grid, audio_seqlens=lengths)
    with pytest.raises(ValueError, match=_unread(["audio_seqlens", "use_audio_in_video"], family)):
        get_rope_index(ids, CONFIGS[family], video_grid_thw=grid, audio_seqlens=[TEN], use_audio_in_video=True)
    with pytest.raises(ValueError, match=_unread(["audio_seqlens"], family)):
        get_rope_index(ids, CONFIGS[family], video_grid_thw=grid, audio_seqlens=[TEN], use_audio_in_video=False)
    empty = get_rope_index(ids, CONFIGS[family], video_grid_thw=grid, audio_seqlens=torch.zeros(0, dtype=torch.long))
    assert torch.equal(empty.position_ids, get_rope_index(ids, CONFIGS[family], video_grid_thw=grid).position_ids)


@pytest.mark.parametrize("packer", sorted(PACKERS))
def test_mm_token_type_ids_for_qwen3_omni_are_refused(packer):
    batch = _batch([TWO_TOKENS, ONE_TOKEN], audio_seqlens=torch.tensor([TEN, ONE]))
    types = torch.zeros_like(batch["input_ids"])
    with pytest.raises(ValueError, match=_unread(["mm_token_type_ids"], "qwen3_omni")):
        PACKERS[packer]({**batch, "mm_token_type_ids": types}, label_style="hf", mrope=OMNI)
    with pytest.raises(ValueError, match=_unread(["mm_token_type_ids"], "qwen3_omni")):
        get_rope_index(batch["input_ids"], OMNI, mm_token_type_ids=types, audio_seqlens=batch["audio_seqlens"])
    assert PACKERS[packer](batch, label_style="hf", mrope=OMNI).position_ids.shape[0] == 3


@pytest.mark.parametrize("packer", sorted(PACKERS))
@pytest.mark.parametrize("family", NOT_OMNI)
def test_mm_token_type_ids_for_the_qwen_vl_families_are_read(packer, family):
    types = torch.where(VIDEOS_ONLY["input_ids"] == 8, 2, 0)
    assert PACKERS[packer]({**VIDEOS_ONLY, "mm_token_type_ids": types}, label_style="hf",
                           mrope=CONFIGS[family]).position_ids.shape[0] == 3
