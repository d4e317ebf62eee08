"""What the validator judges: a packed micro-batch, flattened (`PackedInputs`), and the rows it was made
from (`SourceRows`).

Frozen dataclasses every check reads (`validate.boundaries`, `tokens`, `positions`, `cp`, ...);
`inputs.build_inputs` makes a `PackedInputs` from any packer's output. `SourceRows` checks its own
fields when made, since the rows are the reference a pack is judged against.

Shape legend: T = physical packed slots, N = documents, B = source rows, S = source row length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatron_vlm_packing.packing.lengths import lengths_from_keep_mask, widened_unsigned
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.packing.row_fields import check_label_style
from megatron_vlm_packing.validate.coerce import dense_tensor


@dataclass(frozen=True)
class SourceRows:
    """The unpacked, right-padded rows a pack was made from.

    Attributes:
        input_ids: [B, S] long.
        attention_mask: [B, S], 1 at real tokens; None = every row full.
        labels: [B, S] long, -100 = no target; None = not compared.
        loss_mask: [B, S] float weights (Megatron style), optional.
        label_style: "hf" (labels unshifted: token s learns labels[s+1]) or "megatron" (token s learns labels[s]).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    label_style: str = "hf"

    def __post_init__(self) -> None:
        """Each row field a dense CPU tensor (uint16 / uint32 read as int64) of input_ids' [B, S], the mask
        right-padded 0/1 (the packers' rule, `lengths_from_keep_mask`): the rows are the reference a pack is
        judged against, so one that cannot be read as rows is a ValueError naming it (`source_<field>`)."""
        check_label_style(self.label_style)  # the packers' rule and message
        for name in ("input_ids", "attention_mask", "labels", "loss_mask"):
            value = getattr(self, name)
            if value is not None:
                value = widened_unsigned(dense_tensor(value, f"source_{name}"), f"source_{name}")
                object.__setattr__(self, name, value)  # frozen: the checked tensor replaces what was given
        if self.input_ids.dim() != 2:
            raise ValueError(f"source_input_ids must be [B, S], got shape {tuple(self.input_ids.shape)}")
        for name in ("attention_mask", "labels", "loss_mask"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(f"source_{name} must be [B, S] like source_input_ids {tuple(self.input_ids.shape)}, "
                                 f"got shape {tuple(value.shape)}")
        if self.attention_mask is not None:
            lengths_from_keep_mask(self.attention_mask, field="source_attention_mask")

    def lengths(self) -> list[int]:
        """Real length of each row (the count of 1s in its right-padded mask, checked when made)."""
        if self.attention_mask is None:
            return [self.input_ids.shape[1]] * self.input_ids.shape[0]
        return (self.attention_mask != 0).sum(dim=1).tolist()


@dataclass(frozen=True)
class PackedInputs:
    """A packed micro-batch, flattened. Every tensor on the CPU.

    Attributes:
        input_ids: [T] long.
        labels, loss_mask, padding_mask: [T] or None.
        position_ids: [T] or [3, T] or None.
        cu_seqlens, cu_seqlens_padded: [N+1] as given (any dtype), or None; `cu_seqlens_kv*` likewise.
        max_seqlen: (q, kv) as given.
        multiples: alignment the layout needs; cp_size: for the CP partition check.
        cp_index: [T/cp] when the batch was already localized to one CP rank.
        cp_rank: the rank `cp_index` belongs to, when known.
        second_per_grid_ts: [V] float seconds per video temporal grid step, or None.
        audio_seqlens: [A] long raw audio lengths per clip (token order), or None; audio_token_id,
            audios_per_document and audio_n_window (None: the mrope config's, else 50) split them per document.
        use_audio_in_video: given to an mrope callable that takes it; None = told per document.
        label_style: how the samples' labels were given before packing: "hf" (unshifted: a sample's last token
            has no target, so in a correct pack every document's last real token is untrained) or "megatron"
            (already next-token); None = not said (the source rows' style reads their labels only).
        mrope: an `MRopeConfig` or callable(ids [1, L], image_grid_thw=, video_grid_thw=, ...) -> [3, 1, L]
            (a callable gets the inputs its signature names: second_per_grid_ts / second_per_grids,
            audio_seqlens, use_audio_in_video, and mm_token_type_ids read from the placeholder ids). With an `MRopeConfig`, placeholder ids and the merge size
            not given are the config's.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    padding_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    max_seqlen: tuple[Any, Any] | None = None
    has_packed_seq_params: bool = False
    image_grid_thw: torch.Tensor | None = None
    image_token_id: int | None = None
    video_grid_thw: torch.Tensor | None = None
    video_token_id: int | None = None
    spatial_merge_size: int = 2
    images_per_document: tuple[int, ...] | None = None
    videos_per_document: tuple[int, ...] | None = None
    second_per_grid_ts: torch.Tensor | None = None
    audio_seqlens: torch.Tensor | None = None
    audio_token_id: int | None = None
    audios_per_document: tuple[int, ...] | None = None
    audio_n_window: int | None = None
    use_audio_in_video: bool | None = None
    source: SourceRows | None = None
    multiples: PackMultiples = PackMultiples()
    cp_size: int = 1
    cp_ranks: Mapping[int, Mapping[str, torch.Tensor]] | None = None
    cp_index: torch.Tensor | None = None
    cp_rank: int | None = None
    pad_token_id: int | None = None
    mrope: Any = None
    ignore_index: int = -100
    localized_total: int | None = None
    label_style: str | None = None

    @property
    def total(self) -> int:
        """T: the physical slots of the whole pack (a localized batch holds T/cp of them)."""
        return self.localized_total if self.localized_total is not None else self.input_ids.numel()
