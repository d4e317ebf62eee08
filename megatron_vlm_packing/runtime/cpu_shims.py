"""Run Megatron-Core on a CPU-only machine: an explicit, reversible shim of its CUDA-only calls.

Facts (checked on megatron-core 0.16.1 and 0.19.2 with a CPU build of torch):
- `torch.cuda.current_device()` is used as a *device* (global memory buffer, rotary embeddings,
  TP gather buffers, pipeline p2p buffers): it must answer "cpu".
- `torch.cuda.synchronize` is called in pipeline p2p communication.
- Megatron's `DistributedDataParallel` grad sync calls `torch.cuda.current_stream()` (to wait for
  CUDA-graph events) on both versions: it answers a stream whose waits are no-ops.
- `device="cuda"` is hard-coded in places (default causal mask, schedules, optimizer), and
  `rope_utils.get_pos_emb_on_this_cp_rank` builds its index with `pin_memory()` and `.cuda()`
  (a name imported into several modules, so patching the symbol would miss copies): a
  `TorchFunctionMode` maps every CUDA device argument, `.cuda()` and `.pin_memory()` to the CPU.
- The tensor-parallel RNG tracker snapshots CUDA RNG state (attention dropout forks it even at
  p = 0): its `add`/`fork` are backed by CPU generator states instead.
- `WrappedTorchNorm` asserts `not sequence_parallel`: it is built with SP off and its parameters
  are marked `sequence_parallel = True`, so their grads get reduced over TP like TE norms.
- megatron-core 0.16.1's MoE router reads `moe_utils.te_general_gemm`, which is only defined when
  TE imports (NameError without TE): the name is defined as None when it is missing.
- The all-to-all MoE token dispatcher creates a CUDA stream: CPU tests use the all-gather one.
- Without TE, `CLIPViTModel`'s default norms are `torch.nn.LayerNorm`, which cannot be built from a
  config (TypeError): its `ln_pre_impl`/`ln_post_impl` defaults become `WrappedTorchNorm`.

Not shimmed (use torch optimizers in CPU tests): `clip_grad_norm_fp32` asserts
`torch.cuda.FloatTensor` grads and the distributed optimizer refuses CPU tensors. Megatron's
`DistributedDataParallel` and `finalize_model_grads` do run under the shim (the parity suite uses them).

Nothing happens on import. `apply_cpu_shims()` applies everything (idempotent) and refuses when
CUDA is available; `undo_cpu_shims()` restores every patched attribute (stack-safe: it refuses, changing
nothing, while something installed after the shim holds one of them or a later TorchFunctionMode is active).
The attributes follow `patches.owned`'s rule: an earlier patch undone after the shim (its original back over
one of ours) turns it off (`cpu_shims_applied()` False) and `apply_cpu_shims()` installs it again; an apply
that fails part way leaves nothing set.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.overrides import TorchFunctionMode

from megatron_vlm_packing.patches.owned import OwnedAttributes

_CUDA_TENSOR_METHODS = {torch.Tensor.cuda, torch.Tensor.pin_memory}


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare ordinal means a CUDA device in torch
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device arguments, `.cuda()` and `.pin_memory()` to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _CUDA_TENSOR_METHODS:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


class _CpuRngTracker:
    """Replacement methods for Megatron's `CudaRNGStatesTracker`, backed by CPU RNG states."""

    @staticmethod
    def add(self, name, seed):
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        outer = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)

    @staticmethod
    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class _NullStream:
    """What `torch.cuda.current_stream()` answers on the CPU: every wait is a no-op (one stream)."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


def _wrapped_torch_norm_new(original_new):
    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, *args, **kwargs)
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # grads are partial per TP rank: reduce them like TE norms
        return norm

    return __new__


class _Patches:
    """Everything the shim changed: its attributes (originals kept) and its TorchFunctionMode."""

    def __init__(self):
        self.owned = OwnedAttributes(__name__)
        self.mode: CudaToCpuMode | None = None

    def set(self, owner, name, value):
        self.owned.set(owner, name, value)

    def check(self) -> None:
        """RuntimeError when undoing would clobber what was installed after the shim (see `undo_cpu_shims`)."""
        stack = _function_mode_stack()
        if not stack or stack[-1] is not self.mode:
            top = type(stack[-1]).__qualname__ if stack else "no mode"
            raise RuntimeError(f"cannot undo {__name__}: the innermost TorchFunctionMode is {top}, not its "
                               "CudaToCpuMode; exit the later mode first. Nothing was undone.")
        self.owned.check()


def _function_mode_stack() -> list:
    from torch.overrides import _get_current_function_mode_stack  # private, in torch 2.x; no public reader

    return _get_current_function_mode_stack()


_ACTIVE: list[_Patches] = []  # at most one entry: the applied shim (explicit state, not a cache)


def apply_cpu_shims() -> None:
    """Make Megatron-Core run on the CPU in this process. Idempotent; undo with `undo_cpu_shims`.

    Where an earlier patch's undo put an original back over part of the shim (`mock.patch.object` entered
    before it, exited after), the shim is off (`cpu_shims_applied`) and is installed again. An apply that
    fails part way (a shimmed module that does not import) restores what it had set before raising.

    Raises:
        RuntimeError: CUDA is available (the shim would hide real device bugs), or the shim is partly off and
            something installed after it holds one of its attributes (see `undo_cpu_shims`).
    """
    if cpu_shims_applied():
        return
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() is for CPU-only machines; CUDA is available here")
    undo_cpu_shims()  # records of a shim an earlier patch's undo turned off in part: install afresh
    patches = _Patches()
    try:
        _set_attributes(patches)
    except BaseException:
        patches.owned.restore()  # no shim half-applied and unrecorded: undo could never restore it
        raise
    patches.mode = CudaToCpuMode()
    patches.mode.__enter__()
    _ACTIVE.append(patches)


def _set_attributes(patches: _Patches) -> None:
    """Every attribute the shim replaces, recorded in `patches` as it is set."""
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import torch_norm

    patches.set(torch.cuda, "current_device", lambda: "cpu")
    patches.set(torch.cuda, "synchronize", lambda *a, **k: None)
    patches.set(torch.cuda, "current_stream", lambda *a, **k: _NullStream())
    patches.set(torch.cuda, "manual_seed", lambda seed: None)
    patches.set(torch.cuda, "manual_seed_all", lambda seed: None)
    patches.set(tp_random.CudaRNGStatesTracker, "add", _CpuRngTracker.add)
    patches.set(tp_random.CudaRNGStatesTracker, "fork", _CpuRngTracker.fork)
    norm_cls = torch_norm.WrappedTorchNorm
    patches.set(norm_cls, "__new__", staticmethod(_wrapped_torch_norm_new(norm_cls.__new__)))
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        patches.set(moe_utils, "te_general_gemm", None)
    from megatron.core.models.vision import clip_vit_model

    clip_init = clip_vit_model.CLIPViTModel.__init__
    if clip_init.__defaults__ and clip_init.__defaults__[0] is torch.nn.LayerNorm:
        patches.set(clip_init, "__defaults__", (norm_cls, norm_cls) + clip_init.__defaults__[2:])


def undo_cpu_shims() -> None:
    """Restore everything `apply_cpu_shims` changed. A no-op when nothing is applied.

    Stack-safe: an attribute is restored only while it still holds the shim's value, and the shim's
    TorchFunctionMode is exited only while it is the innermost one.

    Raises:
        RuntimeError: something installed after the shim holds one of its attributes (named, with what
            holds it) or pushed a TorchFunctionMode inside it; nothing is undone.
    """
    if not _ACTIVE:
        return
    patches = _ACTIVE[-1]
    patches.check()
    _ACTIVE.pop()
    patches.mode.__exit__(None, None, None)
    patches.owned.restore()


def cpu_shims_applied() -> bool:
    """The shim runs: applied, every attribute holds its value (or a wrapper of it), its mode on the stack."""
    if not _ACTIVE:
        return False
    patches = _ACTIVE[-1]
    return patches.owned.active() and any(mode is patches.mode for mode in _function_mode_stack())
