"""Adapters for Megatron-Bridge's Qwen-VL models, as Bridge's providers build them.

- `Qwen3VLAdapter` (`Qwen3VLModel`, dense and MoE): full `input_ids` (the model places vision and
  deepstack embeddings and selects its CP tokens itself) and full [3, 1, T] mRoPE positions (the
  model CP-selects them with the same index; with 1D positions it computes mRoPE itself from the
  packed ids). It also CP-selects labels, so this rank's labels are handed back full length
  (-100 elsewhere): the model's selection returns exactly them.
- `Qwen25VLAdapter` (`Qwen25VLModel`): full `input_ids`; the model always recomputes its mRoPE
  positions (per packed sample) and takes this rank's labels. Bridge 0.6.2's Qwen2.5-VL never
  selects CP tokens: under CP the adapter requires `patches.apply_bridge_qwen25_vl_cp()` and
  installs the packed mRoPE rotary on its language model (full positions under THD + CP).

`Qwen3VLAdapter` refuses, with a ValueError naming the patch, a layout whose Bridge defect is not
patched here (`patches.apply_bridge_patches()`): deepstack gradients under TP + SP, the TE-only THD
CP index; `Qwen25VLAdapter` likewise for CP. Both ask again for every micro-batch (`PatchRequirement`):
a patch undone after the adapter was built counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from megatron_vlm_packing.bridge.tower_inputs import TowerWidths, refuse_images_of_frames_beside_videos
from megatron_vlm_packing.models.adapter import ModelAdapter, check_unpacked_ids
from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.micro_batch import MicroBatch, VisionInputs

IGNORE_INDEX = -100


def full_length(local: torch.Tensor, micro_batch: MicroBatch, fill: int) -> torch.Tensor:
    """[..., T/cp] this CP rank's values -> [..., T] with them at `cp_index` and `fill` elsewhere.

    Unchanged when the micro-batch was not CP-localized.
    """
    if micro_batch.cp_index is None:
        return local
    total = micro_batch.input_ids.shape[-1]
    out = local.new_full((*local.shape[:-1], total), fill)
    out[..., micro_batch.cp_index] = local
    return out


def _layout(model) -> tuple[int, int, bool]:
    """(tp, cp, sequence_parallel) of the model's language config."""
    config = model.config
    return (int(config.tensor_model_parallel_size or 1), int(config.context_parallel_size or 1),
            bool(config.sequence_parallel))


def qwen3_vl_mrope(model):
    """The `rope.MRopeConfig` of a Bridge `Qwen3VLModel` (positions and per-sample media counts)."""
    from megatron_vlm_packing.rope import MRopeConfig

    return MRopeConfig(family="qwen3_vl", spatial_merge_size=int(model.vision_transformer_config.spatial_merge_size),
                       image_token_id=int(model.image_token_id), video_token_id=int(model.video_token_id),
                       vision_start_token_id=int(model.vision_start_token_id),
                       mrope_section=tuple(int(x) for x in model.config.mrope_section), mrope_interleaved=True)


def qwen25_vl_mrope(model):
    """The `rope.MRopeConfig` of a Bridge `Qwen25VLModel` (its config is the provider)."""
    from megatron_vlm_packing.rope import MRopeConfig

    config, vision = model.config, model.config.vision_config
    # As the model's own index reads it (`vision_config.tokens_per_second`, no default): a fallback would give
    # video positions the model never computes (0 or None became 1.0); MRopeConfig names a value that is not > 0.
    tokens_per_second = getattr(vision, "tokens_per_second", None)
    if tokens_per_second is None:
        raise ValueError("the Qwen2.5-VL model's vision_config has no tokens_per_second, which its get_rope_index "
                         "reads for video time positions: set it in the provider's vision_config")
    return MRopeConfig(family="qwen2_5_vl", spatial_merge_size=int(vision.spatial_merge_size),
                       image_token_id=int(config.image_token_id), video_token_id=int(config.video_token_id),
                       vision_start_token_id=int(config.vision_start_token_id), tokens_per_second=tokens_per_second,
                       mrope_section=tuple(int(x) for x in config.mrope_section), mrope_interleaved=False)


