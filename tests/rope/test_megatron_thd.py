"""Megatron-Core's unfused THD rope, on the installed version: given a frequency table of exactly
T = cu_seqlens_padded[-1] rows, each local token is rotated with the row the CP zigzag gives it."""

import pytest
import torch

from megatron_vlm_packing.parallel.cp import cp_partition_index
from megatron_vlm_packing.rope import use_packed_mrope
from megatron_vlm_packing.rope.megatron_thd import rows_used_by_thd_rope, thd_rope_takes_document_chunks


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_installed_thd_rope_takes_each_documents_cp_chunks(cp_size):
    cu = torch.tensor([0, 8, 24, 40], dtype=torch.int32)
    for cp_rank in range(cp_size):
        assert torch.equal(rows_used_by_thd_rope(cu, cp_size, cp_rank), cp_partition_index(cu, cp_size, cp_rank))
    if cp_size == 2:  # spelled out: document 2 starts at row 8, not at row 0 (bug class 6)
        assert rows_used_by_thd_rope(cu, 2, 1).tolist() == [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19, 28, 29, 30, 31,
                                                            32, 33, 34, 35]
    assert thd_rope_takes_document_chunks()


def test_a_thd_rope_that_restarts_documents_is_detected_and_refused(monkeypatch):
    """A table one row short sends the installed function down its legacy path (every document
    restarts at row 0): the check must see that, and use_packed_mrope must refuse to run where
    patches.thd_rotary does not replace it (as on an upstream whose THD rope no longer syncs)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_vlm_packing.patches import thd_rotary

    monkeypatch.setattr(thd_rotary, "apply_thd_rotary", lambda: False)

    real = rope_utils._apply_rotary_pos_emb_thd

    def restarting(t, cu_seqlens, freqs, *, cp_group=None, **kwargs):
        return real(t, cu_seqlens, freqs[:-1], cp_group=cp_group, **kwargs)

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", restarting)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert rows_used_by_thd_rope(cu, 2, 0).tolist() == [0, 1, 6, 7, 0, 1, 6, 7]
    assert not thd_rope_takes_document_chunks()
    from tests.rope.test_rotary import TinyMropeModel

    with pytest.raises(RuntimeError, match="does not take each document's CP chunks"):
        use_packed_mrope(TinyMropeModel())
