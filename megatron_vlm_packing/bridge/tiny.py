"""Tiny Qwen2.5-VL / Qwen3-VL (dense and MoE) models built by Megatron-Bridge's own providers.

`TinyModelConfig` and `language_fields` are what every tiny Bridge model shares (`build_omni`'s
Qwen3-Omni thinker too); `TinyBridgeConfig` adds the Qwen-VL family.

    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, build_tiny_bridge_model
    initialize_parallel(tp=2, cp=1)                       # megatron parallel state first
    cfg = TinyBridgeConfig(family="qwen3_vl", tensor_parallel=2, sequence_parallel=True)
    model = build_tiny_bridge_model(cfg, seed=0)          # Bridge's Qwen3VLModel, TE-free, fp32
    mrope = cfg.mrope_config()                            # for pack_batch(mrope=...)

Sized to run forward + backward in a fraction of a second on a CPU. Placeholder ids sit inside the
small vocabulary; every other field is Bridge's default unless parity needs it changed (fp32,
dropout 0, CPU initialization, no fusions that need CUDA kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_vlm_packing.bridge.build import (
    BRIDGE_FAMILIES, QWEN25_VL_PROVIDER, QWEN3_VL_PROVIDER, build_with_provider, local_gpt_layer_spec,
    packed_core_attention, qwen3_vl_te_free_swaps,
)
from megatron_vlm_packing.bridge.imports import import_bridge_module


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """What every tiny Bridge model shares: a Qwen3-style language model (RMSNorm, SwiGLU, q/k
    layernorm, mRoPE), a Qwen-style vision tower and the parallel layout. Subclasses add their family's
    own fields and `token_ids`.

    Attributes:
        num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size: the
            language model (kv_channels = hidden_size / heads; mrope_section sums to kv_channels / 2).
        vocab_size: placeholder ids sit at its top (`token_ids`).
        vision_depth, vision_hidden, vision_heads, patch_size: the vision tower.
        deepstack_visual_indexes: vision layers whose features also enter LM layers 0, 1, ... (Bridge
            asserts they all sit on the first pipeline stage: num_layers / pipeline_parallel >= their count).
            Keep num_layers above their count: a level enters only the vision placeholders' hidden states,
            which carry no loss, so a level added after the last layer reaches no trained token (at 2 layers
            and 2 levels the last level's merger had gradient exactly 0 and no loss check could see it:
            tests/bridge/test_deepstack_signal.py).
        tensor_parallel, context_parallel, pipeline_parallel, sequence_parallel: must match
            Megatron's parallel state when building.
        tie_embeddings: the output layer shares the word embeddings (small Qwen-VL checkpoints do;
            under PP the last stage holds a copy that Megatron's `finalize_model_grads` keeps in sync).
        attention_backend: "reference" (exact, CPU, CP) or "torch" (GPU varlen).
    """

    num_layers: int = 3  # > len(deepstack_visual_indexes): a layer follows every deepstack level
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 96
    vocab_size: int = 256
    mrope_section: tuple[int, int, int] = (2, 3, 3)
    vision_depth: int = 2
    vision_hidden: int = 32
    vision_heads: int = 2
    patch_size: int = 4
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    tensor_parallel: int = 1
    context_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    tie_embeddings: bool = False
    attention_backend: str = "reference"

    def __post_init__(self) -> None:
        kv_channels = self.hidden_size // self.num_attention_heads
        if 2 * sum(self.mrope_section) != kv_channels:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to kv_channels / 2 = {kv_channels // 2}")

    @property
    def token_ids(self) -> dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} must define token_ids")

    @property
    def patch_features(self) -> int:
        """Features per vision patch row of `pixel_values`: C * temporal_patch * patch * patch."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2


@dataclass(frozen=True, kw_only=True)
class TinyBridgeConfig(TinyModelConfig):
    """A tiny Qwen2.5-VL / Qwen3-VL (dense or MoE): `TinyModelConfig` plus the family.

    Attributes:
        family: "qwen25_vl", "qwen3_vl" or "qwen3_vl_moe".
        num_moe_experts, moe_router_topk: the MoE language model ("qwen3_vl_moe").
    Placeholder ids are vocab_size - 1 .. vocab_size - 6.
    """

    family: str = "qwen3_vl"
    num_moe_experts: int = 4
    moe_router_topk: int = 2

    def __post_init__(self) -> None:
        if self.family not in BRIDGE_FAMILIES:
            raise ValueError(f"family must be one of {BRIDGE_FAMILIES}, got {self.family!r}")
        super().__post_init__()

    @property
    def token_ids(self) -> dict[str, int]:
        top = self.vocab_size
        return dict(image_token_id=top - 1, video_token_id=top - 2, vision_start_token_id=top - 3,
                    vision_end_token_id=top - 4, bos_token_id=top - 5, eos_token_id=top - 6)

    def mrope_config(self):
        """This model's `rope.MRopeConfig` (for `pack_batch(mrope=...)`)."""
        from megatron_vlm_packing.rope import MRopeConfig

        ids = self.token_ids
        qwen3 = self.family != "qwen25_vl"
        return MRopeConfig(family="qwen3_vl" if qwen3 else "qwen2_5_vl", spatial_merge_size=self.spatial_merge_size,
                           image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
                           vision_start_token_id=ids["vision_start_token_id"], mrope_section=self.mrope_section,
                           mrope_interleaved=qwen3, tokens_per_second=2.0)


def language_fields(cfg: TinyModelConfig) -> dict:
    """Provider fields every tiny Bridge model shares (Qwen-VL and Qwen3-Omni): sizes, parallel layout,
    fp32 / dropout 0 / CPU init, no CUDA-only fusions, `cfg.token_ids`."""
    return dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=cfg.hidden_size // cfg.num_attention_heads, vocab_size=cfg.vocab_size,
        seq_length=1024, mrope_section=list(cfg.mrope_section),
        tensor_model_parallel_size=cfg.tensor_parallel, context_parallel_size=cfg.context_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel, sequence_parallel=cfg.sequence_parallel,
        pipeline_dtype=torch.float32 if cfg.pipeline_parallel > 1 else None,
        params_dtype=torch.float32, bf16=False, fp16=False, use_cpu_initialization=True,
        perform_initialization=True, init_method_std=0.05, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, qk_layernorm=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, calculate_per_token_loss=True, share_embeddings_and_output_weights=cfg.tie_embeddings,
        make_vocab_size_divisible_by=128, **cfg.token_ids,
    )


