"""Adapter for Megatron-Bridge's Qwen3-Omni (`Qwen3OmniModel` and its `Qwen3OmniThinkerModel`).

Consumes images, videos and audio. Under CP the thinker needs the full `input_ids` (to place the
vision and audio features) and the full [3, 1, T] positions (each document's, as if alone); it
selects its CP tokens itself with `cp_partition_index`, the same index `localize` applied to the
labels and loss mask. Packed input needs `patches.apply_bridge_qwen3_omni_packed()` on Bridge
versions whose thinker refuses `packed_seq_params` (0.6.2); dense rows go to Bridge's own code, which
under TP + SP cuts deepstack features per SP rank with Qwen3-VL's plain `split_deepstack_embs`: dense rows
with images or videos are refused there until `patches.apply_bridge_deepstack_sp()` is applied.

Pipeline parallel: the first stage holds the encoders and the embedding, later stages take hidden
states from the previous one; a first stage with fewer language layers than deepstack levels is a
ValueError here (Bridge would assert at the first image).

Output: the language model's per-token loss, [1, Tl] packed or [B, L / cp] dense.
"""

from __future__ import annotations

from torch import nn

from megatron_vlm_packing.models.adapter import ModelAdapter
from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.micro_batch import MicroBatch

OMNI_MODEL = "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.model.Qwen3OmniModel"
OMNI_THINKER = "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model.Qwen3OmniThinkerModel"


def media_kwargs(micro_batch: MicroBatch) -> dict:
    """The thinker's keywords for the micro-batch's images, videos and audio (Bridge's names)."""
    kwargs = {}
    vision, audio = micro_batch.vision, micro_batch.audio
    if vision is not None and vision.has_images:
        kwargs.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw)
    if vision is not None and vision.has_videos:
        kwargs.update(pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw)
        if vision.second_per_grid_ts is not None:
            kwargs["video_second_per_grid"] = vision.second_per_grid_ts
    if audio is not None:
        kwargs.update(input_features=audio.input_features, feature_attention_mask=audio.feature_attention_mask)
    return kwargs


def qwen3_omni_mrope(model: nn.Module):
    """The `rope.MRopeConfig` of a Bridge `Qwen3OmniModel` or thinker (positions, media counts)."""
    from megatron_vlm_packing.rope import MRopeConfig

    thinker = getattr(model, "thinker", model)
    audio = getattr(thinker, "audio_model", None)
    if audio is None:
        audio = thinker.thinker_transformer_config.audio_config
    n_window = int(audio.n_window)
    return MRopeConfig(family="qwen3_omni", spatial_merge_size=int(thinker.config.spatial_merge_size),
                       image_token_id=int(thinker.image_token_id), video_token_id=int(thinker.video_token_id),
                       vision_start_token_id=int(thinker.vision_start_token_id),
                       audio_token_id=int(thinker.audio_token_id),
                       audio_start_token_id=int(thinker.audio_start_token_id),
                       position_id_per_seconds=float(thinker.position_id_per_seconds), audio_n_window=n_window,
                       mrope_section=tuple(int(x) for x in thinker.config.mrope_section), mrope_interleaved=True)


def deepstack_stage_problem(model: nn.Module) -> str | None:
    """Why this pipeline stage cannot take images, or None.

    Bridge feeds deepstack level i into language layer i and asserts, in `Qwen3VLTransformerBlock.forward`
    at the first pack with an image or video, that every level's layer sits on the first pipeline stage
    (its Qwen3-VL checks the same when it is built; its Qwen3-Omni does not).
    """
    thinker = getattr(model, "thinker", model)
    vision = getattr(getattr(thinker, "thinker_transformer_config", None), "vision_config", None)
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or ())
    if not levels or not thinker.pre_process or thinker.language_model is None:
        return None
    layers = len(thinker.language_model.decoder.layers)
    if levels <= layers:
        return None
    return (f"{type(model).__name__}: {levels} deepstack levels (vision_config.deepstack_visual_indexes) feed "
            f"language layers 0..{levels - 1}, but the first pipeline stage holds {layers} language layer(s) "
            f"(num_layers={thinker.config.num_layers}, pipeline_model_parallel_size="
            f"{thinker.config.pipeline_model_parallel_size}); Bridge's deepstack block needs them all on the first "
            f"stage: give it >= {levels} layers (num_layers_in_first_pipeline_stage) or fewer pipeline stages")


