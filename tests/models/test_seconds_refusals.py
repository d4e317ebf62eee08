"""`second_per_grid_ts` that nothing reads is refused by one rule with one message, whoever finds it: the mRoPE
index of a family that places frames otherwise (`rope.index`), a model with a 1D rotary or positions made by such
an index (`models.gpt_adapter`), Bridge's Qwen3-VL; and seconds beside no video at all, found by packing or by a
Bridge adapter's check of a micro-batch no packer checked. The readers were named three ways ("the qwen2_vl mRoPE
index reads none", "GPTModel's rotary is 1D: nothing reads them", "Qwen3VLModel reads none"), and "the batch" /
"the micro-batch has no videos" twice."""

from types import SimpleNamespace

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.models.gpt_adapter import refuse_unread_seconds
from megatron_vlm_packing.packing.micro_batch import VisionInputs
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

SECONDS = torch.tensor([1.0, 2.0])
ONLY = ": only the qwen2_5_vl and qwen3_omni mRoPE indexes place video frames by seconds per grid step; drop them " \
       "from the batch"


def micro_batch(made_with=None):
    return SimpleNamespace(vision=VisionInputs(second_per_grid_ts=SECONDS), mrope_config=made_with)


@pytest.mark.parametrize("refuse, reader", [
    (lambda: get_rope_index(torch.tensor([[1, 5, 8, 8]]), MRopeConfig(family="qwen2_vl", video_token_id=8),
                            video_grid_thw=torch.tensor([[1, 2, 2], [1, 2, 2]]), second_per_grid_ts=SECONDS),
     "the qwen2_vl mRoPE index"),
    (lambda: refuse_unread_seconds(micro_batch(), "1d", "GPTModel"), "GPTModel (a 1D rotary)"),
    (lambda: refuse_unread_seconds(micro_batch(MRopeConfig(family="qwen3_vl")), "mrope", "PackedVLM"),
     "PackedVLM (the qwen3_vl mRoPE index)"),
], ids=["index", "1d rotary", "positions by an index that reads none"])
def test_seconds_nothing_reads_are_one_message(refuse, reader):
    with pytest.raises(ValueError) as error:
        refuse()
    assert str(error.value) == f"second_per_grid_ts has 2 entries but {reader} reads none{ONLY}"


def test_qwen3_vl_adapter_refuses_seconds_by_the_same_rule():
    from megatron_vlm_packing.bridge.adapters import Qwen3VLAdapter

    adapter = SimpleNamespace(model_name="Qwen3VLModel", mrope=MRopeConfig(family="qwen3_vl"))
    with pytest.raises(ValueError) as error:
        Qwen3VLAdapter.refuse_seconds(adapter, micro_batch())
    assert str(error.value) == f"second_per_grid_ts has 2 entries but Qwen3VLModel (the qwen3_vl mRoPE index) " \
                               f"reads none{ONLY}"
    Qwen3VLAdapter.refuse_seconds(adapter, SimpleNamespace(vision=VisionInputs(), mrope_config=None))


def test_seconds_beside_no_video_are_one_message_in_packing_and_in_bridge_checks():
    from megatron_vlm_packing.bridge.adapters import _check_unpacked_seconds

    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = (ids != 0).long()
    with pytest.raises(ValueError) as packed:
        pack_batch(dict(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100),
                        second_per_grid_ts=SECONDS), label_style="hf")
    with pytest.raises(ValueError) as checked:
        _check_unpacked_seconds(VisionInputs(second_per_grid_ts=SECONDS))
    assert str(packed.value) == str(checked.value) == "second_per_grid_ts has 2 entries but the batch has no videos"
