"""The step's build stage: the data iterator's item as the model's full-length micro-batch (`micro_batch_for_model`).

A collated batch is moved to the model's device (`to_device`) and packed by the adapter's own
`build_micro_batch`, else by `pack_batch` / `pad_batch` as `StepOptions` say (`build_micro_batch`), with
the mRoPE config `resolve_mrope` picks; a `MicroBatch` packed in the DataLoader is checked for the
model (its mRoPE config, `loader_vocab.check_loader_vocab`) and moved, not re-packed. What comes back
(`BuiltMicroBatch`) also carries what the parity probe re-packs each sample alone with. A module of its
own: `make_forward_step` (`step.py`) runs it once per micro-batch, and tests call it without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Mapping

import torch

from megatron_vlm_packing.models.adapter import ModelAdapter, check_loader_mrope
from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.packing.bridge_batch import from_bridge_batch
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.packing.row_fields import check_dense_tensors, check_pack_arguments
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.train.loader_vocab import check_loader_vocab


@dataclass(frozen=True)
class StepOptions:
    """How a collated batch becomes a micro-batch (the arguments of `make_forward_step`)."""

    pack: bool = True
    label_style: str = "hf"
    pad_to: int | None = None
    seq_length: int | None = None
    fp8: bool = False
    mrope: Any = None
    megatron_lm_pad_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pack, bool):  # pack=None ran dense and pack="no" packed, silently
            raise ValueError(f"pack must be a bool, got {self.pack!r}")
        if self.pack and self.seq_length is not None:
            raise ValueError(f"seq_length={self.seq_length} is the dense row length (pack=False); "
                             f"with pack=True use pad_to for a fixed packed length")
        if not self.pack and self.pad_to is not None:
            raise ValueError(f"pad_to={self.pad_to} is the fixed packed length (pack=True); "
                             f"with pack=False use seq_length")
        self._check_values()

    def _check_values(self) -> None:
        """label_style, fp8, pad_to, seq_length and mrope as the packers take them, checked when the step is made,
        not at its first micro-batch (from the DataLoader, pad_to="8" was compared with the pack's length as it was)."""
        pad_to = check_pack_arguments(fp8=self.fp8, label_style=self.label_style, pad_to=self.pad_to, mrope=self.mrope)
        object.__setattr__(self, "pad_to", pad_to)  # an integer scalar as its int, as pack_batch reads it
        if self.seq_length is not None and (not is_int(self.seq_length) or self.seq_length < 1):
            raise ValueError(f"seq_length must be a positive int (the dense row length) or None, "
                             f"got {self.seq_length!r}")
        if self.seq_length is not None:
            object.__setattr__(self, "seq_length", int(self.seq_length))  # a numpy int as its int, as pad_to
        if self.megatron_lm_pad_id is not None and not is_int(self.megatron_lm_pad_id):
            raise ValueError(f"megatron_lm_pad_id must be the Megatron-LM tokenizer's pad id (an int) or None, "
                             f"got {self.megatron_lm_pad_id!r}")


def to_device(batch: Mapping, device: torch.device) -> dict:
    """Tensors of the batch on `device` (non-tensor values as they are), as a dict.

    Raises:
        ValueError: a sparse, nested or meta tensor (a meta tensor has no values to move: `.to()` was a
            NotImplementedError; the packers refuse the others), naming its key (`row_fields.check_dense_tensors`).
    """
    check_dense_tensors(batch)
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def resolve_mrope(options: StepOptions, adapter: ModelAdapter, batch: dict | None = None):
    """The mRoPE config positions are computed with: the step's, else the model's own (PackedVLM)
    unless the batch already carries [3, B, S] `position_ids` (then those are packed as given).

    Raises:
        ValueError: `mrope=` given for a model whose adapter says its rotary is 1D (the positions
            would be computed and then ignored, or fed to a 1D rotary).
    """
    rotary = getattr(adapter, "rotary", None)
    if options.mrope is not None and rotary == "1d":
        raise ValueError(f"make_forward_step(mrope=...) was given but {adapter.model_name}'s rotary is 1D "
                         f"({type(adapter).__name__}): drop mrope= or build an mRoPE model")
    if options.mrope is not None:
        return options.mrope
    given = (batch or {}).get("position_ids")
    if isinstance(given, torch.Tensor) and given.dim() == 3:
        return None
    return getattr(adapter, "mrope", None)


def build_micro_batch(batch: dict, layout: ParallelLayout, options: StepOptions, *, mrope=None,
                      media_token_ids: dict | None = None, extra_keys: tuple[str, ...] = (),
                      vocab_size: int | None = None) -> MicroBatch:
    """`pack_batch` (real-length THD) or `pad_batch` (dense rows), aligned for `layout`; full length.

    `media_token_ids` (image/video/audio_token_id, spatial_merge_size: the adapter's) let the
    packer count each sample's images, videos and clips; `extra_keys` are the per-token tensors the
    adapter consumes (`extra_keys_of`); `vocab_size` (the model's, `ModelAdapter.vocab_size`) makes ids
    and labels outside [0, vocab_size) a ValueError in the packer's read.
    """
    from megatron_vlm_packing.packing import pack_batch, pad_batch
    from megatron_vlm_packing.packing.media_tokens import MediaTokens

    media = dict(mrope=mrope, **(media_token_ids or {}))
    # Pad slots are embedded like tokens: their id must be no placeholder the model fills (0 unless one is 0).
    pad_token_id = MediaTokens.resolve(**media, require_counts=False).pad_id_clear_of_placeholders()
    common = dict(tp_size=layout.tp_size, cp_size=layout.cp_size, sequence_parallel=layout.sequence_parallel,
                  fp8=options.fp8, label_style=options.label_style, **media, pad_token_id=pad_token_id,
                  require_media_counts=False,  # the adapter's check refuses media it does not consume
                  extra_keys=tuple(extra_keys), vocab_size=vocab_size)
    if options.pack:
        return pack_batch(batch, pad_to=options.pad_to, **common)
    return pad_batch(batch, seq_length=options.seq_length, **common)


def extra_keys_of(adapter: ModelAdapter) -> tuple[str, ...]:
    """The per-token batch keys an adapter consumes ("extra:<key>" in `consumes`). Without them the
    packer refused such a key as unknown, so an adapter declaring one could never receive it from a
    collated batch (only from a PackingCollator given extra_keys=)."""
    return tuple(sorted(name[len("extra:"):] for name in adapter.consumes if name.startswith("extra:")))


@dataclass(frozen=True)
class BuiltMicroBatch:
    """What `micro_batch_for_model` returns.

    Attributes:
        micro_batch: the full-length micro-batch, on the model's device.
        batch: the collated batch it was packed from, on the device (None: packed in the DataLoader).
        repack: `batch -> MicroBatch` packing a collated batch the same way (what the parity probe
            packs each sample alone with); None when the DataLoader or the adapter packed.
    """

    micro_batch: MicroBatch
    batch: dict | None = None
    repack: Callable[[dict], MicroBatch] | None = None


def micro_batch_for_model(item: dict | MicroBatch, adapter: ModelAdapter, layout: ParallelLayout,
                          options: StepOptions, device: torch.device, *, probing: bool = False) -> BuiltMicroBatch:
    """The model's full-length micro-batch from what the data iterator yielded.

    Args:
        item: a collated batch dict (moved to `device`, then built by the adapter's own
            `build_micro_batch`, else `pack_batch` / `pad_batch`), or a `MicroBatch` packed in the
            DataLoader (checked for the layout by the adapter and moved, not re-packed).
        probing: the parity probe will re-pack the batch sample by sample.

    Raises:
        ValueError: probing a micro-batch the probe cannot re-pack (loader- or adapter-built),
            `mrope=` for a model whose rotary is 1D, or a loader micro-batch whose mRoPE positions
            another config made (`check_loader_mrope`).
    """
    if isinstance(item, MicroBatch):  # packed in the DataLoader: only moved here
        if probing:
            raise ValueError("parity_probe_every needs collated batches (it re-packs each sample alone); "
                             "the data iterator yielded micro-batches packed in the DataLoader")
        mrope = resolve_mrope(options, adapter)  # refuses mrope= for a 1D model here too
        source = "make_forward_step(mrope=...)" if options.mrope is not None \
            else f"{adapter.model_name}'s own, {type(adapter).__name__}.mrope"
        check_loader_mrope(item, mrope, source)
        item = check_loader_vocab(item, getattr(adapter, "vocab_size", None),
                                  unembedded_token_id=getattr(adapter, "unembedded_token_id", None))
        return BuiltMicroBatch(adapter.micro_batch_from_loader(item, layout, options, device))
    # Megatron-Bridge's collate output: its visual_inputs unpacked before the move (`packing.bridge_batch`); the
    # adapter's own formats (LLaVA: Megatron-LM examples/multimodal's, `models.llava_mlm_batch`) read on the host too
    batch = to_device(adapter.collated_batch(from_bridge_batch(item, options.label_style), options), device)
    mrope_used = resolve_mrope(options, adapter, batch)
    micro_batch = adapter.build_micro_batch(batch, layout, options)
    if micro_batch is not None:
        if probing:
            raise ValueError(f"parity_probe_every: {type(adapter).__name__} builds its own micro-batches "
                             f"(e.g. in LLaVA's expanded space), which the probe cannot split per sample")
        return BuiltMicroBatch(micro_batch, batch)
    repack = partial(build_micro_batch, layout=layout, options=options, mrope=mrope_used,
                     media_token_ids=getattr(adapter, "media_token_ids", None), extra_keys=extra_keys_of(adapter),
                     vocab_size=getattr(adapter, "vocab_size", None))
    return BuiltMicroBatch(repack(batch), batch, repack)
