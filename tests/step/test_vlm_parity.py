"""The issue's bar: through get_forward_backward_func, TP2 x CP2 x SP on CPU with images gives the
single-process loss and gradients (vision tower included); also when only TP rank 0 reads the data
iterator and broadcasts (Megatron-LM's convention), and with TP2 + SP x PP2 (fixed pack length, the
vision tower on the first stage, labels used on the last)."""

from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.testing.vlm_parity import run_vlm_parity


def test_packed_vlm_with_images_matches_single_process_alone():
    results = run_distributed(run_vlm_parity, 4, [(1, 1, False), (2, 2, True), (2, 1, True), (1, 2, False),
                                                          (2, 2, True, True), (2, 1, True, False, 2)])
    for r in results:
        assert r["vision_params"] > 0, r
        # loss sums are ~100s of nats: 1e-4 absolute is 1e-6 relative
        assert r["max_dloss_sum"] < 1e-4 and r["max_rel_grad_err"] < 1e-5, r
