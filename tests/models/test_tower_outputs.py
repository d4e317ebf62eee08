"""What a user's vision or audio tower returns to `PackedVLM` is checked before it is placed: a ValueError naming
the tower, the shape it returned and the rows / width the placeholders and the language model need.

Packing checks every sample's placeholders against its own items in its one read, and `PackedVLM` then places the
tower's rows without a read of its own (`merge.place_checked_embeddings`). It took the row count from the tower's
output: a tower giving one row fewer than the micro-batch's placeholders left the last placeholder with its text
embedding, one row more wrote the extra row over token 0 of the pack (a text token of the first sample), each a
different loss without a word (245.19 and 245.83 for 245.23 here), packed, dense and from a loader. A tuple (Qwen3-VL
style deepstack features), a dict, a list, [1, N, H] or another hidden size was an AttributeError / IndexError /
RuntimeError inside `index_copy`. Real Megatron-Core models (tiny, CPU, one process).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from megatron_vlm_packing.testing.step_models import step_loss


class _Returning(nn.Module):
    """A user's tower: the tiny tower's output passed through `change` (the tower's own weights kept)."""

    def __init__(self, inner: nn.Module, change):
        super().__init__()
        self.inner, self.change = inner, change
        self.n_window = getattr(inner, "n_window", None)  # the audio window packing counted clips with

    def forward(self, *args, **kwargs):
        return self.change(self.inner(*args, **kwargs))


@pytest.fixture(scope="module")
def setup(single_process_megatron):
    from megatron_vlm_packing.demo.synthetic import collate, synthetic_samples
    from megatron_vlm_packing.packing.collate import PackingCollator
    from megatron_vlm_packing.testing.vlm_parity import LM, MEDIA, ROPE, build_vlm

    batch = collate(synthetic_samples(4, seed=3, cfg=MEDIA))
    collator = PackingCollator(label_style="hf", mrope=ROPE, pack_options=dict(
        image_token_id=MEDIA.image_token_id, video_token_id=MEDIA.video_token_id,
        audio_token_id=MEDIA.audio_token_id, spatial_merge_size=2))
    model = build_vlm(LM, 0, media=True, mrope=True)
    towers = {"vision": model.vision, "audio": model.audio}
    return dict(model=model, towers=towers, batch=batch, loader=collator(batch), loss=step_loss(model, batch),
                hidden=LM.hidden_size)


def _unmarked(micro_batch):
    """The same media as new objects: the packer's marks no longer hold, so `PackedVLM` checks everything itself."""
    return dataclasses.replace(micro_batch, vision=dataclasses.replace(micro_batch.vision),
                               audio=dataclasses.replace(micro_batch.audio))


ROUTES = {"packed": lambda s: step_loss(s["model"], s["batch"]),
          "dense": lambda s: step_loss(s["model"], s["batch"], pack=False),
          "loader": lambda s: step_loss(s["model"], s["loader"]),
          "checked by the model": lambda s: step_loss(s["model"], s["batch"], transform=_unmarked)}


def _loss_with(setup, tower: str, change, route: str) -> float:
    model = setup["model"]
    setattr(model, tower, _Returning(setup["towers"][tower], change))
    try:
        return ROUTES[route](setup)
    finally:
        setattr(model, tower, setup["towers"][tower])


# The micro-batch holds 2 image, 2 video and 7 audio placeholders; the LM's hidden size is 32.
ROWS = {"image": 2, "audio": 7}
BAD = {
    "one row fewer": (lambda x: x[:-1], r"the {tower} tower returned {less} rows \[{less}, 32\] for the {n} {kind} "
                                        r"placeholder tokens \(id {id}\) of the micro-batch"),
    "one row more": (lambda x: torch.cat([x, x[:1]]), r"the {tower} tower returned {more} rows \[{more}, 32\] for the "
                                                      r"{n} {kind} placeholder tokens"),
    "[1, N, H]": (lambda x: x[None], r"the {tower} tower returned a tensor of shape \[1, {n}, 32\]: it must return "
                                     r"\[rows, hidden\] = \[{n}, 32\]"),
    "[N, 1, H]": (lambda x: x[:, None], r"the {tower} tower returned a tensor of shape \[{n}, 1, 32\]: it must "
                                        r"return \[rows, hidden\]"),
    "hidden doubled": (lambda x: torch.cat([x, x], -1), r"the {tower} tower returned a tensor of shape \[{n}, 64\]: "
                                                         r"it must return \[rows, hidden\] = \[{n}, 32\] \(the "
                                                         r"language model's hidden size\)"),
    "a tuple (deepstack style)": (lambda x: (x, [x]), r"the {tower} tower returned a tuple, not a tensor: .*returns "
                                                      r"the \[rows, hidden\] embeddings"),
    "a dict": (lambda x: {"last_hidden_state": x}, r"the {tower} tower returned a dict, not a tensor"),
    "integer rows": (lambda x: x.long(), r"the {tower} tower returned a tensor of dtype torch.int64"),
    "on another device": (lambda x: x.to("meta"), r"the {tower} tower returned its {kind} embeddings on meta but the "
                                                  r"language model's are on cpu"),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("tower, kind", [("vision", "image"), ("audio", "audio")])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_tower_output_that_does_not_fit_the_placeholders_is_named(setup, case, tower, kind, route):
    from megatron_vlm_packing.testing.vlm_parity import MEDIA

    change, message = BAD[case]
    n = ROWS[kind]
    message = message.format(tower=tower, kind=kind, n=n, less=n - 1, more=n + 1,
                             id=getattr(MEDIA, f"{kind}_token_id"))
    with pytest.raises(ValueError, match=message):
        _loss_with(setup, tower, change, route)


@pytest.mark.parametrize("tower", ["vision", "audio"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_tower_of_another_floating_dtype_is_cast_to_the_language_models(setup, tower, dtype):
    """A tower computing in bf16 / fp16 (or float64) beside a float32 LM: its rows are cast where they are placed,
    so the loss is the float32 one up to the rounding of the rows (2.6e-4 of 245 here for bf16)."""
    for route in ROUTES:
        assert _loss_with(setup, tower, lambda x: x.to(dtype), route) == pytest.approx(setup["loss"], rel=2e-6)
