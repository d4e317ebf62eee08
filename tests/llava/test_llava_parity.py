"""Megatron-Core LLaVAModel packed vs batched (PR #3427's metric), one launch of 2 processes.

Each fix has its own assertion and a deliberate-mistake control in the same launch:
- the slot before an image (bug class 13): a plain pack is refused; upstream loses a token per
  image-opening document;
- `num_image_tiles` omitted: LLaVA's default (one tile per image) reaches the boundaries;
- pipeline stages with pre_process=False: PP=2 through get_forward_backward_func; control: the
  boundaries remapped on the first stage only;
- CP=2: the expanded-space plan; control: a pack aligned in collapsed space only is refused.
"""

import math

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.testing.llava_parity import run_llava_parity
from tests.llava.exact import EXACT, assert_equals_batched


@pytest.fixture(scope="module")
def result():
    return run_distributed(run_llava_parity, 2, timeout_s=900)


def test_setup_is_the_reported_case(result):
    assert result["patch_active"] and result["img_seq_len"] == 4
    assert result["tiles"][:5] == [1, 2, 1, 3, 1]


@pytest.mark.parametrize("layout", ["PP=2", "CP=2"])
@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_packed_equals_batched_through_the_schedule(result, layout, style):
    r = result[f"{layout}, {style} labels"]
    assert_equals_batched(r, result["params"])


def test_pipeline_stages_without_pre_process_use_expanded_boundaries(result):
    control = result["PP=2, control: first stage only"]
    assert control > 1.001 or math.isinf(control), control


def test_cp_plans_in_expanded_space(result):
    assert "do not divide by 4" in result["CP=2, control: plain pack"]


def test_slot_before_an_image_keeps_the_previous_documents_token(result):
    assert result["leak tokens lost upstream"] == 2  # documents 2 and 4 open with an image
    assert "documents [2, 4] open with an image" in result["leak refused"]


@pytest.mark.parametrize("style", ["megatron", "hf"])
def test_num_image_tiles_omitted_means_one_per_image(result, style):
    assert 1.0 <= result[f"tiles omitted, {style}"] <= EXACT


def test_upstream_boundaries_are_wrong_without_the_patch(result):
    assert result["upstream, no patch"] > 1.001
