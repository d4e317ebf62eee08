"""Host syncs of a packed forward + backward of an mRoPE GPTModel through `make_forward_step`:
at most 1 when the step packs (`pack_batch` reads the real lengths once, its value checks riding
the same read), 0 when the DataLoader packed; nothing from the rotary, localize, the model or the
loss. A count, not a time (testing/sync_counter.py says what counts)."""

from megatron_vlm_packing.testing.distributed import run_distributed
from tests.perf.sync_workers import run_sync_budget


def test_packed_mrope_step_syncs_once_in_step_and_never_with_loader_packing():
    for row in run_distributed(run_sync_budget, 2, [1, 2], timeout_s=600):
        assert row["in_step"]["syncs"] <= 1, row["in_step"]["report"]
        assert row["in_step"]["syncs"] == row["pack_batch"]["syncs"]  # all of it is pack_batch's
        assert row["loader"]["syncs"] == 0, row["loader"]["report"]
        # the loader's micro-batch is the same computation as the step's own packing
        assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-6, row
