import torch

from megatron_vlm_packing.testing import apply_cpu_shims, cpu_shims_applied, undo_cpu_shims


def test_shims_are_explicit_idempotent_and_reversible():
    import megatron.core.transformer.torch_norm as torch_norm
    from megatron.core.tensor_parallel import random as tp_random

    original_current_device = torch.cuda.current_device
    original_current_stream = torch.cuda.current_stream
    original_add = tp_random.CudaRNGStatesTracker.add
    original_norm_new = torch_norm.WrappedTorchNorm.__dict__["__new__"]
    assert not cpu_shims_applied()  # importing the package applied nothing
    apply_cpu_shims()
    apply_cpu_shims()  # idempotent
    try:
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        torch.cuda.current_stream().wait_stream(None)  # DDP's grad sync waits on it: a no-op here
        torch.cuda.synchronize()
        tracker = tp_random.CudaRNGStatesTracker()
        tracker.add("x", 7)
        with tracker.fork("x"):
            first = torch.rand(3)
        tracker2 = tp_random.CudaRNGStatesTracker()
        tracker2.add("x", 7)
        with tracker2.fork("x"):
            assert torch.equal(torch.rand(3), first)  # CPU-backed states reproduce
    finally:
        undo_cpu_shims()
    assert not cpu_shims_applied()
    assert torch.cuda.current_device is original_current_device
    assert torch.cuda.current_stream is original_current_stream
    assert tp_random.CudaRNGStatesTracker.add is original_add
    assert torch_norm.WrappedTorchNorm.__dict__["__new__"] is original_norm_new
    undo_cpu_shims()  # a no-op when nothing is applied


def test_shims_refuse_to_run_where_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original_current_device = torch.cuda.current_device
    try:
        apply_cpu_shims()
    except RuntimeError as err:
        assert "CUDA is available" in str(err)
    else:
        undo_cpu_shims()
        raise AssertionError("apply_cpu_shims() ran on a machine that reports CUDA")
    assert not cpu_shims_applied() and torch.cuda.current_device is original_current_device


def test_an_earlier_patch_undone_after_the_shim_leaves_it_off_and_apply_reinstalls():
    """`mock.patch.object` entered before the shim and exited after puts CUDA's synchronize back over the
    shim's: the shim must then read as off and apply must install it again, as every patch does (owned.py)."""
    import functools
    from unittest import mock

    undo_cpu_shims()
    original = torch.cuda.synchronize
    try:
        with mock.patch.object(torch.cuda, "synchronize", functools.wraps(original)(lambda *a, **k: None)):
            apply_cpu_shims()
            assert cpu_shims_applied()
        assert torch.cuda.synchronize is original and not cpu_shims_applied()
        apply_cpu_shims()
        assert torch.cuda.synchronize is not original and cpu_shims_applied()
        torch.cuda.synchronize()  # the shim's no-op, not CUDA's
    finally:
        undo_cpu_shims()
    assert torch.cuda.synchronize is original and not cpu_shims_applied()


def test_apply_that_fails_part_way_leaves_nothing_applied(monkeypatch):
    """An import that fails after some attributes are set (a megatron-core without a shimmed module) must not
    leave them set with no record: undo could never restore them, and a later apply would keep the shim's
    lambdas as the originals."""
    import sys

    import megatron.core.models.vision as vision

    import megatron.core.models.vision.clip_vit_model  # noqa: F401 - loaded, so that hiding it is what fails

    undo_cpu_shims()
    original_current_device = torch.cuda.current_device
    monkeypatch.setitem(sys.modules, "megatron.core.models.vision.clip_vit_model", None)
    monkeypatch.delattr(vision, "clip_vit_model")
    try:
        apply_cpu_shims()
    except ImportError:
        pass
    else:
        undo_cpu_shims()
        raise AssertionError("apply_cpu_shims() ran without clip_vit_model")
    assert torch.cuda.current_device is original_current_device and not cpu_shims_applied()
    assert torch.zeros(1).device.type == "cpu"
    from torch.overrides import _get_current_function_mode_stack

    assert not any(type(mode).__name__ == "CudaToCpuMode" for mode in _get_current_function_mode_stack())
