"""The adapter of a plain Megatron-Core `GPTModel` (text only).

A GPTModel embeds the tokens it is given, so it takes this CP rank's ids (`localize` cuts them);
mRoPE positions stay full length (the packed rotary returns the full table and THD attention takes
each document's CP chunks; in dense mode it slices itself).

The padding mask goes as Megatron-Core's `padding_mask` keyword where the installed
`GPTModel.forward` has it (decided once, when the adapter is built). Attention never needs it:
pad slots lie outside every real span of `cu_seqlens` (packed) and after every real token of a
row (dense, causal), so no real token attends to them, and their losses carry weight 0. Only a
mixture-of-experts router reads it (pads must not count in the load-balancing loss); so on a
GPTModel without the keyword an MoE model refuses micro-batches that have pad slots, and a dense
model runs them.

Under sequence parallelism a GPTModel built with `scatter_embedding_sequence_parallel=False` (a VLM's
language model, reused alone) relies on `GPTModel` to scatter the embeddings it makes; megatron-core
before 0.19 never does (bug class 3: every TP rank ran the whole sequence, a shape error deep inside
attention or the loss). Where this megatron-core lacks the fix, the adapter refuses such a model while
`patches.apply_sp_embedding_scatter()` is off, asked for every micro-batch (the patch may be undone after
the adapter was built).
"""

from __future__ import annotations

import inspect

from torch import nn

from megatron_vlm_packing.models.adapter import ModelAdapter, check_unpacked_ids
from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.micro_batch import MicroBatch


def check_position_kind(micro_batch: MicroBatch, rotary: str, model_name: str) -> None:
    """3D positions only for an mRoPE model, and an mRoPE model only with 3D positions (bug class 1).

    Raises:
        ValueError: naming the positions' shape and the model's rotary.
    """
    three_d = micro_batch.position_ids.dim() == 3
    if rotary == "mrope" and not three_d:
        raise ValueError(f"{model_name} uses mRoPE but the micro-batch has 1D position_ids of shape "
                         f"{tuple(micro_batch.position_ids.shape)}: pass make_forward_step(mrope=MRopeConfig(...)) "
                         f"(1D positions copied to 3 channels lose every image token's t/h/w)")
    if rotary != "mrope" and three_d:
        raise ValueError(f"{model_name}'s rotary is 1D but the micro-batch has mRoPE position_ids of shape "
                         f"{tuple(micro_batch.position_ids.shape)}: drop mrope= (and [3, B, S] position_ids) "
                         f"or build an mRoPE model")


def refuse_unread_seconds(micro_batch: MicroBatch, rotary: str, model_name: str) -> None:
    """`second_per_grid_ts` of a model that takes none (GPTModel, PackedVLM) must have been read by the index
    that made its mRoPE positions: with a 1D rotary nothing reads them, and an index of a family outside
    `rope.config.SECONDS_FAMILIES` reads none (`rope.index_checks.refuse_seconds_unread_by`, the one rule).
    Positions given in the batch or made by a callable (`mrope_config` None) are taken as made from them. Reads no
    values.

    Raises:
        ValueError: naming the field, its entries, the model and its rotary (or the index's family).
    """
    from megatron_vlm_packing.rope.index_checks import refuse_seconds_unread_by

    seconds = micro_batch.vision.second_per_grid_ts if micro_batch.vision is not None else None
    if rotary != "mrope":
        refuse_seconds_unread_by(None, seconds, model_name)
    elif micro_batch.mrope_config is not None:
        refuse_seconds_unread_by(micro_batch.mrope_config.family, seconds, model_name)


def refuse_pads_unmasked_for_moe(micro_batch: MicroBatch, model_name: str, *, is_moe: bool,
                                 takes_padding_mask: bool) -> None:
    """Only a mixture-of-experts router reads the padding mask (pads must not count in its load-balancing loss): a
    language model whose forward takes none (a subclass of an older `GPTModel.forward`) runs micro-batches without
    pad slots, and refuses the others. The GPT adapter and `PackedVLM`'s share it. Reads host ints only.

    Raises:
        ValueError: naming the model and its pad slots.
    """
    pads = micro_batch.stats.physical_tokens - micro_batch.stats.real_tokens
    if is_moe and not takes_padding_mask and pads > 0:
        raise ValueError(f"{model_name} is a mixture-of-experts model whose forward takes no padding_mask, so its "
                         f"router would count {pads} pad slots in the load-balancing loss; give its forward "
                         f"Megatron-Core's padding_mask keyword (GPTModel.forward has it) or pack without pad slots")


