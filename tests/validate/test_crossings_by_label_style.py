"""Bug class 8 decided without source rows where the label style decides it.

A document's last real token trained on the token after it in the pack (the next document's first, or a pad) is
a crossing or the sample's own target: without the source rows the numbers are the same, so it is listed as not
decided. When the samples' labels were Hugging Face style (unshifted), a sample's last token has no target at
all: trained on anything, and on the token after it in particular, it is a crossing. `label_style="hf"` (a
keyword, or the saved key without `source_*` rows, which was dropped without a word) says so and decides it.
"""

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.validate import SourceRows, validate_packed_batch


def hf_pack() -> tuple[dict, dict]:
    """(fields of a correct HF-style pack of lengths 5, 2, 3, the same with document 0's last token trained on
    document 1's first token, as a shift after concatenation does)."""
    ids = torch.tensor([[11, 12, 13, 14, 15, 0], [21, 22, 0, 0, 0, 0], [31, 32, 33, 0, 0, 0]])
    mask = (torch.arange(6) < torch.tensor([[5], [2], [3]])).long()
    labels = torch.where(mask.bool(), ids, -100)
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, label_style="hf")
    clean = dict(input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
                 padding_mask=packed.padding_mask, packed_seq_params=packed.packed_seq_params)
    last, first_of_next = 4, 5  # lengths 5, 2, 3 at cp = 1: no pad slots
    crossed = dict(clean, labels=packed.labels.clone(), loss_mask=packed.loss_mask.clone())
    crossed["labels"][0, last] = packed.input_ids[0, first_of_next]
    crossed["loss_mask"][0, last] = 1.0
    return clean, crossed


def crossing_skips(report) -> list[str]:
    return [why for name, why in report.skipped if name == "labels_cross_documents"]


@pytest.mark.parametrize("given", ["keyword", "saved key"])
def test_hf_labels_decide_a_crossing_without_source_rows(given):
    clean, crossed = hf_pack()
    undecided = validate_packed_batch(crossed)
    assert undecided.ok and crossing_skips(undecided), str(undecided)  # the numbers alone do not decide it
    assert "label_style='hf'" in crossing_skips(undecided)[0], str(undecided)  # and the report says what would
    report = (validate_packed_batch(crossed, label_style="hf") if given == "keyword"
              else validate_packed_batch({**crossed, "label_style": "hf"}))
    assert report.failed_checks == {"labels_cross_documents"} and report.bug_classes == {8}, str(report)
    assert report.violations[0].documents == (0,) and "slot 4 learns 21 = document 1's first token" in str(report)
    assert not crossing_skips(report), str(report)
    assert validate_packed_batch(clean, label_style="hf").ok


def test_megatron_labels_leave_the_crossing_undecided():
    """A Megatron-style sample's last token has its own next token, which the pack does not hold."""
    _, crossed = hf_pack()
    report = validate_packed_batch(crossed, label_style="megatron")
    assert report.ok and crossing_skips(report), str(report)
    assert "label_style='hf'" not in crossing_skips(report)[0], str(report)


def test_a_label_style_contradicting_the_source_rows_is_refused():
    clean, _ = hf_pack()
    ids = clean["input_ids"]
    rows = SourceRows(input_ids=ids, labels=ids, label_style="megatron")
    with pytest.raises(ValueError, match="label_style='hf' contradicts the source rows' label_style='megatron'"):
        validate_packed_batch(clean, source=rows, label_style="hf")
    with pytest.raises(ValueError, match="label_style must be 'megatron' or 'hf', got 'HF'"):
        validate_packed_batch(clean, label_style="HF")
