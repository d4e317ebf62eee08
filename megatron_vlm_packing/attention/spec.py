"""`layer_spec(backend=...)`: a GPT layer spec with the chosen core attention.

- "reference": exact attention on any device, THD with both boundary sets, CP (tests, CPU CI).
- "torch": torch `varlen_attn` on CUDA (packed THD without Transformer Engine; no CP).
- "te": Megatron-Core's own Transformer Engine spec, untouched.
- "auto": "te" when TE imports and CUDA is present, else "torch" when varlen_attn runs and there is
  no context parallelism, else "reference". It never picks a backend that cannot run here.
"""

from __future__ import annotations

import copy

import torch

from megatron_vlm_packing.packing.bounds import is_int

BACKENDS = ("auto", "reference", "torch", "te")


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install raises more than ImportError
        return False
    return True


def check_context_parallel_size(size) -> int:
    """`size` as a Python int when it is a positive int (`bounds.is_int`: a numpy int too), else ValueError naming
    `context_parallel_size` and the value.

    A bool is not one (True compared equal to 1 and ran as CP = 1), nor is a float or a tensor; as
    `ParallelLayout` and `PackMultiples` check it.
    """
    if not is_int(size) or size < 1:
        raise ValueError(f"context_parallel_size must be a positive int, got {size!r} ({type(size).__name__})")
    return int(size)


def resolve_backend(backend: str, *, context_parallel_size: int = 1) -> str:
    """The backend that `backend` means here ("auto" resolved).

    Raises:
        ValueError: an unknown name, a `context_parallel_size` that is not a positive int (a
            bool is not: True compared equal to 1 and ran as CP = 1; as `ParallelLayout` and
            `PackMultiples` check it), or a backend that cannot run here (names what is missing).
    """
    from megatron_vlm_packing.attention.torch_varlen import varlen_available

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_context_parallel_size(context_parallel_size)
    torch_ok = varlen_available() and context_parallel_size == 1
    if backend == "auto":
        return "te" if te_available() else "torch" if torch_ok else "reference"
    if backend == "te" and not te_available():
        raise ValueError("backend='te' needs Transformer Engine and a CUDA device")
    if backend == "torch" and not varlen_available():
        raise ValueError("backend='torch' needs CUDA and torch >= 2.10 (torch.nn.attention.varlen)")
    if backend == "torch" and context_parallel_size != 1:
        raise ValueError(f"backend='torch' has no context parallelism (context_parallel_size={context_parallel_size})")
    return backend


def layer_spec(backend: str = "auto", *, num_experts: int | None = None, qk_layernorm: bool = False,
               context_parallel_size: int = 1):
    """GPT transformer-layer spec (megatron.core ModuleSpec) with the chosen core attention.

    `context_parallel_size` lets "auto" skip backends without CP; pass the model config's.
    """
    backend = resolve_backend(backend, context_parallel_size=context_parallel_size)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_vlm_packing.attention.reference import ReferenceCoreAttention
    from megatron_vlm_packing.attention.torch_varlen import TorchVarlenCoreAttention

    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm))
    core = ReferenceCoreAttention if backend == "reference" else TorchVarlenCoreAttention
    spec.submodules.self_attention.submodules.core_attention = core
    return spec
