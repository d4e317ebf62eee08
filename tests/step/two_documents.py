"""The two-document text pack the step's boundary tests replace fields of.

Two rows with 10 and 12 real tokens, packed with `pad_to=PAD_TO`: real boundaries [0, 10, 22], physical
[0, 10, 32] (the last document holds the pad slots), so every boundary set, `max_seqlen_*` and
`pad_between_seqs` has a wrong value that a replaced `PackedSeqParams` can carry.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing.collate import PackingCollator

PAD_TO = 32  # the plan: real boundaries [0, 10, 22], physical [0, 10, 32]
LONGEST = 22  # the plan's longest physical document
HAS_PAD_BETWEEN_SEQS = "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}
needs_pad_flag = pytest.mark.skipif(not HAS_PAD_BETWEEN_SEQS, reason="this megatron-core's PackedSeqParams has no "
                                                                       "pad_between_seqs (TE infers it)")


def two_document_setup() -> dict:
    """The tiny GPTModel, the rows (`text`), their pack made in the step's way (`packed`), by the loader's
    collator (`loader`) and without `pad_to` (`without_pads`: no pad slot at all). Needs Megatron-Core
    initialised (the `single_process_megatron` fixture)."""
    from megatron_vlm_packing.testing.step_models import tiny_step_models

    torch.manual_seed(0)
    ids = torch.randint(1, 120, (2, 12))
    text = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.tensor([[1] * 10 + [0] * 2, [1] * 12])}
    return dict(gpt=tiny_step_models()["gpt"], text=text, packed=pack_batch(text, label_style="hf", pad_to=PAD_TO),
                loader=PackingCollator(label_style="hf", pad_to=PAD_TO)(text),
                without_pads=pack_batch(text, label_style="hf"))
