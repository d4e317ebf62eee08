"""Megatron-Bridge's Qwen-VL models (and the builders other families reuse) on this package's step.

Nothing here imports Megatron-Bridge at import time:
- `imports`: Bridge's leaf model modules on demand, without its TE-importing package chain;
- `build`: a provider's own `provide()` with its TE names swapped for local layers (any family);
- `tiny`: the shared `TinyModelConfig`, tiny Qwen2.5-VL / Qwen3-VL (dense, MoE) configs and builders;
  `build_omni`: tiny Qwen3-Omni thinkers and Omni samples (CPU tests);
- `samples`: text + images + videos in each family's token layout;
- `adapters`: `Qwen3VLAdapter`, `Qwen25VLAdapter`; `omni_adapter`: `Qwen3OmniAdapter` (registered in
  `models.adapter`);
- `truth`: each family's one-sample dense truth on Bridge's own code;
- `parity` / `parity_pp` / `smoke`: packed vs each sample alone (`python -m megatron_vlm_packing.bridge.parity`,
  `... .bridge.parity_pp` for pipeline parallelism through Megatron-Core's schedule).
Patches for Bridge's defects live in `patches/bridge_*.py` (`patches.apply_bridge_patches()`).
"""

from megatron_vlm_packing.bridge.imports import (
    bare_bridge_packages, bridge_unavailable_reason, bridge_version, import_bridge_module, import_bridge_modules,
)

__all__ = [
    "bare_bridge_packages", "bridge_unavailable_reason", "bridge_version", "import_bridge_module",
    "import_bridge_modules",
]