def dense_deepstack_defect(model: nn.Module) -> bool:
    """Would Bridge's dense thinker path give rank-partial vision gradients here (bug class 12)?

    Under TP + SP it cuts the deepstack features per SP rank with `split_deepstack_embs`, Qwen3-VL's plain
    cut with no backward collective (`patches.bridge_deepstack_sp`); the packed path never calls it.
    """
    thinker = getattr(model, "thinker", model)
    vision = getattr(getattr(thinker, "thinker_transformer_config", None), "vision_config", None)
    config = thinker.config
    if not getattr(vision, "deepstack_visual_indexes", None) or not config.sequence_parallel \
            or int(config.tensor_model_parallel_size or 1) < 2:
        return False
    from megatron_vlm_packing.patches.bridge_deepstack_sp import upstream_deepstack_split_is_plain_slice

    return upstream_deepstack_split_is_plain_slice()


class Qwen3OmniAdapter(ModelAdapter):
    """Bridge's Qwen3-Omni model or thinker: ids and positions full, labels / loss mask CP-local.

    `mrope` is the model's own `MRopeConfig` (the step packs each sample's positions with it).
    """

    checks_unpacked_ids = True  # check() refuses ids no packer checked: the step reads them in its one read

    consumes = frozenset({"images", "videos", "audio"})
    needs = LocalizeNeeds(full_input_ids=True, full_position_ids=True)
    rotary = "mrope"
    router_pads = None  # set by __init__ for an MoE thinker (`bridge.adapters.RouterPadMask`)

    def __init__(self, model: nn.Module):
        from megatron_vlm_packing.bridge.adapters import bridge_model_of

        model = bridge_model_of(model, (OMNI_MODEL, OMNI_THINKER), type(self).__name__)
        super().__init__(model)
        problem = deepstack_stage_problem(model)
        if problem is not None:
            raise ValueError(problem)
        self.mrope = qwen3_omni_mrope(model)
        thinker = getattr(model, "thinker", model)
        audio = getattr(thinker, "audio_model", None)
        from megatron_vlm_packing.bridge.tower_inputs import TowerWidths

        self.tower_widths = TowerWidths.of(self.model_name, getattr(thinker, "visual", None), audio)
        from megatron_vlm_packing.bridge.omni_dense_audio import dense_audio_problem

        # Bridge 0.6.2's dense audio path cuts clips by the encoder's `_get_feat_extract_output_lengths`:
        # missing in transformers 5.24, another model's count in 5.12.1 (asked of the method, once).
        self.dense_audio_problem = None if audio is None else dense_audio_problem(audio)
        from megatron_vlm_packing.bridge.audio_windows import encoder_keeps_clips_apart

        # Bridge's dense path encodes every clip of the micro-batch in one call (transformers 5.8 under eager or
        # sdpa: they read each other); asked once, here.
        self.dense_clips_read_each_other = audio is not None and not encoder_keeps_clips_apart(audio)
        from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import thinker_refuses_packing

        self.upstream_takes_packing = not thinker_refuses_packing()  # Bridge's own forward: fixed for the process
        self.dense_deepstack_defect = dense_deepstack_defect(model)
        from megatron_vlm_packing.bridge.adapters import RouterPadMask

        self.router_pads = RouterPadMask.of(getattr(model, "thinker", model).config)  # an MoE thinker's routers

    @property
    def takes_packed_seq_params(self) -> bool:
        """Bridge's thinker takes packed input, or the packing patch runs now: asked per micro-batch, so an
        apply or undo after this adapter was built counts (the adapter is built once per model)."""
        from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import is_applied

        return self.upstream_takes_packing or is_applied()

    def check(self, micro_batch: MicroBatch) -> None:
        if not micro_batch.is_packed and micro_batch.vision is not None and self.dense_deepstack_defect:
            from megatron_vlm_packing.patches.bridge_deepstack_sp import is_applied as deepstack_patched

            if not deepstack_patched():  # asked per micro-batch: an undo after building the adapter counts
                raise ValueError(
                    f"{self.model_name}: Bridge's dense Qwen3-Omni path cuts deepstack features per SP rank with no "
                    f"backward collective, so vision gradients would be wrong under TP + SP; call "
                    f"megatron_vlm_packing.patches.apply_bridge_deepstack_sp() (or apply_bridge_patches()), "
                    f"or use pack=True")
        if micro_batch.is_packed and not self.takes_packed_seq_params:
            raise ValueError(
                f"{self.model_name}: this Megatron-Bridge's Qwen3-Omni thinker refuses packed_seq_params "
                f"(NotImplementedError); call megatron_vlm_packing.patches.apply_bridge_qwen3_omni_packed() "
                f"before the first forward, or use pack=False")
        if self.router_pads is not None:
            self.router_pads.check(micro_batch)
        super().check(micro_batch)
        self.tower_widths.check(micro_batch)
        from megatron_vlm_packing.bridge.adapters import check_unpacked_vision
        from megatron_vlm_packing.models.adapter import check_unpacked_ids

        check_unpacked_ids(micro_batch, self.vocab_size)
        check_unpacked_vision(micro_batch, self.mrope)  # Bridge's thinker compares no placeholder with its inputs
        if not micro_batch.is_packed and micro_batch.audio is not None:
            self._check_dense_audio(micro_batch.audio)
        if micro_batch.is_packed and micro_batch.position_ids.dim() != 3:
            raise ValueError(
                f"{self.model_name} packed needs every document's mRoPE positions [3, 1, T]; the micro-batch has "
                f"position_ids {tuple(micro_batch.position_ids.shape)} (pack with mrope=MRopeConfig of the model)")

    def _check_dense_audio(self, audio) -> None:
        """Dense rows with audio run Bridge's own code: refuse what it cannot run, with the reason."""
        if self.dense_audio_problem is not None:
            raise ValueError(f"{self.model_name}: Bridge's dense Qwen3-Omni audio path {self.dense_audio_problem}; "
                             f"train audio packed (pack=True, patches.apply_bridge_qwen3_omni_packed())")
        if self.dense_clips_read_each_other and len(audio.audio_lengths) > 1:
            raise ValueError(f"{self.model_name}: Bridge's dense Qwen3-Omni audio path encodes the micro-batch's "
                             f"{len(audio.audio_lengths)} audio clips in one call, and this transformers' audio "
                             f"attention lets clips encoded together attend to each other (it gives its windows to "
                             f"flash attention only): every row would read the other rows' audio; train audio packed")
        # Bridge pairs each row's audio placeholders with one clip (zip(clips, rows, strict=True)): a row with two
        # clips, or a row without one beside a row with one, failed inside it with "zip() argument 2 is longer".
        if audio.audios_per_sample and any(n != 1 for n in audio.audios_per_sample):
            raise ValueError(f"{self.model_name}: Bridge's dense Qwen3-Omni path takes exactly one audio clip in "
                             f"every row once any row has audio (audios_per_sample={list(audio.audios_per_sample)}); "
                             f"train audio packed")

    def forward(self, model: nn.Module, micro_batch: MicroBatch):
        mb = micro_batch
        mask = self.router_pads.mask(mb) if self.router_pads is not None else None
        blocks = {} if mask is None else {"extra_block_kwargs": {"padding_mask": mask}}  # the thinker hands them on
        return model(input_ids=mb.input_ids, position_ids=mb.position_ids, labels=mb.labels,
                     loss_mask=mb.loss_mask, packed_seq_params=mb.packed_seq_params, **media_kwargs(mb), **blocks)