def needs_embedding_scatter_patch(model: nn.Module) -> bool:
    """Bug class 3: does `model`, called standalone (no `decoder_input`), need
    `patches.apply_sp_embedding_scatter()` for its embeddings to be scattered under SP?

    Only a first pipeline stage embeds (later stages have no `embedding`); with TP = 1 the scatter keeps
    every token anyway. Reads the upstream source (`upstream_scatters_standalone_embeddings`) only for
    that layout, once, when the adapter is built.

    Raises:
        RuntimeError: that layout, and the source of `GPTModel.forward` cannot be read (the probe cannot tell).
    """
    embedding = getattr(model, "embedding", None)
    config = model.config
    if embedding is None or getattr(embedding, "scatter_to_sequence_parallel", True) \
            or not config.sequence_parallel or int(config.tensor_model_parallel_size or 1) == 1:
        return False
    from megatron_vlm_packing.patches.gpt_model_forward import upstream_scatters_standalone_embeddings

    return not upstream_scatters_standalone_embeddings()


def _uses_packed_mrope(model: nn.Module) -> bool:
    from megatron_vlm_packing.rope.rotary import PackedMultimodalRotaryEmbedding

    return isinstance(getattr(model, "rotary_pos_emb", None), PackedMultimodalRotaryEmbedding)


class GPTModelAdapter(ModelAdapter):
    """Megatron-Core `GPTModel`: CP-local ids, `packed_seq_params`, `padding_mask` where it exists.

    Raises (when built):
        ValueError: an mRoPE GPTModel under CP > 1 whose rotary is Megatron-Core's own (it CP-slices
            the whole packed table: bug class 6); install ours with `rope.use_packed_mrope(model)`.
    Raises (per micro-batch, `check`):
        ValueError: a model whose embeddings nothing scatters under SP (`needs_embedding_scatter_patch`)
            while `patches.apply_sp_embedding_scatter()` is off (bug class 3).
    """

    checks_unpacked_ids = True  # check() refuses ids no packer checked: the step reads them in its one read

    consumes = frozenset()

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.takes_padding_mask = "padding_mask" in inspect.signature(type(model).forward).parameters
        self.is_moe = bool(getattr(model.config, "num_moe_experts", None))
        self.rotary = "mrope" if getattr(model, "position_embedding_type", None) == "mrope" else "1d"
        self.mrope = None
        self.needs = LocalizeNeeds(full_input_ids=False, full_position_ids=self.rotary == "mrope")
        self.refuse_megatron_mrope_under_cp(model)
        self.tp_size = int(model.config.tensor_model_parallel_size or 1)
        self.needs_embedding_scatter_patch = needs_embedding_scatter_patch(model)

    def refuse_megatron_mrope_under_cp(self, model: nn.Module) -> None:
        """Bug class 6: Megatron-Core's mRoPE rotary CP-slices the whole packed table."""
        if self.rotary == "mrope" and model.config.context_parallel_size > 1 and not _uses_packed_mrope(model):
            raise ValueError(f"{self.model_name} uses mRoPE at context_parallel_size="
                             f"{model.config.context_parallel_size} with Megatron-Core's own rotary, which "
                             f"CP-slices the whole packed table (bug class 6): call "
                             f"megatron_vlm_packing.rope.use_packed_mrope(model) first")

    def refuse_unscattered_embeddings(self) -> None:
        """Bug class 3, asked per micro-batch: the patch's live state, not the state when the adapter was built."""
        from megatron_vlm_packing.patches.gpt_model_forward import embedding_scatter_applied

        if self.needs_embedding_scatter_patch and not embedding_scatter_applied():
            raise ValueError(f"{self.model_name} was built with scatter_embedding_sequence_parallel=False and runs at "
                             f"tensor_model_parallel_size={self.tp_size} with sequence_parallel=True: called "
                             f"standalone, this megatron-core's GPTModel never scatters its embeddings, so every TP "
                             f"rank would run the whole sequence instead of 1/{self.tp_size} of it (bug class 3); "
                             f"call megatron_vlm_packing.patches.apply_sp_embedding_scatter() (or patches.apply_all()) "
                             f"before training, or build the model with scatter_embedding_sequence_parallel=True")

    def check(self, micro_batch: MicroBatch) -> None:
        self.refuse_unscattered_embeddings()
        refuse_unread_seconds(micro_batch, self.rotary, self.model_name)  # first: it says why (a 1D rotary)
        super().check(micro_batch)
        check_unpacked_ids(micro_batch, self.vocab_size)
        check_position_kind(micro_batch, self.rotary, self.model_name)
        refuse_pads_unmasked_for_moe(micro_batch, self.model_name, is_moe=self.is_moe,
                                     takes_padding_mask=self.takes_padding_mask)

    def forward(self, model: nn.Module, micro_batch: MicroBatch):
        kwargs = {"padding_mask": micro_batch.padding_mask} if self.takes_padding_mask else {}
        # position_ids by keyword: Megatron's Float16Module casts float32 positional inputs to bf16 / fp16,
        # which would round Qwen3-Omni's fractional positions (300.25 -> 300, 325.25 -> 326).
        return model(micro_batch.input_ids, position_ids=micro_batch.position_ids, attention_mask=None,
                     labels=micro_batch.labels, packed_seq_params=micro_batch.packed_seq_params, **kwargs)