QWEN3_VL_MODEL_CLASS = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model.Qwen3VLModel"
QWEN25_VL_MODEL_CLASS = "megatron.bridge.models.qwen_vl.modeling_qwen25_vl.Qwen25VLModel"


def bridge_model_of(model, class_names: tuple[str, ...], adapter: str):
    """`model` unwrapped (DDP / Float16Module), after checking that it is one of Bridge's `class_names`
    (or a subclass). Reading another family's model for its Bridge fields was an AttributeError
    (`make_forward_step(adapter=Qwen3VLAdapter)` on a GPTModel).

    Raises:
        ValueError: the model's class derives from none of `class_names` (naming both).
    """
    from megatron_vlm_packing.models.adapter import qualified_name, unwrap_model

    inner = unwrap_model(model)
    if not any(qualified_name(cls) in class_names for cls in type(inner).__mro__):
        raise ValueError(f"{adapter} drives Megatron-Bridge's {' / '.join(n.rsplit('.', 1)[1] for n in class_names)}, "
                         f"not {qualified_name(type(inner))}: use adapter_for(model) (or register an adapter for it)")
    return inner


def check_unpacked_vision(micro_batch: MicroBatch, mrope) -> None:
    """Vision (and, for Qwen3-Omni's config, audio) inputs no packer checked against the placeholders (`MicroBatch.media_checked_by_packer` is
    False: a transform or an edited loader micro-batch replaced the ids or the vision) are checked here,
    for each kind: placeholders without inputs, patches that are not the grids' (t*h*w each), and each
    sample's placeholders against whole items of its own (`models.merge.check_placeholders_per_sample`).
    Bridge's models compare none of these: Qwen3-VL trained placeholders without inputs as text, silently.
    A micro-batch as packed, whose placeholders packing counted with `mrope`'s ids and merge, is not read.

    Args:
        mrope: the model's `rope.MRopeConfig` (image / video placeholder ids, spatial merge size).

    Raises:
        ValueError: naming the kind, the placeholder id and the counts. One host read per kind (and one for
            `second_per_grid_ts`: one real, finite, non-negative entry per video). Media of a
            dtype the towers would cast (`models.merge.check_media_dtypes`: read from no value, so checked
            on every micro-batch) name the field and the dtype.
    """
    from megatron_vlm_packing.models.merge import (check_media_dtypes, check_placeholders_per_sample,
                                                   refuse_orphan_placeholders, sample_boundaries, tokens_per_grid)

    vision, audio = micro_batch.vision or VisionInputs(), micro_batch.audio
    check_media_dtypes(pixel_values=vision.pixel_values, pixel_values_videos=vision.pixel_values_videos,
                       input_features=audio.input_features if audio is not None else None,
                       feature_attention_mask=audio.feature_attention_mask if audio is not None else None)
    merge = mrope.spatial_merge_size
    kinds = (("image", mrope.image_token_id, vision.pixel_values, vision.image_grid_thw, vision.images_per_sample,
              "image_grid_thw"),
             ("video", mrope.video_token_id, vision.pixel_values_videos, vision.video_grid_thw,
              vision.videos_per_sample, "video_grid_thw"))
    audio_token = getattr(mrope, "audio_token_id", None)
    checked = set(micro_batch.placeholders_checked)
    counted = [(kind, token) for kind, token, *_ in kinds] + ([("audio", audio_token)] if audio_token is not None else [])
    if micro_batch.media_checked_by_packer and vision.spatial_merge_size in (None, merge) \
            and all(pair in checked for pair in counted):
        return
    ids = micro_batch.input_ids
    if audio_token is not None:
        _check_unpacked_audio(micro_batch, audio_token, mrope.audio_n_window)
    for kind, token, pixels, grid, per_sample, grid_name in kinds:
        if pixels is None:
            refuse_orphan_placeholders(ids, kind, token)
            continue
        if grid is None:
            raise ValueError(f"{pixels.shape[0]} {kind} patches given without {grid_name}")
        patches = int(grid.prod(dim=1).sum())
        name = "pixel_values" if kind == "image" else "pixel_values_videos"
        if pixels.shape[0] != patches:
            raise ValueError(f"{name} has {pixels.shape[0]} patches but {grid_name} describes {patches}")
        check_placeholders_per_sample(ids, sample_boundaries(ids, micro_batch.packed_seq_params),
                                      tokens_per_grid(grid, merge), token_id=token, field=kind,
                                      items_per_sample=per_sample)
    _check_unpacked_seconds(vision)


