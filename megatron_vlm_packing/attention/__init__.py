"""Core-attention backends for Megatron-Core layer specs: reference (CPU/GPU, CP), torch varlen, TE."""

from megatron_vlm_packing.attention.reference import ReferenceCoreAttention, masked_attention
from megatron_vlm_packing.attention.spec import BACKENDS, layer_spec, resolve_backend, te_available
from megatron_vlm_packing.attention.torch_varlen import TorchVarlenCoreAttention, varlen_available

__all__ = [
    "BACKENDS", "ReferenceCoreAttention", "TorchVarlenCoreAttention", "layer_spec", "masked_attention",
    "resolve_backend", "te_available", "varlen_available",
]
