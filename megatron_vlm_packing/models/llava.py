"""Megatron-Core's `LLaVAModel`, packed exactly: boundaries in the expanded space, no lost tokens.

`LLaVAModel` expands every image token into `tiles * img_seq_len` embeddings inside its forward.
Three things follow for a THD pack (all measured against the batched model, testing/llava_parity.py):

- **Boundaries** (bug class 2): attention sees the expanded sequence, so both boundary sets must be
  expanded (`llava_expansion.remap_packed_seq_params`; `patches.llava_boundaries` applies it on every
  pipeline stage).
- **Alignment**: under CP every *expanded* document must divide by 2*cp and the expanded total by
  LLaVA's shard factor; only a plan made in expanded space gets that (`llava_pack_plan`).
- **The slot before an image** (bug class 13): `_preprocess_data` zeroes the loss mask and drops the
  label of the collapsed slot just before each image token. In a pack, for a document that opens
  with an image, that slot is the previous document's last physical slot: when it is a real token,
  its loss is lost. The exact rule, from the source: only the slot at (image index - 1) is touched,
  so one pad slot at the end of the previous document absorbs it (`llava_pack_plan` plans one;
  `llava_expansion.leaking_documents` finds packs without it).

This module holds the model's space (`LlavaSpace`) and its adapter (`LLaVAAdapter`, which calls the model);
`pack_llava_batch` (`models.llava_pack`) packs in the collapsed space with that plan.
Shape legend: B = rows, S = row length, T = collapsed packed slots, N = documents, I = images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from megatron_vlm_packing.models.adapter import ModelAdapter, check_unpacked_ids, model_vocab_size
# LlavaRows, expanded_packed_seq_params and llava_pack_plan are re-exported.
from megatron_vlm_packing.models.llava_plan import (  # noqa: F401
    LlavaPackPlan, LlavaRows, PlannedPackedSeqParams, expanded_packed_seq_params, llava_pack_plan,
    planned_packed_seq_params,
)
from megatron_vlm_packing.models.llava_expansion import leak_message, leaking_documents
from megatron_vlm_packing.packing.bounds import checked_int, is_int
from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.media import check_floating_media
from megatron_vlm_packing.packing.micro_batch import MicroBatch
from megatron_vlm_packing.packing.plan import PackMultiples
from megatron_vlm_packing.packing.rows import is_undense, refuse_undense


@dataclass(frozen=True)
class LlavaSpace:
    """How one `LLaVAModel` turns a collapsed sequence into the sequence attention sees.

    Attributes:
        img_seq_len: embeddings per image tile.
        image_token_index: placeholder id of an image.
        segment_multiple: every expanded physical document divides by it (2*cp when cp > 1).
        total_multiple: the expanded total divides by it (LLaVA's CP/SP shard factor).
        pipeline_length: under PP LLaVA pads every expanded row to this length (else None).
        max_length: LLaVA truncates expanded rows beyond this (language_max_sequence_length).
        vocab_size: the language model's vocabulary: the packers refuse real text ids and labels outside
            [0, vocab_size) (None: unknown, checked from below only). Not compared: it makes no plan.
    """

    img_seq_len: int
    image_token_index: int
    segment_multiple: int = 1
    total_multiple: int = 1
    pipeline_length: int | None = None
    max_length: int | None = None
    vocab_size: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # 0 / -2 / 2.5 embeddings per image were accepted (plans for another expanded sequence), a multiple of
        # 0 a ZeroDivisionError, True an image token of 1.
        if not is_int(self.image_token_index):  # may be < 0
            raise ValueError(f"image_token_index must be an int (LLaVA's default is -200), got {self.image_token_index!r}")
        object.__setattr__(self, "image_token_index", int(self.image_token_index))
        for name, optional in (("img_seq_len", False), ("segment_multiple", False), ("total_multiple", False),
                               ("pipeline_length", True), ("max_length", True), ("vocab_size", True)):
            object.__setattr__(self, name, checked_int(getattr(self, name), name, least=1, optional=optional))

    @property
    def multiples(self) -> PackMultiples:
        """The expanded-space alignment as `PackMultiples`: what a planner `BinLayout` for this model needs
        (`PackMultiples.for_parallel` gives the language model's, which LLaVA's own shard factor can exceed:
        at TP=2, CP=2 with SP it is 8, not 4)."""
        return PackMultiples(segment=self.segment_multiple, total=self.total_multiple)

    @classmethod
    def of(cls, model) -> "LlavaSpace":
        """Read from a built `LLaVAModel` (its own shard factor, as `_process_embedding_token_parallel` has it)."""
        cp, tp, sp = model.context_parallel_lm, model.tensor_model_parallel_size_lm, model.sequence_parallel_lm
        total = tp * cp * 2 if cp > 1 and sp else 2 * cp if cp > 1 else tp if sp else 1
        max_length = getattr(model, "_language_max_sequence_length", None)
        pipelined = bool(getattr(model, "_language_is_pipeline_parallel", False))
        return cls(img_seq_len=int(model.img_seq_len), image_token_index=int(model.image_token_index),
                   segment_multiple=2 * cp if cp > 1 else 1, total_multiple=total,
                   pipeline_length=max_length if pipelined else None, max_length=max_length,
                   vocab_size=model_vocab_size(model))


def default_image_tiles(num_image_tiles, num_images: int, device) -> torch.Tensor:
    """[I] int tiles per image: the given ones, or LLaVA's documented default, one per image."""
    if num_image_tiles is None:
        return torch.ones(num_images, dtype=torch.int, device=device)
    return torch.as_tensor(num_image_tiles, device=device).reshape(-1).int()


_TOKEN_BALANCING = ("sinkhorn", "quantile_balancing")  # balance over every routed token: pads included


def router_pad_counters(config) -> tuple[str, ...]:
    """The settings of an MoE `config` whose router counts every token it routes (a load-balancing loss with a
    coefficient, token-level balancing, a z-loss, expert capacity, expert bias): where pad slots are routed
    without a padding mask, these read them as tokens. () for a dense model or a router that counts nothing."""
    if not getattr(config, "num_moe_experts", None):
        return ()
    kinds = getattr(config, "moe_router_load_balancing_type", "none")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = getattr(config, "moe_aux_loss_coeff", 0.0)
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
    found = [f"moe_router_load_balancing_type={kind!r} with moe_aux_loss_coeff={coeff}"
             for kind, coeff in zip(kinds, coeffs) if kind.endswith("aux_loss") and coeff]
    found += [f"moe_router_load_balancing_type={kind!r}" for kind in kinds if kind in _TOKEN_BALANCING]
    for name in ("moe_z_loss_coeff", "moe_expert_capacity_factor"):
        if getattr(config, name, None):
            found.append(f"{name}={getattr(config, name)}")
    if getattr(config, "moe_router_enable_expert_bias", False):
        found.append("moe_router_enable_expert_bias=True")
    return tuple(found)


class LLaVAAdapter(ModelAdapter):
    """Megatron-Core `LLaVAModel`: images ([tiles, C, H, W] pixels) with `num_image_tiles`.

    Everything stays full length under CP (LLaVA expands images first, then selects its CP tokens
    itself with the expanded boundaries). `num_image_tiles` is always passed, one per image when
    the micro-batch has none, so every pipeline stage (and the boundary patch) sees the same tiles.
    Returns `(losses, loss_mask)` on the last stage (LLaVA's own expanded, CP-local loss mask) and
    the hidden states on the others.
    """

    # check() refuses ids no packer checked, its image token excepted: the step reads them in its one read
    checks_unpacked_ids = True
    consumes = frozenset({"images", "image_tiles"})
    needs = LocalizeNeeds(full_input_ids=True, full_position_ids=True, full_labels=True)
    router_pad_counters: tuple[str, ...] = ()  # set by __init__: an MoE language model's token-counting settings

    def __init__(self, model):
        super().__init__(model)
        self.space = LlavaSpace.of(model)
        self.pipeline_length = self.space.pipeline_length  # LLaVAModel pads every expanded row to it under PP
        self.unembedded_token_id = self.space.image_token_index  # replaced by image embeddings, never embedded
        # LLaVAModel.forward takes no padding_mask (0.16.1, 0.19.2): an MoE language model routes the pad slots.
        language_model = getattr(model, "language_model", None)
        self.router_pad_counters = router_pad_counters(getattr(language_model, "config", None))

    def image_inputs(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(images [tiles, C, H, W] (empty when none), num_image_tiles [I] int), counts checked: from
        the host ints of a `LlavaPackPlan` / `LlavaRows` and the tensors' shapes (no sync), else read
        from the ids."""
        ids, known = micro_batch.input_ids, known_tiles(micro_batch)
        n_images = len(known) if known is not None else int((ids == self.space.image_token_index).sum())
        vision = micro_batch.vision
        images = vision.pixel_values if vision is not None and vision.has_images else None
        if images is not None:
            if is_undense(images):  # a micro-batch built by hand: the packers refuse these in the batch
                refuse_undense("images (vision.pixel_values)", images, "LLaVAModel's vision tower and this adapter")
            check_floating_media(images, "images (vision.pixel_values)")
        tiles = default_image_tiles(vision.num_image_tiles if vision is not None else None, n_images, ids.device)
        if tiles.numel() != n_images:
            raise ValueError(f"{n_images} image tokens in input_ids but {tiles.numel()} entries in num_image_tiles")
        tile_count = sum(known) if known is not None else int(tiles.sum())
        given = 0 if images is None else images.shape[0]
        if given != tile_count:
            raise ValueError(f"num_image_tiles sums to {tile_count} tiles but the images hold {given}")
        if images is None:
            images = torch.zeros(0, dtype=torch.float32, device=ids.device)
        return images, tiles

    def space_for(self, layout, options) -> LlavaSpace:
        """This model's space with FP8's total multiple (and the layout's) joining LLaVA's shard factor."""
        return aligned_space(self.space, tp_size=layout.tp_size, cp_size=layout.cp_size,
                             sequence_parallel=layout.sequence_parallel, fp8=options.fp8)

    def collated_batch(self, batch, options):
        """Megatron-LM examples/multimodal's collate output (`imgs`, `num_tiles`, `cu_lengths`, S + 1 labels) as
        one right-padded row per sample (`models.llava_mlm_batch`; its packs cut back at this model's expanded
        boundaries); any other batch as it is."""
        from megatron_vlm_packing.models.llava_mlm_batch import from_megatron_lm_batch

        return from_megatron_lm_batch(batch, img_seq_len=self.space.img_seq_len,
                                      image_token_index=self.space.image_token_index,
                                      label_style=options.label_style, pad_id=options.megatron_lm_pad_id)

    def build_micro_batch(self, batch: dict, layout, options) -> MicroBatch:
        """The step's micro-batch: `pack_llava_batch` in this model's expanded space (`options.pad_to`
        is an expanded length; FP8's total multiple joins LLaVA's shard factor), or with `pack=False`
        `pad_llava_batch`: LLaVA's own batched path (`options.seq_length` is a collapsed row length)."""
        from megatron_vlm_packing.models.llava_pack import pack_llava_batch, pad_llava_batch

        if not options.pack:
            return pad_llava_batch(batch, self.space_for(layout, options), label_style=options.label_style,
                                   seq_length=options.seq_length)
        return pack_llava_batch(batch, self.space_for(layout, options), label_style=options.label_style,
                                pad_to=options.pad_to)

    def micro_batch_from_loader(self, micro_batch: MicroBatch, layout, options, device) -> MicroBatch:
        """A micro-batch packed by `models.llava_pack.LlavaPackingCollator`, for this model's space: moved.

        Raises:
            ValueError: it was not planned in LLaVA's expanded space, or for another space / layout, or
                not as the step's options ask (`llava_pack.check_loader_micro_batch`: pack, pad_to, PP).
        """
        from megatron_vlm_packing.models.llava_pack import check_loader_micro_batch
        from megatron_vlm_packing.packing.collate import micro_batch_to

        plan, wanted = micro_batch.plan, self.space_for(layout, options)
        if not isinstance(plan, LlavaPackPlan):
            raise ValueError("the DataLoader yielded a micro-batch not planned in LLaVA's expanded space: build it "
                             "with models.llava_pack.LlavaPackingCollator(space=LlavaSpace.of(model), ...)")
        if plan.space != wanted:
            raise ValueError(f"the micro-batch was packed for {plan.space} but this model and layout need {wanted}: "
                             f"build the LlavaPackingCollator with LlavaSpace.of(model) and the step's fp8")
        check_loader_micro_batch(micro_batch, wanted, options)
        return micro_batch_to(micro_batch, device)

    def check(self, micro_batch: MicroBatch) -> None:
        super().check(micro_batch)
        # the collapsed ids the embedding reads, its image tokens replaced: an id outside the vocabulary was an
        # IndexError there at TP=1, and at TP > 1 a zero embedding (masked on every rank), silently
        check_unpacked_ids(micro_batch, self.vocab_size, unembedded_token_id=self.unembedded_token_id)
        self.refuse_routed_pads(micro_batch)
        refuse_patch_grid(micro_batch)
        self.image_inputs(micro_batch)
        if not micro_batch.is_packed:
            return
        plan = planned(micro_batch)
        if plan is not None:
            if replace(plan.space, total_multiple=self.space.total_multiple) != self.space \
                    or plan.space.total_multiple % self.space.total_multiple:
                raise ValueError(f"the micro-batch was planned for {plan.space}, not this model's {self.space}")
            leaks = plan.leaking_documents()
        else:
            params = micro_batch.packed_seq_params
            leaks = leaking_documents(micro_batch.input_ids, params.cu_seqlens_q, params.cu_seqlens_q_padded,
                                      micro_batch.loss_mask, image_token_index=self.space.image_token_index)
        if leaks:
            raise ValueError(leak_message(leaks))

    def refuse_routed_pads(self, micro_batch: MicroBatch) -> None:
        """An MoE language model whose router counts tokens (`router_pad_counters`) would count the pad slots:
        LLaVAModel hands it no padding_mask. Host ints only."""
        pad_slots = micro_batch.stats.physical_tokens - micro_batch.stats.real_tokens
        if self.router_pad_counters and pad_slots:
            counters = ", ".join(self.router_pad_counters)
            raise ValueError(f"{self.model_name}'s forward takes no padding_mask, so its MoE router would route the "
                             f"micro-batch's {pad_slots} pad slots and count them ({counters}); turn those off, or "
                             f"feed micro-batches without pad slots")

    def forward(self, model, micro_batch: MicroBatch):
        images, tiles = self.image_inputs(micro_batch)
        params, plan = micro_batch.packed_seq_params, planned(micro_batch)
        if params is not None:
            _refuse_unexpanded_boundaries()
        if plan is not None:  # the patch expands them from the plan's host ints, else from the ids
            params = planned_packed_seq_params(plan, params)
        output, loss_mask = model(images, micro_batch.input_ids, micro_batch.position_ids, None,
                                  labels=micro_batch.labels, loss_mask=micro_batch.loss_mask,
                                  num_image_tiles=tiles, packed_seq_params=params)
        return output if loss_mask is None else (output, loss_mask)


def refuse_patch_grid(micro_batch: MicroBatch) -> None:
    """LLaVAModel's vision tower takes whole tiles ([tiles, C, H, W] with `num_image_tiles`) and no patch grid: a
    Qwen-VL style `image_grid_thw` in a hand-built micro-batch was dropped silently. Reads no value.

    Raises:
        ValueError: naming the field and the images it describes.
    """
    grid = micro_batch.vision.image_grid_thw if micro_batch.vision is not None else None
    if grid is not None:
        raise ValueError(f"vision.image_grid_thw describes {grid.shape[0]} image(s) but LLaVAModel takes whole tiles "
                         f"and no patch grid: it would be dropped silently; drop it (LLaVA's images are "
                         f"[tiles, C, H, W], with num_image_tiles per image)")


def _refuse_unexpanded_boundaries() -> None:
    from megatron_vlm_packing.patches.llava_boundaries import packed_boundaries_expanded

    if not packed_boundaries_expanded():
        raise ValueError("LLaVAModel would pass the packed boundaries to attention in collapsed space (one slot per "
                         "image token) while it expands every image: documents would bleed into each other; call "
                         "megatron_vlm_packing.patches.apply_llava_packed_boundaries() (or patches.apply_all()) "
                         "before the first forward")


def planned(micro_batch: MicroBatch) -> LlavaPackPlan | None:
    """The micro-batch's `LlavaPackPlan` when its boundaries are that plan's own (as packed), else None."""
    plan, params, indices = micro_batch.plan, micro_batch.packed_seq_params, micro_batch.indices
    if not isinstance(plan, LlavaPackPlan) or params is None or indices is None:
        return None
    return plan if params.cu_seqlens_q_padded is indices.cu_seqlens_padded else None


def known_tiles(micro_batch: MicroBatch) -> tuple[int, ...] | None:
    """Every image's tiles as host ints, when our packer made the micro-batch (packed or dense)."""
    plan = planned(micro_batch)
    if plan is not None:
        return plan.tiles
    if isinstance(micro_batch.plan, LlavaRows) and not micro_batch.is_packed:
        return micro_batch.plan.tiles
    return None


def aligned_space(space: LlavaSpace, *, tp_size: int = 1, cp_size: int = 1, sequence_parallel: bool = False,
                  fp8: bool = False) -> LlavaSpace:
    """`space` whose total multiple also covers the layout's (FP8's included)."""
    total = PackMultiples.for_parallel(tp_size=tp_size, cp_size=cp_size, sequence_parallel=sequence_parallel,
                                       fp8=fp8).total
    return replace(space, total_multiple=math.lcm(space.total_multiple, total))
