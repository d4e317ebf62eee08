"""Megatron-Bridge's Qwen-VL models (and the builders other families reuse) on this package's step.

Nothing here imports Megatron-Bridge at import time: `imports` finds and imports Bridge's leaf
model modules on demand, without its Transformer-Engine-importing package chain; `build` builds
tiny models with Bridge's own providers and TE-free specs; `adapters` drive them packed.
"""

from megatron_vlm_packing.bridge.imports import (
    bare_bridge_packages, bridge_unavailable_reason, bridge_version, import_bridge_module, import_bridge_modules,
)

__all__ = [
    "bare_bridge_packages", "bridge_unavailable_reason", "bridge_version", "import_bridge_module",
    "import_bridge_modules",
]
