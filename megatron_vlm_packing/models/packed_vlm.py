"""`PackedVLM`: any Megatron-Core GPTModel + a vision tower, exact under packing, CP and SP.

The order of operations is the point (contract items 5, 6 and 8):
1. embed the FULL `input_ids` (the LM's own SP scatter must be off: build it with
   `scatter_embedding_sequence_parallel=False`),
2. place the vision embeddings at the placeholder tokens (needs the full ids),
3. select this CP rank's tokens with the one CP index the batch was partitioned with,
4. scatter for sequence parallelism, once,
5. run the decoder with `decoder_input`, the packed boundaries and the (CP-local) positions.

Shape legend: T = packed physical tokens, Tl = CP-local tokens, B = rows, S = row length, H = hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_vlm_packing.models.merge import merge_vision_embeddings


class PackedVLM(nn.Module):
    """Language model + vision tower with packing-exact embedding merge, CP selection and SP scatter.

    Args:
        language_model: a Megatron-Core `GPTModel` built with `scatter_embedding_sequence_parallel=False`.
        vision: module mapping `(pixel_values, image_grid_thw) -> [M, H]`; None for text-only.
        image_token_id: the placeholder id each vision embedding replaces.
    """

    def __init__(self, language_model: nn.Module, vision: nn.Module | None, *, image_token_id: int):
        super().__init__()
        embedding = getattr(language_model, "embedding", None)
        if embedding is not None and getattr(embedding, "scatter_to_sequence_parallel", False) \
                and language_model.config.sequence_parallel:
            raise ValueError("build the language model with scatter_embedding_sequence_parallel=False: "
                             "PackedVLM scatters once, after merging vision embeddings and selecting CP tokens")
        self.language_model = language_model
        self.vision = vision
        self.image_token_id = image_token_id
        self.config = language_model.config
        self.model_type = language_model.model_type  # read by Megatron's schedules

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages after the first receive hidden states here (Megatron's schedule calls it)."""
        self.language_model.set_input_tensor(input_tensor)

    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None) -> torch.Tensor:
        """Full-sequence embeddings with vision rows merged: [S, B, H] (packed: [T, 1, H])."""
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        if pixel_values is None or self.vision is None:
            if bool((input_ids == self.image_token_id).any()):
                raise ValueError("input_ids hold image placeholder tokens but no pixel_values were given")
            return emb
        vision = self.vision(pixel_values, image_grid_thw)  # [M, H]
        flat = emb.transpose(0, 1).reshape(-1, emb.shape[-1])  # [B*S, H], row-major like input_ids
        flat = merge_vision_embeddings(flat, input_ids, vision, token_id=self.image_token_id)
        return flat.reshape(emb.shape[1], emb.shape[0], -1).transpose(0, 1)

    def forward(self, input_ids, position_ids, labels=None, *, packed_seq_params=None, cp_index=None,
                attention_mask=None, padding_mask=None, moe_padding_mask=None, pixel_values=None,
                image_grid_thw=None, rope_cu_seqlens=None, loss_mask=None):
        """Per-token loss [B, Sl] (labels given) or logits.

        Args:
            input_ids: [B, S] long, FULL sequence (packed: [1, T]); never CP-sliced.
            position_ids: CP-local positions ([B, Sl] or [3, B, Sl]).
            labels: CP-local [B, Sl] targets.
            cp_index: [Sl] long, this CP rank's token indices (None when cp = 1).
            padding_mask / moe_padding_mask: CP-local [B, Sl] bool, True = pad (for MoE routing).
            rope_cu_seqlens: accepted for interface compatibility; rotary positions restart at
                `packed_seq_params`' boundaries.
        """
        decoder_input = None
        lm = self.language_model
        if getattr(lm, "pre_process", True):
            emb = self.embed(input_ids, pixel_values, image_grid_thw)
            if cp_index is not None:
                emb = emb.index_select(0, cp_index)
            if self.config.sequence_parallel:
                from megatron.core import tensor_parallel

                emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
            decoder_input = emb
        pad = moe_padding_mask if moe_padding_mask is not None else padding_mask
        kwargs = {}
        if pad is not None:
            if self.config.sequence_parallel and decoder_input is not None:
                # GPTModel scatters padding_mask only when it embeds itself; with decoder_input we must.
                from megatron.core import tensor_parallel

                pad = tensor_parallel.scatter_to_sequence_parallel_region(pad.transpose(0, 1).contiguous())
                pad = pad.transpose(0, 1).contiguous()
            kwargs["padding_mask"] = pad
        return lm(None, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                  packed_seq_params=packed_seq_params, **kwargs)
