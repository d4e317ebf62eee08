"""Tiny Megatron-Core GPTModel factories for tests, benchmarks and the demo.

Sized to run a forward + backward in well under a second on 2 CPU cores. Weights come from the CPU
RNG (`use_cpu_initialization`) so a model built under TP > 1 holds exactly the shards of the model
built with the same seed under TP = 1: parallel runs can be compared with one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class TinyGPTConfig:
    """Shape and parallel layout of a tiny GPT.

    Attributes:
        position_embedding_type: "learned_absolute", "rope" or "mrope".
        mrope_section: rotary frequency split over (t, h, w) for "mrope"; sums to kv_channels // 2.
        backend: core attention ("auto", "reference", "torch", "te"), see `attention.layer_spec`.
    """

    num_layers: int = 2
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 64
    vocab_size: int = 128
    max_sequence_length: int = 256
    position_embedding_type: str = "rope"
    mrope_section: tuple[int, ...] = (1, 1, 2)
    backend: str = "reference"
    tensor_parallel: int = 1
    context_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0
    params_dtype: torch.dtype = torch.float32
    extra: dict = field(default_factory=dict)


def transformer_config(cfg: TinyGPTConfig):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=cfg.tensor_parallel, context_parallel_size=cfg.context_parallel,
        pipeline_model_parallel_size=cfg.pipeline_parallel, sequence_parallel=cfg.sequence_parallel,
        use_cpu_initialization=True, perform_initialization=True, params_dtype=cfg.params_dtype,
        bf16=cfg.params_dtype == torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        normalization="LayerNorm", add_bias_linear=False, gated_linear_unit=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        calculate_per_token_loss=True, init_method_std=0.05,
        pipeline_dtype=cfg.params_dtype if cfg.pipeline_parallel > 1 else None,
    )
    if cfg.num_moe_experts:
        kwargs.update(num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
                      moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_router_load_balancing_type="aux_loss",
                      moe_token_dispatcher_type="allgather", moe_grouped_gemm=False)
    if cfg.position_embedding_type == "mrope":
        kwargs["mrope_section"] = list(cfg.mrope_section)
    kwargs.update(cfg.extra)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(cfg: TinyGPTConfig, *, pre_process: bool = True, post_process: bool = True, **gpt_kwargs):
    """A GPTModel on the current parallel state. Seed the CPU RNG before calling for fixed weights.

    Pipeline stages: pass `pre_process`/`post_process` for the stage (see
    `megatron.core.parallel_state.is_pipeline_first_stage`).
    """
    from megatron.core.models.gpt import GPTModel

    from megatron_vlm_packing.attention import layer_spec

    config = transformer_config(cfg)
    kwargs = dict(
        config=config, transformer_layer_spec=layer_spec(
            cfg.backend, num_experts=cfg.num_moe_experts, context_parallel_size=cfg.context_parallel),
        vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_sequence_length,
        pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=False, position_embedding_type=cfg.position_embedding_type,
    )
    kwargs.update(gpt_kwargs)
    return GPTModel(**kwargs)