def _check_unpacked_seconds(vision: VisionInputs) -> None:
    """`check_unpacked_vision`'s seconds part: `second_per_grid_ts` (read by Bridge's Qwen2.5-VL for its video
    positions) is one real, finite, non-negative entry per video, as packing checks it. Extra entries were
    dropped, too few an IndexError (StopIteration) inside the model, NaN positions silent. One host read."""
    from megatron_vlm_packing.packing.media import check_seconds_count, refuse_seconds_without_videos
    from megatron_vlm_packing.rope.index_checks import check_seconds, check_seconds_dtype

    seconds = vision.second_per_grid_ts
    if seconds is None:
        return
    check_seconds_dtype(seconds)
    if vision.video_grid_thw is None:
        refuse_seconds_without_videos(seconds)
        return
    check_seconds_count(seconds, vision.video_grid_thw)
    check_seconds(seconds)


def _check_unpacked_audio(micro_batch: MicroBatch, token: int, n_window: int) -> None:
    """`check_unpacked_vision`'s audio part (Qwen3-Omni): placeholders without clips, each clip's `audio_lengths`
    against its mask (the thinker reads the mask alone: lengths that are not the mask's, which positions and
    `validate` read as the clips' frames, were dropped silently), and each sample's placeholders against whole
    clips of its own (each clip's tokens from its mask and `n_window`)."""
    from megatron_vlm_packing.models.audio import audio_tokens_per_clip_from_mask, check_audio_lengths
    from megatron_vlm_packing.models.merge import (check_placeholders_per_sample, refuse_orphan_placeholders,
                                                   sample_boundaries)

    ids, audio = micro_batch.input_ids, micro_batch.audio
    if audio is None:
        refuse_orphan_placeholders(ids, "audio", token)
        return
    check_audio_lengths(audio.audio_lengths, audio.feature_attention_mask)
    check_placeholders_per_sample(ids, sample_boundaries(ids, micro_batch.packed_seq_params),
                                  audio_tokens_per_clip_from_mask(audio.feature_attention_mask, n_window),
                                  token_id=token, field="audio", items_per_sample=audio.audios_per_sample)


@dataclasses.dataclass(frozen=True)
class PatchRequirement:
    """A Bridge patch the model's layout needs here (its defect is present), asked when the adapter is built
    and for every micro-batch: the adapter is built once per model, and the patch may be undone after."""

    applied: Callable[[], bool]  # the patch module's is_applied: does our replacement run now
    what: str  # the defect, for the message
    apply_name: str  # the patches function that fixes it

    def check(self) -> None:
        if not self.applied():
            raise ValueError(f"{self.what}: call megatron_vlm_packing.patches.{self.apply_name}() (or "
                             f"apply_bridge_patches()) before training")


