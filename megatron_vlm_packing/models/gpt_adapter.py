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


def seconds_entries(micro_batch: MicroBatch) -> int:
    """Entries of the micro-batch's `second_per_grid_ts` (0 without any; `rope.index.entry_count`). Reads no values."""
    from megatron_vlm_packing.rope.index import entry_count

    return entry_count(micro_batch.vision.second_per_grid_ts if micro_batch.vision is not None else None)


def refuse_unread_seconds(micro_batch: MicroBatch, rotary: str, model_name: str) -> None:
    """`second_per_grid_ts` of a model that takes none (GPTModel, PackedVLM) must have been read by the index
    that made its mRoPE positions: with a 1D rotary nothing reads them, and an index of a family outside
    `rope.config.SECONDS_FAMILIES` reads none. Positions given in the batch or made by a callable
    (`mrope_config` None) are taken as made from them. Reads no values.

    Raises:
        ValueError: naming the field, its entries and the model's rotary (or the index's family).
    """
    from megatron_vlm_packing.rope.config import SECONDS_FAMILIES

    entries = seconds_entries(micro_batch)
    if not entries:
        return
    if rotary != "mrope":
        raise ValueError(f"second_per_grid_ts has {entries} entries but {model_name}'s rotary is 1D: nothing reads "
                         f"them (seconds per grid step place video frames in time only in an mRoPE index); drop "
                         f"them from the batch")
    made_with = micro_batch.mrope_config
    if made_with is not None and made_with.family not in SECONDS_FAMILIES:
        raise ValueError(f"second_per_grid_ts has {entries} entries but the micro-batch's mRoPE positions were made "
                         f"by the {made_with.family} index, which reads none (nor does {model_name}): drop them "
                         f"from the batch")


def _uses_packed_mrope(model: nn.Module) -> bool:
    from megatron_vlm_packing.rope.rotary import PackedMultimodalRotaryEmbedding

    return isinstance(getattr(model, "rotary_pos_emb", None), PackedMultimodalRotaryEmbedding)


class GPTModelAdapter(ModelAdapter):
    """Megatron-Core `GPTModel`: CP-local ids, `packed_seq_params`, `padding_mask` where it exists.

    Raises (when built):
        ValueError: an mRoPE GPTModel under CP > 1 whose rotary is Megatron-Core's own (it CP-slices
            the whole packed table: bug class 6); install ours with `rope.use_packed_mrope(model)`.
    """

    consumes = frozenset()

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.takes_padding_mask = "padding_mask" in inspect.signature(type(model).forward).parameters
        self.is_moe = bool(getattr(model.config, "num_moe_experts", None))
        self.rotary = "mrope" if getattr(model, "position_embedding_type", None) == "mrope" else "1d"
        self.mrope = None
        self.needs = LocalizeNeeds(full_input_ids=False, full_position_ids=self.rotary == "mrope")
        self.refuse_megatron_mrope_under_cp(model)

    def refuse_megatron_mrope_under_cp(self, model: nn.Module) -> None:
        """Bug class 6: Megatron-Core's mRoPE rotary CP-slices the whole packed table."""
        if self.rotary == "mrope" and model.config.context_parallel_size > 1 and not _uses_packed_mrope(model):
            raise ValueError(f"{self.model_name} uses mRoPE at context_parallel_size="
                             f"{model.config.context_parallel_size} with Megatron-Core's own rotary, which "
                             f"CP-slices the whole packed table (bug class 6): call "
                             f"megatron_vlm_packing.rope.use_packed_mrope(model) first")

    def check(self, micro_batch: MicroBatch) -> None:
        refuse_unread_seconds(micro_batch, self.rotary, self.model_name)  # first: it says why (a 1D rotary)
        super().check(micro_batch)
        check_unpacked_ids(micro_batch, self.vocab_size)
        check_position_kind(micro_batch, self.rotary, self.model_name)
        if self.is_moe and not self.takes_padding_mask and micro_batch.stats.physical_tokens > micro_batch.stats.real_tokens:
            raise ValueError(f"{self.model_name} is a mixture-of-experts model whose forward takes no padding_mask, "
                             f"so its router would count {micro_batch.stats.physical_tokens - micro_batch.stats.real_tokens} "
                             f"pad slots in the load-balancing loss; use a megatron-core whose GPTModel.forward "
                             f"takes padding_mask")

    def forward(self, model: nn.Module, micro_batch: MicroBatch):
        kwargs = {"padding_mask": micro_batch.padding_mask} if self.takes_padding_mask else {}
        # position_ids by keyword: Megatron's Float16Module casts float32 positional inputs to bf16 / fp16,
        # which would round Qwen3-Omni's fractional positions (300.25 -> 300, 325.25 -> 326).
        return model(micro_batch.input_ids, position_ids=micro_batch.position_ids, attention_mask=None,
                     labels=micro_batch.labels, packed_seq_params=micro_batch.packed_seq_params, **kwargs)
