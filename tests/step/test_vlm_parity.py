"""The issue's bar: through get_forward_backward_func and the shipped make_forward_step, TP2 x CP2 x SP
on CPU with images + videos + audio in the same pack and mRoPE on gives the single-process loss and
gradients of each sample alone (vision and audio towers included); also with images only when only
TP rank 0 reads the data iterator and broadcasts (Megatron-LM's convention), and with TP2 + SP x PP2
(fixed pack length, the towers on the first stage, labels used on the last)."""

from megatron_vlm_packing.runtime import run_distributed
from megatron_vlm_packing.testing.vlm_parity import VLMCase, run_vlm_parity


def test_packed_vlm_with_images_videos_audio_matches_single_process_alone():
    cases = [VLMCase(1, 1, False), VLMCase(2, 2, True, media=True, mrope=True), VLMCase(2, 1, True),
             VLMCase(1, 2, False), VLMCase(2, 2, True, broadcast=True), VLMCase(2, 1, True, pp=2)]
    results = run_distributed(run_vlm_parity, 4, cases)
    for case, r in zip(cases, results):
        assert r["vision_params"] > 0, r
        assert r["audio_params"] > 0 if case.media else r["audio_params"] == 0, r
        # loss sums are ~100s of nats: 1e-4 absolute is 1e-6 relative
        assert r["max_dloss_sum"] < 1e-4 and r["max_rel_grad_err"] < 1e-5, r