@dataclasses.dataclass(frozen=True)
class RouterPadMask:
    """An MoE language model on Bridge's Qwen3-VL block (Qwen3-VL MoE, Qwen3-Omni's thinker): its routers must be
    handed the plan's padding mask, or they count the pad slots in their load-balancing loss
    (`patches.bridge_qwen3_vl_moe_pads` lets the block take it)."""

    config: object  # the language model's TransformerConfig
    requirement: PatchRequirement | None  # None: Bridge's block takes padding_mask itself

    @classmethod
    def of(cls, config) -> "RouterPadMask | None":
        """For an MoE `config` (`num_moe_experts`), else None."""
        if not getattr(config, "num_moe_experts", None):
            return None
        from megatron_vlm_packing.patches import bridge_qwen3_vl_moe_pads as patch

        requirement = None
        if patch.upstream_block_drops_padding_mask():
            requirement = PatchRequirement(
                patch.is_applied, "Bridge's Qwen3-VL MoE block takes no padding_mask, so its router would count the "
                "pack's pad slots in its load-balancing loss", "apply_bridge_qwen3_vl_moe_pads")
        return cls(config, requirement)

    def check(self, micro_batch: MicroBatch) -> None:
        """A micro-batch with pad slots needs the patch (asked now: it may be undone after the adapter was built),
        and no full recompute (`bridge_qwen3_vl_moe_pads.refuse_full_recompute`). Host ints only."""
        pad_slots = micro_batch.stats.physical_tokens - micro_batch.stats.real_tokens
        if not pad_slots:
            return
        from megatron_vlm_packing.patches.bridge_qwen3_vl_moe_pads import refuse_full_recompute

        if self.requirement is not None:
            self.requirement.check()
        refuse_full_recompute(self.config, pad_slots)

    def mask(self, micro_batch: MicroBatch):
        """[B, t] bool, True at pad slots, laid out like the block's tokens on this rank; None while the block
        cannot take it (the patch is off: `check` refused pad slots then).

        Given whenever the block takes it, pad slots or not, as Megatron-Core's GPTModel is given one: its router
        counts tokens on another path with a mask than without (under TP / CP the aux loss each rank attaches
        differed 2x between the two), so a micro-batch without pads must not switch paths.
        The block's tokens are the micro-batch's CP-local ones (Bridge selects them with the partition `localize`
        used), then under SP this TP rank's contiguous chunk of the sequence: the mask is cut the same way."""
        if self.requirement is not None and not self.requirement.applied():
            return None
        mask = micro_batch.padding_mask
        tp = int(self.config.tensor_model_parallel_size or 1)
        if self.config.sequence_parallel and tp > 1:
            from megatron.core import parallel_state

            chunk = mask.shape[-1] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            mask = mask[..., rank * chunk:(rank + 1) * chunk]
        return mask


class Qwen3VLAdapter(ModelAdapter):
    """Megatron-Bridge `Qwen3VLModel` (Qwen3-VL dense and MoE)."""

    checks_unpacked_ids = True  # check() refuses ids no packer checked: the step reads them in its one read

    consumes = frozenset({"images", "videos"})
    needs = LocalizeNeeds(full_input_ids=True, full_position_ids=True)
    patch_requirements: tuple[PatchRequirement, ...] = ()  # set by __init__: the patches this layout needs
    rotary = "mrope"
    router_pads: RouterPadMask | None = None  # set by __init__ for an MoE model
    tower_widths: TowerWidths  # set by __init__: the widths its vision tower takes

    def __init__(self, model):
        model = bridge_model_of(model, (QWEN3_VL_MODEL_CLASS,), type(self).__name__)
        super().__init__(model)
        self.mrope = qwen3_vl_mrope(model)
        self.tower_widths = TowerWidths.of(self.model_name, getattr(model, "vision_model", None))
        from megatron_vlm_packing.patches import bridge_deepstack_sp, bridge_thd_cp_index

        tp, cp, sp = _layout(model)
        deepstack = bool(getattr(model.vision_transformer_config, "deepstack_visual_indexes", None))
        needed = []
        if tp > 1 and sp and deepstack and bridge_deepstack_sp.upstream_deepstack_split_is_plain_slice():
            needed.append(PatchRequirement(
                bridge_deepstack_sp.is_applied,
                "Bridge's Qwen3-VL deepstack embeddings get wrong vision gradients under TP + SP",
                "apply_bridge_deepstack_sp"))
        if cp > 1 and not bridge_thd_cp_index.te_thd_partition_available():
            needed.append(PatchRequirement(
                bridge_thd_cp_index.is_applied,
                "Bridge's packed CP token selection needs Transformer Engine's thd_get_partitioned_indices",
                "apply_bridge_thd_cp_index"))
        self.patch_requirements = tuple(needed)
        for requirement in self.patch_requirements:
            requirement.check()
        self.router_pads = RouterPadMask.of(model.config)

    def check(self, micro_batch: MicroBatch) -> None:
        for requirement in self.patch_requirements:  # asked again: an undo after building the adapter counts
            requirement.check()
        if self.router_pads is not None:
            self.router_pads.check(micro_batch)
        super().check(micro_batch)
        self.tower_widths.check(micro_batch)
        check_unpacked_ids(micro_batch, self.vocab_size)
        check_unpacked_vision(micro_batch, self.mrope)
        refuse_images_of_frames_beside_videos(micro_batch, self.model_name)
        self.refuse_seconds(micro_batch)

    def refuse_seconds(self, micro_batch: MicroBatch) -> None:
        """Seconds per grid step are not handed to the model (it takes none; dropped here before): its index
        (Qwen3-VL's, which places frames by the timestamp text between them) reads none
        (`rope.index_checks.refuse_seconds_unread_by`, the one rule)."""
        from megatron_vlm_packing.rope.index_checks import refuse_seconds_unread_by

        vision = micro_batch.vision
        refuse_seconds_unread_by(self.mrope.family, vision.second_per_grid_ts if vision is not None else None,
                                 self.model_name)

    def forward(self, model, micro_batch: MicroBatch):
        mb = micro_batch
        vision = mb.vision or VisionInputs()
        positions = mb.position_ids if mb.position_ids.dim() == 3 else None  # else the model computes mRoPE
        return model(input_ids=mb.input_ids, position_ids=positions, attention_mask=None,
                     labels=full_length(mb.labels, mb, IGNORE_INDEX), packed_seq_params=mb.packed_seq_params,
                     pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                     pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw,
                     **self._router_padding_mask(mb))

    def _router_padding_mask(self, mb: MicroBatch) -> dict:
        """`Qwen3VLModel.forward` spreads `extra_block_kwargs` into its language model's keywords, whose own
        `extra_block_kwargs` reach the block."""
        mask = self.router_pads.mask(mb) if self.router_pads is not None else None
        return {} if mask is None else {"extra_block_kwargs": {"extra_block_kwargs": {"padding_mask": mask}}}