def qwen3_vl_provider(cfg: TinyBridgeConfig):
    """Bridge's `Qwen3VLModelProvider` / `Qwen3VLMoEModelProvider` for `cfg` (not yet built)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    module = import_bridge_module(QWEN3_VL_PROVIDER)
    vision = Qwen3VLVisionConfig(
        depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=2 * cfg.vision_hidden,
        num_heads=cfg.vision_heads, in_channels=3, patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
        out_hidden_size=cfg.hidden_size, num_position_embeddings=64,
        deepstack_visual_indexes=list(cfg.deepstack_visual_indexes))
    fields = dict(language_fields(cfg), vision_config=vision, patch_size=cfg.patch_size,
                  temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
                  language_max_sequence_length=1024, deepstack_visual_indexes=list(cfg.deepstack_visual_indexes))
    if cfg.family == "qwen3_vl_moe":
        return module.Qwen3VLMoEModelProvider(
            **fields, num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.ffn_hidden_size, moe_grouped_gemm=False, moe_permute_fusion=False,
            moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
            freeze_language_model=False, freeze_vision_model=False, head_dim=cfg.hidden_size // cfg.num_attention_heads)
    return module.Qwen3VLModelProvider(**fields, out_hidden_size=cfg.hidden_size)


def qwen25_vl_provider(cfg: TinyBridgeConfig):
    """Bridge's `Qwen25VLModelProvider` for `cfg`, its `transformer_layer_spec` set to a local spec."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    module = import_bridge_module(QWEN25_VL_PROVIDER)
    vision = Qwen2_5_VLVisionConfig(
        depth=cfg.vision_depth, hidden_size=cfg.vision_hidden, intermediate_size=2 * cfg.vision_hidden,
        num_heads=cfg.vision_heads, in_channels=3, patch_size=cfg.patch_size,
        temporal_patch_size=cfg.temporal_patch_size, spatial_merge_size=cfg.spatial_merge_size,
        out_hidden_size=cfg.hidden_size, window_size=4 * cfg.patch_size * cfg.spatial_merge_size,
        fullatt_block_indexes=[cfg.vision_depth - 1], tokens_per_second=2)
    vision._attn_implementation = "eager"
    spec = local_gpt_layer_spec(core_attention=packed_core_attention(cfg.attention_backend), qk_layernorm=True)
    fields = language_fields(cfg)
    fields["vision_token_id"] = fields.pop("vision_end_token_id") + 0  # Qwen2.5-VL names it vision_token_id
    return module.Qwen25VLModelProvider(**fields, vision_config=vision, transformer_layer_spec=spec)


def tiny_bridge_provider(cfg: TinyBridgeConfig):
    """The Bridge provider for `cfg.family`."""
    return qwen25_vl_provider(cfg) if cfg.family == "qwen25_vl" else qwen3_vl_provider(cfg)


def build_tiny_bridge_model(cfg: TinyBridgeConfig, seed: int = 0, *, pre_process=None, post_process=None):
    """Bridge's own model (`Qwen25VLModel` / `Qwen3VLModel`) for `cfg`, built on the local specs.

    Megatron's parallel state must match cfg's layout. With the same seed the weights at any TP are
    the shards of the TP=1 weights.
    """
    provider = tiny_bridge_provider(cfg)
    swaps = [] if cfg.family == "qwen25_vl" else qwen3_vl_te_free_swaps(packed_core_attention(cfg.attention_backend))
    return build_with_provider(provider, swaps=swaps, pre_process=pre_process, post_process=post_process, seed=seed)
