"""`MicroBatch`: the one typed value that travels from a collated batch to the model.

`pack_batch` (THD, real lengths) and `pad_batch` (dense rows) both produce it; `localize` gives
each CP rank its part; a model adapter (`models.adapter`) turns it into the model's keywords.
Nothing travels beside it in an untyped dict, so nothing can be dropped on the way: every input a
micro-batch carries is named by `MicroBatch.inputs_present()`, and the step refuses any that the
model's adapter does not consume.

Shape legend: B = rows, S = row length, T = physical packed tokens (dense: B*L slots as [B, L]),
P = image patches, Pv = video patches, I = images, V = videos, A = audios, F = mel bins,
L = audio frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping, NamedTuple

import torch

if TYPE_CHECKING:  # rope imports packing: imported at run time here it would be a cycle
    from megatron_vlm_packing.rope import MRopeConfig


@dataclass(frozen=True)
class VisionInputs:
    """Images and videos of one micro-batch, in sample order, with per-sample counts.

    Attributes:
        pixel_values: [P, C] patches of every image (Qwen-VL style) or [I, C, H, W] (LLaVA style); None without images.
        image_grid_thw: [I, 3] long, (t, h, w) patch grid per image; None when the tower takes no grid.
        images_per_sample: B ints, images of each row in token order (checked against placeholders).
        pixel_values_videos: [Pv, C] patches of every video; None without videos.
        video_grid_thw: [V, 3] long.
        second_per_grid_ts: [V] float, seconds per temporal grid step (Qwen2.5-VL, Qwen3-Omni).
        videos_per_sample: B ints.
        num_image_tiles: [I] int, tiles per image (LLaVA style: `pixel_values` then holds sum(tiles)
            tiles, each expanded by the model); None = one tile per image.
        spatial_merge_size: the merge size packing counted each grid's placeholder tokens with
            (t * h * w / merge**2) when it checked the per-sample counts; None when it did not.
    """

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    images_per_sample: tuple[int, ...] | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    videos_per_sample: tuple[int, ...] | None = None
    num_image_tiles: torch.Tensor | None = None
    spatial_merge_size: int | None = None

    @property
    def has_images(self) -> bool:
        return self.pixel_values is not None

    @property
    def has_videos(self) -> bool:
        return self.pixel_values_videos is not None

    def fields_without_media(self) -> tuple[str, ...]:
        """Each field that describes images (videos) while `pixel_values` (`pixel_values_videos`) is None, with
        the items it describes; () when none. No model reads a grid, a per-sample count, tiles or seconds without
        the pixels they describe: an mRoPE index reads grids alone before the micro-batch is built, and the
        packers keep none of them without pixels. Reads shapes and host ints only (no sync)."""
        kinds = (("image", "pixel_values", self.pixel_values,
                  (("image_grid_thw", self.image_grid_thw), ("images_per_sample", self.images_per_sample),
                   ("num_image_tiles", self.num_image_tiles))),
                 ("video", "pixel_values_videos", self.pixel_values_videos,
                  (("video_grid_thw", self.video_grid_thw), ("videos_per_sample", self.videos_per_sample),
                   ("second_per_grid_ts", self.second_per_grid_ts))))
        found = []
        for kind, pixels_name, pixels, fields in kinds:
            if pixels is not None:
                continue
            for name, value in fields:
                items = _items_described(value)
                if items:
                    found.append(f"vision.{name} describes {items} {kind}(s) but vision.{pixels_name} is None")
        return tuple(found)


def _items_described(value) -> int:
    """Items a vision field describes: rows of a grid [I, 3], entries of a [I] tensor, the sum of per-sample counts."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else 1
    return sum(value)


