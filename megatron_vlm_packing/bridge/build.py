"""Build tiny Megatron-Bridge models on a CPU, with Bridge's own providers and TE-free specs.

Bridge's Qwen3-VL provider and model module hard-code Transformer Engine layers (the language
layer spec, the vision layer spec, the patch merger's norm and linears). Without TE those names
are None or placeholders. `build_with_provider` calls a provider's own `provide()` with those
module-level names swapped, only for the duration of the call, for Megatron-Core's local
equivalents whose core attention takes packed (THD) input. The model that comes out is Bridge's
class, built by Bridge's code; only the layer implementations differ from a GPU build.

Families (`BRIDGE_FAMILIES`): "qwen25_vl", "qwen3_vl", "qwen3_vl_moe". Another family (e.g.
Qwen3-Omni) plugs in with its provider module's names in `te_free_names(...)`-style swaps and the
same `build_with_provider`.

Parity needs: fp32, dropout 0, `use_cpu_initialization` (weights from the CPU RNG, so a TP>1 build
holds exactly the shards of the TP=1 build with the same seed), `_pg_collection` from Megatron's
parallel state (call `initialize_model_parallel` first).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any, Iterator

import torch

from megatron_vlm_packing.bridge.imports import bare_bridge_packages, import_bridge_module

QWEN3_VL_PROVIDER = "megatron.bridge.models.qwen_vl.qwen3_vl_provider"
QWEN3_VL_MODEL = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
QWEN25_VL_PROVIDER = "megatron.bridge.models.qwen_vl.qwen25_vl_provider"
BRIDGE_FAMILIES = ("qwen25_vl", "qwen3_vl", "qwen3_vl_moe")


@contextmanager
def swapped_names(module: ModuleType, replacements: dict[str, Any]) -> Iterator[None]:
    """Replace module-level names for the duration of the block; restore them exactly after.

    Raises:
        ValueError: a name the module does not define (a Bridge version that changed its imports).
    """
    missing = [name for name in replacements if not hasattr(module, name)]
    if missing:
        raise ValueError(f"{module.__name__} defines no {missing}: this Bridge version builds differently")
    saved = {name: getattr(module, name) for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def packed_core_attention(backend: str = "reference") -> type:
    """A Megatron-Core core attention that takes `packed_seq_params` (THD): ours."""
    if backend == "reference":
        from megatron_vlm_packing.attention.reference import ReferenceCoreAttention

        return ReferenceCoreAttention
    if backend == "torch":
        from megatron_vlm_packing.attention.torch_varlen import TorchVarlenCoreAttention

        return TorchVarlenCoreAttention
    raise ValueError(f"backend must be 'reference' or 'torch' for a TE-free build, got {backend!r}")


def local_gpt_layer_spec(*, core_attention: type, num_experts: int | None = None, qk_layernorm: bool = False,
                         **unused) -> Any:
    """Megatron-Core's local GPT layer spec with `core_attention` (signature-compatible with
    `get_gpt_layer_with_transformer_engine_spec`; `moe_grouped_gemm` / `fp8` are ignored: the local
    experts are sequential)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm))
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def local_vit_layer_spec(*, core_attention: type) -> Any:
    """Megatron-Core's local ViT layer spec with `core_attention` (Bridge's vision tower runs THD)."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = copy.deepcopy(get_vit_layer_with_local_spec())
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def qwen3_vl_te_free_swaps(core_attention: type) -> list[tuple[str, dict[str, Any]]]:
    """(module name, {name: local replacement}) for Bridge's Qwen3-VL provider and model modules."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def gpt_spec(**kwargs):
        return local_gpt_layer_spec(core_attention=core_attention, **kwargs)

    def vit_spec():
        return local_vit_layer_spec(core_attention=core_attention)

    return [
        (QWEN3_VL_PROVIDER, {"get_gpt_layer_with_transformer_engine_spec": gpt_spec}),
        (QWEN3_VL_MODEL, {"get_vit_layer_with_transformer_engine_spec": vit_spec, "TENorm": WrappedTorchNorm,
                          "TEColumnParallelLinear": ColumnParallelLinear, "TERowParallelLinear": RowParallelLinear}),
    ]


def build_with_provider(provider, *, swaps: list[tuple[str, dict[str, Any]]] = (), pre_process=None,
                        post_process=None, vp_stage=None, seed: int | None = None) -> torch.nn.Module:
    """`provider.provide(...)` with Megatron's process groups, `finalize()`, and TE names swapped; the
    model's `model_type` set as Bridge's `get_model` sets it (Megatron's pipeline schedules read it).

    Args:
        provider: a Bridge model provider (dataclass), fully configured.
        swaps: (Bridge module name, {name: replacement}) swapped only during `provide`.
        seed: re-seed the CPU RNG and Megatron's model-parallel RNG tracker first (same seed ->
            same weights at any TP, with `use_cpu_initialization`).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if seed is not None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.tensor_parallel import random as tp_random

        torch.manual_seed(seed)
        tp_random.get_cuda_rng_tracker().reset()
        model_parallel_cuda_manual_seed(seed)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    if pre_process is None or post_process is None:  # some providers pass None on to the model as False
        from megatron.core import parallel_state as ps

        pre_process = ps.is_pipeline_first_stage() if pre_process is None else pre_process
        post_process = ps.is_pipeline_last_stage() if post_process is None else post_process
    with ExitStack() as stack:
        stack.enter_context(bare_bridge_packages())  # lazy imports inside provide() stay TE-free too
        for module_name, names in swaps:
            stack.enter_context(swapped_names(import_bridge_module(module_name), names))
        provider.finalize()
        model = provider.provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    from megatron.core.enums import ModelType

    model.model_type = ModelType.encoder_or_decoder  # what Bridge's get_model sets (Megatron's schedules read it)
    return model
