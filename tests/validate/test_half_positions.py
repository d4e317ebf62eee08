"""bf16 / fp16 [3, T] positions judged by the values that occur, not by a largest-position rule.

bfloat16 holds every whole number up to 256 (float16: 2048) and above it only some (257 rounds to 256, 259 to
260). The rotary reads positions as float32, which holds every bf16 / fp16 value exactly: what can be wrong is a
position the model's index gives that the dtype cannot hold. With the index given, each document is compared
with it, so exact positions above 256 pass and rounded ones are named with what the dtype made of them; without
it, positions above the exact range cannot be told from rounded ones and are named, with the values that round.
"""

import pytest
import torch

from megatron_vlm_packing.rope import MRopeConfig, get_rope_index
from megatron_vlm_packing.validate import validate_packed_batch

QWEN2_5 = MRopeConfig(family="qwen2_5_vl", image_token_id=7, video_token_id=8, vision_start_token_id=6,
                      tokens_per_second=25)


def video_document() -> dict:
    """One Qwen2.5-VL document: 109 text tokens, a vision start, then a video of 4 frames of 2 x 2 merged tokens,
    2 s per frame: t positions 110, 160, 210, 260; every position bf16 holds exactly, 260 included."""
    ids = torch.tensor([1] * 109 + [6] + [8] * 16)
    grid, seconds = torch.tensor([[4, 4, 4]]), torch.tensor([2.0])
    positions = get_rope_index(ids[None], QWEN2_5, video_grid_thw=grid, second_per_grid_ts=seconds)[0]
    assert int(positions.max()) == 260 and torch.equal(positions.bfloat16().long(), positions)
    n = ids.numel()
    return dict(input_ids=ids[None], cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n,
                video_grid_thw=grid, second_per_grid_ts=seconds, video_token_id=8, spatial_merge_size=2,
                position_ids=positions)


def text_document(n: int = 300) -> dict:
    ids = torch.arange(1, n + 1)
    return dict(input_ids=ids[None], cu_seqlens=torch.tensor([0, n], dtype=torch.int32), max_seqlen=n,
                position_ids=torch.arange(n).expand(3, 1, n).clone())


def test_exact_bf16_positions_above_256_pass_against_the_index():
    """Was a dtypes violation ('documents [0] reach position 260') though bf16 holds 260 and every position
    equals the model's index."""
    fields = video_document()
    fields["position_ids"] = fields["position_ids"].bfloat16()
    report = validate_packed_batch(**fields, mrope=QWEN2_5)
    assert report.ok and "mrope_positions" in report.checked, str(report)


@pytest.mark.parametrize("dtype, first_rounded, becomes", [(torch.bfloat16, 257, 256), (torch.float16, 2049, 2048)])
def test_rounded_positions_are_named_against_the_index(dtype, first_rounded, becomes):
    """A text document longer than the dtype's whole numbers: the first position it rounds is named with what the
    dtype made of it, as the model's index would have it."""
    fields = text_document(first_rounded + 43)
    fields["position_ids"] = fields["position_ids"].to(dtype)
    report = validate_packed_batch(**fields, mrope=MRopeConfig(family="qwen2_vl"))
    assert report.failed_checks == {"mrope_positions"}, str(report)
    assert (f"document 0 token {first_rounded}: [{becomes}.0, {becomes}.0, {becomes}.0] where the model's index "
            f"gives [{first_rounded}, {first_rounded}, {first_rounded}] ({dtype} holds no {first_rounded}: it rounds "
            f"to {becomes})") in str(report), str(report)


def test_without_the_index_positions_beyond_the_exact_range_are_named_with_the_values_that_round():
    """Without the index the values above 256 cannot be told from rounded ones: still a dtypes finding, naming how
    many positions lie beyond the range and which whole numbers the dtype rounds there."""
    fields = text_document(600)
    fields["position_ids"] = fields["position_ids"].bfloat16()
    report = validate_packed_batch(**fields)
    assert report.failed_checks == {"dtypes"}, str(report)
    beyond = int((fields["position_ids"][0, 0].float() > 256).sum())
    assert (f"position_ids are torch.bfloat16, which holds whole numbers exactly only up to 256 (257 rounds to 256, "
            f"259 to 260, 514 to 512), and documents [0] hold {beyond} positions above 256 (up to 600): without the "
            f"model's index (mrope=) they cannot be told from rounded ones") in str(report), str(report)


def test_half_positions_the_index_could_not_compare_keep_the_dtype_finding():
    """A document the index is not asked about (a video without seconds for Qwen2.5-VL) is judged as without
    the index: its positions beyond 256 are named, not passed because an index was given."""
    fields = video_document()
    fields["position_ids"] = fields["position_ids"].bfloat16()
    fields.pop("second_per_grid_ts")
    report = validate_packed_batch(**fields, mrope=QWEN2_5)
    assert report.failed_checks == {"dtypes"}, str(report)
    assert "documents [0] hold 4 positions above 256 (up to 260)" in str(report), str(report)
    assert any(check == "mrope_positions" and "second_per_grid_ts" in why for check, why in report.skipped)