@dataclass(frozen=True)
class AudioInputs:
    """Audio clips of one micro-batch (Qwen3-Omni style), in sample order.

    Attributes:
        input_features: [A, F, L] float, mel features per clip (padded to L frames).
        feature_attention_mask: [A, L] bool/int, 1 at real frames.
        audio_lengths: A ints, real frames per clip (from the mask).
        audios_per_sample: B ints, clips of each row in token order.
    """

    input_features: torch.Tensor
    feature_attention_mask: torch.Tensor
    audio_lengths: tuple[int, ...]
    audios_per_sample: tuple[int, ...]


@dataclass(frozen=True)
class BatchStats:
    """Host ints for logging (contract item 9 logs real vs physical tokens).

    Attributes:
        real_tokens: tokens that are real (all samples, before CP).
        physical_tokens: slots the model computes over (all CP ranks together).
        row_tokens: slots the collated right-padded rows occupied (what padding would have cost).
    """

    real_tokens: int
    physical_tokens: int
    row_tokens: int


class BoundariesMark(NamedTuple):
    """`MicroBatch.checked_boundaries`: the `PackedSeqParams` object the packer made (or a control declared) and
    its fields as they were then, so a field written in place afterwards (`params.cu_seqlens_q = ...`, the same
    object with a new value) ends the mark as a new object does. Tensors are compared by identity, other values
    (ints, flags, None) by equality: a DataLoader's pickle keeps a tensor shared but makes new int objects."""

    params: object
    fields: tuple[tuple[str, object], ...]

    def holds_for(self, params) -> bool:
        """`params` is the marked object and every field still holds the value it held when marked."""
        if params is not self.params:
            return False
        missing = object()
        for name, value in self.fields:
            now = getattr(params, name, missing)
            if now is not value and (isinstance(value, torch.Tensor) or isinstance(now, torch.Tensor) or now != value):
                return False
        return True


def boundaries_mark(params) -> BoundariesMark | None:
    """The mark a packer sets for the `PackedSeqParams` it made (`MicroBatch.checked_boundaries`); None for None."""
    return None if params is None else BoundariesMark(params, tuple(vars(params).items()))


