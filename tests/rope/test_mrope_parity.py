"""mRoPE under packing on a real Megatron-Core GPTModel (CPU, gloo): packed == each sample alone,
at CP=1 and CP=2, while 1D positions broadcast to three channels (bug class 1) and Megatron-Core's
own rotary at CP=2 (bug class 6, silent in 0.19) are caught."""

from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.testing.mrope_parity import run_mrope_parity


def test_packed_mrope_equals_each_sample_alone_under_cp():
    results = {r["cp"]: r for r in run_distributed(run_mrope_parity, 2, [1, 2])}
    for cp, r in results.items():
        assert r["image_tokens"] > 0
        assert r["max_dloss"] < 1e-5, r
        assert r["packed_again"] < 1e-6 and r["dense_after_packed"] < 1e-5, r  # no state leaks (bug class 5)
        assert r["max_dloss_1d_broadcast"] > 1e-3, r  # bug class 1 is visible in the loss
    assert results[1]["max_dloss_megatron_rotary"] < 1e-5
    assert results[2]["max_dloss_megatron_rotary"] > 1e-3, "Megatron-Core's rotary at CP=2 is expected to be wrong"