class Qwen25VLAdapter(ModelAdapter):
    """Megatron-Bridge `Qwen25VLModel` (Qwen2.5-VL)."""

    checks_unpacked_ids = True  # check() refuses ids no packer checked: the step reads them in its one read

    consumes = frozenset({"images", "videos"})
    needs = LocalizeNeeds(full_input_ids=True, full_position_ids=True)
    patch_requirements: tuple[PatchRequirement, ...] = ()  # CP > 1: its CP patch

    rotary = "mrope"
    tower_widths: TowerWidths  # set by __init__: the widths its vision tower takes

    def __init__(self, model):
        model = bridge_model_of(model, (QWEN25_VL_MODEL_CLASS,), type(self).__name__)
        super().__init__(model)
        self.mrope = qwen25_vl_mrope(model)
        self.tower_widths = TowerWidths.of(self.model_name, getattr(model, "visual", None))
        _, cp, _ = _layout(model)
        if cp > 1:
            from megatron_vlm_packing.patches import bridge_qwen25_vl_cp
            from megatron_vlm_packing.rope import use_packed_mrope

            self.patch_requirements = (PatchRequirement(
                bridge_qwen25_vl_cp.is_applied,
                f"Bridge's Qwen25VLModel does not select context-parallel tokens (with context_parallel_size={cp} "
                f"every CP rank would run the whole sequence)", "apply_bridge_qwen25_vl_cp"),)
            self.patch_requirements[0].check()
            # Under THD + CP the rotary must return the full table from full positions (bug class 6).
            use_packed_mrope(model.language_model)

    def check(self, micro_batch: MicroBatch) -> None:
        for requirement in self.patch_requirements:  # asked again: an undo after building the adapter counts
            requirement.check()
        super().check(micro_batch)
        self.tower_widths.check(micro_batch)
        check_unpacked_ids(micro_batch, self.vocab_size)
        check_unpacked_vision(micro_batch, self.mrope)

    def forward(self, model, micro_batch: MicroBatch):
        mb = micro_batch
        vision = mb.vision or VisionInputs()
        return model(input_ids=mb.input_ids, labels=mb.labels, packed_seq_params=mb.packed_seq_params,
                     pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                     pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw,
                     second_per_grid_ts=vision.second_per_grid_ts)
