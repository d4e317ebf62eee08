"""`layer_spec(backend=...)`: a GPT layer spec with the chosen core attention.

- "reference": exact attention on any device, THD with both boundary sets, CP (tests, CPU CI).
- "torch": torch `varlen_attn` on CUDA (packed THD without Transformer Engine; no CP).
- "te": Megatron-Core's own Transformer Engine spec, untouched.
- "auto": "te" when TE imports and CUDA is present, else "torch" when varlen_attn runs, else
  "reference". It never picks a backend that cannot run here.
"""

from __future__ import annotations

import copy

import torch

BACKENDS = ("auto", "reference", "torch", "te")


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken TE install raises more than ImportError
        return False
    return True


def resolve_backend(backend: str) -> str:
    from megatron_vlm_packing.attention.torch_varlen import varlen_available

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "te" if te_available() else "torch" if varlen_available() else "reference"
    if backend == "te" and not te_available():
        raise ValueError("backend='te' needs Transformer Engine and a CUDA device")
    if backend == "torch" and not varlen_available():
        raise ValueError("backend='torch' needs CUDA and torch >= 2.10 (torch.nn.attention.varlen)")
    return backend


def layer_spec(backend: str = "auto", *, num_experts: int | None = None, qk_layernorm: bool = False):
    """GPT transformer-layer spec (megatron.core ModuleSpec) with the chosen core attention."""
    backend = resolve_backend(backend)
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
