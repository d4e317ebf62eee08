"""Host syncs of a packed forward + backward through `make_forward_step`: at most 1 when the step
packs (`pack_batch` reads the real lengths once, its value checks and the media counts riding the
same read), 0 when the DataLoader packed; nothing from the rotary, localize, the language model or
the loss. A count, not a time (testing/sync_counter.py says what counts)."""

from megatron_vlm_packing.testing.distributed import run_distributed
from tests.perf.sync_workers import run_sync_budget


def test_packed_mrope_step_syncs_once_in_step_and_never_with_loader_packing():
    result = run_distributed(run_sync_budget, 2, [1, 2], timeout_s=600)
    for row in result["text"]:
        assert row["in_step"]["syncs"] <= 1, row["in_step"]["report"]
        assert row["in_step"]["syncs"] == row["pack_batch"]["syncs"]  # all of it is pack_batch's
        assert row["loader"]["syncs"] == 0, row["loader"]["report"]
        # the loader's micro-batch is the same computation as the step's own packing
        assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-6, row
    media = result["media"]  # images, a video and audio clips, mRoPE positions
    assert media["pack_batch"]["syncs"] == 1, media["pack_batch"]["report"]
    assert media["pack_batch"]["counts"] == ((0, 0, 0, 1), (1, 0, 0, 0), (1, 1, 1, 1))
    # Packing in the step adds exactly pack_batch's one read to what the model itself reads
    # (its vision / audio towers read their own boundaries: not the packing's to remove).
    assert media["in_step"]["packing"] == 1 and media["loader"]["packing"] == 0, media
    assert media["in_step"]["syncs"] - media["loader"]["syncs"] == 1, media
    assert abs(media["in_step"]["loss"] - media["loader"]["loss"]) < 1e-5, media
