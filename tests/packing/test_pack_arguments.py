"""The pack options a collator or the step holds are checked by one function (`row_fields.check_pack_arguments`),
so each owner refuses a bad value with the same message, when it is built."""

import numpy as np
import pytest
import torch

from megatron_vlm_packing.models.llava import LlavaSpace
from megatron_vlm_packing.models.llava_pack import LlavaPackingCollator
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.packing.row_fields import check_pack_arguments
from megatron_vlm_packing.train.build import StepOptions

SPACE = LlavaSpace(img_seq_len=4, image_token_index=127)

# owner -> (builder, the options it holds)
OWNERS = {
    "PackingCollator": (lambda **kw: PackingCollator(**kw), {"fp8", "label_style", "pad_to", "pad_token_id", "mrope"}),
    "LlavaPackingCollator": (lambda **kw: LlavaPackingCollator(space=SPACE, **kw),
                             {"fp8", "label_style", "pad_to", "pad_token_id"}),
    "StepOptions": (lambda **kw: StepOptions(**kw), {"fp8", "label_style", "pad_to", "mrope"}),
}

BAD = [
    ("fp8", "no", r"fp8 must be a bool, got 'no' \(for Megatron's fp8 format: fp8=config.fp8 is not None\)$"),
    ("fp8", None, r"fp8 must be a bool, got None \(for Megatron's fp8 format"),
    ("fp8", np.bool_(True), r"fp8 must be a bool, got np.True_"),
    ("label_style", "HF", r"label_style must be 'megatron' or 'hf', got 'HF'$"),
    ("label_style", None, r"label_style must be 'megatron' or 'hf', got None$"),
    ("pad_to", "8", r"pad_to must be an int \(the packed length T\) or None, got '8'$"),
    ("pad_to", 8.0, r"pad_to must be an int \(the packed length T\) or None, got 8.0$"),
    ("pad_to", True, r"pad_to must be an int \(the packed length T\) or None, got True$"),
    ("pad_to", torch.tensor(8.0), r"pad_to must be an int \(the packed length T\) or None, got tensor\(8\.\); pass a "
                                  r"Python int \(int\(pad_to\)\), not a tensor$"),
    ("pad_to", torch.tensor(8), r"pad_to must be an int \(the packed length T\) or None, got tensor\(8\); pass a "
                                r"Python int \(int\(pad_to\)\), not a tensor$"),
    # below 1: the collators accepted these and failed at the first batch a DataLoader worker packed
    ("pad_to", 0, r"pad_to must be a positive int \(the packed length T\) or None, got 0$"),
    ("pad_to", -8, r"pad_to must be a positive int \(the packed length T\) or None, got -8$"),
    ("pad_to", np.int64(0), r"pad_to must be a positive int \(the packed length T\) or None, got np.int64\(0\)$"),
    ("pad_token_id", -1, r"pad_token_id must be a non-negative int \(the id written at pad slots\), got -1$"),
    ("pad_token_id", 2**63, r"pad_token_id must be at most 2\*\*63 - 1 \(ids are int64\), got 9223372036854775808$"),
    ("mrope", "qwen2_vl", r"mrope must be an MRopeConfig, a callable or None, got str$"),
]


@pytest.mark.parametrize("owner", sorted(OWNERS))
@pytest.mark.parametrize("name, value, message", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_every_owner_refuses_a_bad_option_with_one_message(owner, name, value, message):
    build, holds = OWNERS[owner]
    if name not in holds:
        pytest.skip(f"{owner} has no {name}")
    with pytest.raises(ValueError, match=message):
        build(**{name: value})
    with pytest.raises(ValueError, match=message):
        check_pack_arguments(**{name: value})


@pytest.mark.parametrize("pad_to", [8, np.int64(8), np.uint8(8)])
def test_pad_to_is_returned_as_a_python_int(pad_to):
    checked = check_pack_arguments(pad_to=pad_to)
    assert checked == 8 and type(checked) is int
    assert type(StepOptions(pad_to=pad_to).pad_to) is int


def test_the_first_bad_option_is_named_in_a_fixed_order():
    with pytest.raises(ValueError, match=r"^fp8 must be a bool"):
        check_pack_arguments(fp8=1, label_style="x", pad_to="8", pad_token_id=-1, mrope=3)
    with pytest.raises(ValueError, match=r"^label_style must be"):
        check_pack_arguments(label_style="x", pad_to="8", pad_token_id=-1, mrope=3)
    with pytest.raises(ValueError, match=r"^pad_to must be"):
        check_pack_arguments(pad_to="8", pad_token_id=-1, mrope=3)
    with pytest.raises(ValueError, match=r"^pad_token_id must be"):
        check_pack_arguments(pad_token_id=-1, mrope=3)


def test_pack_batch_names_a_pad_to_below_one_as_the_collators_do():
    """The packers read pad_to with the same rule: 0 was "smaller than the N physical tokens this batch needs"."""
    from megatron_vlm_packing.packing import pack_batch

    batch = {"input_ids": torch.tensor([[3, 4, 5]]), "labels": torch.tensor([[4, 5, -100]])}
    for host_reads in (False, True):
        with pytest.raises(ValueError, match=r"pad_to must be a positive int \(the packed length T\) or None, got 0$"):
            pack_batch(batch, pad_to=0, host_reads=host_reads)
