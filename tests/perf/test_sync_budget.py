"""Host syncs of a packed forward + backward of an mRoPE GPTModel through `make_forward_step`:
0 when the DataLoader packed; when the step packs, exactly `pack_batch`'s own (it reads the real
lengths once, plus one read per value check of `packing.rows`: ids, labels), nothing from the
rotary, localize, the model or the loss. A count, not a time (testing/sync_counter.py says what counts)."""

from megatron_vlm_packing.testing.distributed import run_distributed
from tests.perf.sync_workers import run_sync_budget


def test_packed_mrope_step_syncs_once_in_step_and_never_with_loader_packing():
    for row in run_distributed(run_sync_budget, 2, [1, 2], timeout_s=600):
        assert row["in_step"]["syncs"] == row["pack_batch"]["syncs"] <= 3, (row["in_step"]["report"],
                                                                             row["pack_batch"]["report"])
        assert "lengths.py" in row["pack_batch"]["report"]  # the real lengths: read once
        assert row["loader"]["syncs"] == 0, row["loader"]["report"]
        # the loader's micro-batch is the same computation as the step's own packing
        assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-6, row