class IdsMark(NamedTuple):
    """`MicroBatch.checked_ids`: which `input_ids` tensor was found in range, below which bound, which id
    excepted."""

    input_ids: torch.Tensor  # the very tensor checked (the mark holds while `MicroBatch.input_ids` is it)
    vocab_size: int | None  # ids found in [0, vocab_size); None: only >= 0
    unembedded_token_id: int | None  # slots holding this id were not checked (LLaVA's image token); None: every slot


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the model will see it, packed (THD) or dense (rows).

    Sequence-aligned fields are [1, T] when packed and [B, L] when dense. After `localize` with
    CP > 1 they hold this rank's tokens (`cp_index` says which), except the fields the adapter
    asked to keep full (`full_fields`). Fields share memory with the pack's own tensors where a copy
    would cost a pass per micro-batch (1D `position_ids` on the CPU view `indices.offset_in_segment`,
    the boundary sets are the indices' own): replace a field (`dataclasses.replace`), never write one
    in place.

    Attributes:
        input_ids: [1, T] / [B, L] long, token ids (pad slots hold the pad id; never read as a mask).
        labels: next-token targets, -100 where there is none.
        loss_mask: float per-token loss weights (0 at pads and ignored targets; weights kept as given).
        position_ids: [1, T] / [B, L] long (restarting per document), or [3, 1, T] / [3, B, L] (mRoPE).
        padding_mask: bool, True exactly at pad slots (from the plan, never from token values).
        packed_seq_params: Megatron-Core `PackedSeqParams` (THD, both boundary sets); None when dense.
        rope_cu_seqlens: [N+1] int32 real boundaries of the plan (where rotary positions restart), full length on
            every CP rank (`localize` does not cut it); None when dense. No rotary of this package reads it
            (Megatron-Core's THD rotary takes `packed_seq_params`, the mRoPE paths the positions): it is for a
            user's rotary. One that is not the plan's own `indices.cu_seqlens` (a transform's) is compared by the
            step with the plan's real boundaries (`cu_seqlens_q` without a plan) and refused where it differs
            (`train.plan_boundaries.queue_rope_boundaries`, in the step's one read).
        vision: images and videos with per-sample counts; None when the batch has none.
        audio: audio clips with per-sample counts; None when the batch has none.
        extras: other per-token tensors, laid out like `input_ids` (pad slots 0).
        stats: host-int token counts.
        plan: the host `PackPlan` (packed only), to unpack outputs.
        indices: the device `PackIndices` (packed only).
        cp_index: [T/cp] long, this CP rank's token indices; None before `localize` or at cp = 1.
        full_fields: names of sequence-aligned fields that `localize` left full length.
        placeholders_checked: (kind, placeholder id) pairs, kind "image" / "video" / "audio", whose
            placeholders packing checked in its one read (counted against the items, or none among
            the real tokens when the kind has no items): a model with the same id need not look.
        checked_loss_mask: the `loss_mask` tensor whose weights the packer checked (finite and >= 0) in
            its read, set by `pack_batch` / `pad_batch` / LLaVA's packers (kept by moves and `replace`);
            a micro-batch whose `loss_mask` is another tensor (built or changed by hand) is checked by
            the step (`train.unpacked_checks.check_unpacked_loss_weights`, one host sync then only).
        mrope_config: the `rope.MRopeConfig` that made the mRoPE `position_ids` (`pack_batch` / `pad_batch`
            / `PackingCollator` given `mrope=` a config; kept by `localize`, the moves and `replace`). None
            when the positions are 1D, were given in the batch, or came from a callable `mrope`: a callable
            cannot be compared with a model's config (nor kept by identity: a DataLoader worker pickles it),
            so such positions are taken as they are. The step refuses a micro-batch from the data iterator
            whose config differs from the model's in a field that makes positions
            (`models.adapter.check_loader_mrope`, `rope.config.POSITION_FIELDS`).
        checked_labels: the `labels` tensor whose values the packer checked (-100 or a token id >= 0, below its
            `vocab_size` when given), kept like `checked_loss_mask`; other labels (a transform's, a replace) are
            checked by the step (`train.unpacked_checks.check_unpacked_labels`, one host sync then only).
        checked_vocab_size: the `vocab_size` the packer checked the real ids and the labels below (`pack_batch` /
            `pad_batch` / the collators given one, or the step against the model's); None when only their
            lower bounds were checked (a `PackingCollator` without `pack_options=dict(vocab_size=...)`: it
            has no model). The step checks a micro-batch whose bound is unknown or above the model's
            vocabulary (`vocab_checked`; `train.loader_vocab.check_loader_vocab`).
        checked_media: the (`input_ids`, `vision`, `audio`) objects whose placeholders, grids, per-sample
            counts and audio lengths packing checked in its one read (`pack_batch` / `pad_batch`; kept by
            the moves, which replace it with the moved objects). `placeholders_checked` and the per-sample
            counts hold for the micro-batch only while these are its own (`media_checked_by_packer`): a
            `dataclasses.replace` of the ids, the vision or the audio (a transform, an edited loader
            micro-batch) keeps the marks, so a model must check such media itself.
        checked_positions: the `position_ids` tensor the packer made or checked, restarting only where a row
            (dense) or a document of its plan (packed) starts (`pack_batch`, `pad_batch`, LLaVA's packers; kept like
            `checked_labels`); other positions (built by hand, a transform's) are read by the step for a restart
            inside a row or document (`train.unpacked_checks.check_unpacked_dense_positions` /
            `check_unpacked_packed_positions`, one host sync then only): several documents in one would train as
            one causal document. Packed, the mark vouches only for the plan's documents: with boundaries that are
            not the plan's (below) the positions are read too.
        checked_boundaries: a `BoundariesMark` of the `PackedSeqParams` the packer made and of its fields as made
            (`pack_batch`, LLaVA's packers; kept by `localize`, the moves, pinning, a DataLoader's pickle and
            `replace` of other fields). Every field of other
            `packed_seq_params` (a transform's, a `replace`) is compared by the step with the plan the positions,
            padding mask, labels and CP index were made from (`train.plan_boundaries`: `qkv_format` "thd", the four
            boundary sets the plan's, `max_seqlen_*` at least its longest physical document, `pad_between_seqs` not
            False over pad slots; from the plan's host ints, but sets in new tensors and a tensor `max_seqlen_*`,
            read in the step's one host sync) and refused where they differ; sets found equal are swapped for the
            plan's own tensors (and the new params marked here), so `localize` reads none. Without a plan
            (`plan=None, indices=None`) the positions are read against them, and `max_seqlen_*` / `pad_between_seqs`
            held to the same rules against them in that read (`plan_boundaries.queue_own_boundary_fields`). Only a
            control that breaks the boundaries on purpose declares its own (`declare_boundaries`). A field written
            in place (`params.cu_seqlens_q = ...`) ends the mark like new params; a tensor edited in place
            (`params.cu_seqlens_q[1] = 9`) is not seen: write new tensors.
        checked_ids: an `IdsMark` (`input_ids` tensor, vocab_size, unembedded_token_id): ids found in [0, vocab_size)
            (>= 0 when None) at every slot but those holding `unembedded_token_id` (None: every slot), by the step in
            its one read (`train.unpacked_checks.check_unpacked_fields`, for an adapter that `checks_unpacked_ids`)
            or by LLaVA's packers in theirs (their real text ids; the image token, never embedded, excepted), so the adapter's
            `check_unpacked_ids` reads nothing (`ids_checked`); kept by the moves; None otherwise.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    packed_seq_params: object | None
    rope_cu_seqlens: torch.Tensor | None
    stats: BatchStats
    vision: VisionInputs | None = None
    audio: AudioInputs | None = None
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    plan: object | None = None
    indices: object | None = None
    cp_index: torch.Tensor | None = None
    full_fields: frozenset[str] = frozenset()
    placeholders_checked: tuple[tuple[str, int], ...] = ()
    checked_loss_mask: torch.Tensor | None = field(default=None, repr=False, compare=False)
    mrope_config: MRopeConfig | None = None
    checked_media: tuple | None = field(default=None, repr=False, compare=False)
    checked_labels: torch.Tensor | None = field(default=None, repr=False, compare=False)
    checked_vocab_size: int | None = field(default=None, compare=False)
    checked_positions: torch.Tensor | None = field(default=None, repr=False, compare=False)
    checked_boundaries: BoundariesMark | None = field(default=None, repr=False, compare=False)
    checked_ids: IdsMark | None = field(default=None, repr=False, compare=False)

    def vocab_checked(self, vocab_size: int | None) -> bool:
        """The packer's checks bound the ids and labels it checked below `vocab_size` (always, when None)."""
        return vocab_size is None or (self.checked_vocab_size is not None and self.checked_vocab_size <= vocab_size)

    def ids_checked(self, vocab_size: int | None, unembedded_token_id: int | None = None) -> bool:
        """These very `input_ids` are known to lie in [0, vocab_size) (>= 0 when None), but at slots holding
        `unembedded_token_id` (an id the model replaces before its embedding: LLaVA's image token): the packer's
        (`checked_media`, below `checked_vocab_size`) or `checked_ids` (the step's one read, LLaVA's packers), when
        it excepted no id or this one."""
        packer = self.checked_media
        if packer is not None and packer[0] is self.input_ids and self.vocab_checked(vocab_size):
            return True
        mark = self.checked_ids
        if mark is None or mark.input_ids is not self.input_ids:
            return False
        return mark.unembedded_token_id in (None, unembedded_token_id) and \
            (vocab_size is None or (mark.vocab_size is not None and mark.vocab_size <= vocab_size))

    @property
    def labels_checked(self) -> bool:
        """The packer checked these very labels (`checked_labels` is `labels`)."""
        return self.checked_labels is not None and self.checked_labels is self.labels

    @property
    def positions_checked(self) -> bool:
        """The packer made these very positions (`checked_positions` is `position_ids`). Only the positions are
        compared: packed, they hold for the plan's documents, so the step trusts them only with boundaries that
        are the plan's too (`boundaries_checked`, or compared with the plan)."""
        return self.checked_positions is not None and self.checked_positions is self.position_ids

    @property
    def boundaries_checked(self) -> bool:
        """The packer made these very boundaries (`checked_boundaries` is `packed_seq_params`), or a control
        declared them (`declare_boundaries`)."""
        return self.checked_boundaries is not None and self.checked_boundaries.holds_for(self.packed_seq_params)

    @property
    def media_checked_by_packer(self) -> bool:
        """Packing checked these very ids, vision and audio (`checked_media`): its marks hold."""
        checked = self.checked_media
        return checked is not None and len(checked) == 3 and checked[0] is self.input_ids \
            and checked[1] is self.vision and checked[2] is self.audio

    @property
    def loss_weights_checked(self) -> bool:
        """The packer checked these very loss weights (`checked_loss_mask` is `loss_mask`)."""
        return self.checked_loss_mask is not None and self.checked_loss_mask is self.loss_mask

    @property
    def is_packed(self) -> bool:
        return self.packed_seq_params is not None

    # Kept for callers of the first `PackedBatch` (same names as before the seam was typed).
    @property
    def num_real_tokens(self) -> int:
        return self.stats.real_tokens

    @property
    def num_physical_tokens(self) -> int:
        return self.stats.physical_tokens

    def inputs_present(self) -> frozenset[str]:
        """Names of the optional inputs this micro-batch carries; an adapter must consume each.

        "images", "videos", "audio", "image_tiles" (`vision.num_image_tiles`, read by LLaVA alone: a model
        that does not read it would take every image as one tile) and "extra:<key>" per per-token extra.
        """
        present = set()
        if self.vision is not None and self.vision.has_images:
            present.add("images")
        if self.vision is not None and self.vision.has_videos:
            present.add("videos")
        if self.vision is not None and self.vision.num_image_tiles is not None:
            present.add("image_tiles")
        if self.audio is not None:
            present.add("audio")
        present.update(f"extra:{key}" for key in self.extras)
        return frozenset(present)

    def describe_input(self, name: str) -> str:
        """`name` (one of `inputs_present()`) as the field that holds it and its size, for error messages."""
        vision = self.vision
        if name == "images":
            return f"images: vision.pixel_values of shape {tuple(vision.pixel_values.shape)}"
        if name == "videos":
            return f"videos: vision.pixel_values_videos of shape {tuple(vision.pixel_values_videos.shape)}"
        if name == "image_tiles":
            return f"image_tiles: vision.num_image_tiles, {vision.num_image_tiles.numel()} entries"
        if name == "audio":
            return f"audio: audio.input_features of shape {tuple(self.audio.input_features.shape)}"
        key = name[len("extra:"):]
        return f"{name}: extras[{key!r}] of shape {tuple(self.extras[key].shape)}"


def declare_boundaries(micro_batch: MicroBatch, packed_seq_params) -> MicroBatch:
    """`micro_batch` with `packed_seq_params` in place of its own, declared checked (`checked_boundaries`): the
    step neither compares them with the plan nor reads the positions against them, and the pack trains as they
    say, however wrong. Only for controls that break the boundaries on purpose, to show what a parity check
    catches (the parity suite's uniform and off-by-one cases, Bridge's one-document pipeline stages); a plain
    `dataclasses.replace(micro_batch, packed_seq_params=...)` is checked by the step.

    Raises:
        ValueError: `micro_batch` is not a MicroBatch.
    """
    if not isinstance(micro_batch, MicroBatch):
        raise ValueError(f"declare_boundaries takes a MicroBatch, got {type(micro_batch).__name__}")
    return replace(micro_batch, packed_seq_params=packed_seq_params,
                   checked_boundaries=boundaries_mark(packed_seq_params))
