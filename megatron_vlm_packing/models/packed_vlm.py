"""`PackedVLM`: any Megatron-Core GPTModel + vision (images, videos) and audio towers, exact under
packing, CP and SP.

The order of operations is the point (contract items 5, 6 and 8):
1. embed the FULL `input_ids` (the LM's own SP scatter must be off: build it with
   `scatter_embedding_sequence_parallel=False`),
2. place image, video and audio embeddings at their placeholder tokens (needs the full ids), after
   checking that every sample's placeholders are exactly its own items' tokens,
3. select this CP rank's tokens with the one CP index the micro-batch was localized with,
4. scatter for sequence parallelism, once,
5. run the decoder with `decoder_input`, the packed boundaries and the positions (1D CP-local, or
   full-length mRoPE positions for the packed rotary this module installs).

Shape legend: T = packed physical tokens, Tl = CP-local tokens, B = rows, S = row length, H = hidden,
P / Pv = image / video patches, A = audio clips, F = mel bins, L = frames.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from megatron_vlm_packing.models.adapter import ModelAdapter, check_unpacked_ids, unwrap_model
from megatron_vlm_packing.models.audio import check_audio_lengths
from megatron_vlm_packing.models.gpt_adapter import (check_position_kind, refuse_pads_unmasked_for_moe,
                                                     refuse_unread_seconds)
from megatron_vlm_packing.models.merge import (check_media_dtypes, check_placeholders_per_sample,
                                               check_tower_output, merge_vision_embeddings, place_checked_embeddings,
                                               refuse_orphan_placeholders, sample_boundaries, tokens_per_grid)
from megatron_vlm_packing.packing.bounds import checked_int, is_int
from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.micro_batch import MicroBatch


def _takes(module: nn.Module, keyword: str) -> bool:
    """Does `module.forward` accept `keyword` (our towers do; a user's tower may not)?"""
    return keyword in inspect.signature(type(module).forward).parameters


def _check_arguments(language_model, vision, audio, merge, mrope, token_ids: dict) -> None:
    """PackedVLM's arguments, before any is used: each a ValueError naming it (True was token id 1, a lambda
    tower's weights no parameters of the model, one id for two kinds each kind's embeddings in the other's slots)."""
    from megatron.core.transformer.module import MegatronModule

    from megatron_vlm_packing.rope.config import MRopeConfig

    if not isinstance(language_model, MegatronModule) or not hasattr(language_model, "config"):
        raise ValueError(f"language_model must be a Megatron-Core GPTModel, got {type(language_model).__name__}")
    for name, tower in (("vision", vision), ("audio", audio)):
        if tower is not None and not isinstance(tower, nn.Module):
            raise ValueError(f"{name} must be None or an nn.Module (its weights train with the model), got "
                             f"{type(tower).__name__} {tower!r:.40}")
    for name, value in token_ids.items():
        if value is not None and (not is_int(value) or not 0 <= value < 2**63):
            raise ValueError(f"{name} must be None or an int >= 0 that fits int64, got {value!r}")
    given = [(name, value) for name, value in token_ids.items() if value is not None]
    for i, (name, value) in enumerate(given):
        for other, other_value in given[i + 1:]:
            if value == other_value:
                raise ValueError(f"{name} and {other} are both {value}: each kind needs its own placeholder id")
    vocab_size = getattr(language_model, "vocab_size", None)  # Megatron's padded vocabulary
    for name, value in given:
        if is_int(vocab_size) and value >= vocab_size:
            raise ValueError(f"{name}={value} is no token id of the language model (vocab_size={vocab_size}): every "
                             f"token is embedded before the media rows replace the placeholders")
    if vision is not None and token_ids["image_token_id"] is None and token_ids["video_token_id"] is None:
        raise ValueError("a vision tower needs image_token_id or video_token_id (the placeholders it fills)")
    if audio is not None and not hasattr(audio, "n_window"):
        raise ValueError(f"the audio tower ({type(audio).__name__}) has no n_window: give it the int window of its "
                         f"encoder (Qwen3-Omni's n_window), with which PackedVLM counts each clip's placeholder tokens")
    if audio is not None:
        checked_int(audio.n_window, "the audio tower's n_window", least=1)
    checked_int(merge, "spatial_merge_size", least=1)
    if mrope is not None and not isinstance(mrope, MRopeConfig):
        raise ValueError(f"mrope must be a rope.MRopeConfig or None, got {type(mrope).__name__} {mrope!r:.40}")


class PackedVLM(nn.Module):
    """Language model + vision / audio towers with packing-exact merge, CP selection and SP scatter.

    Args:
        language_model: a Megatron-Core `GPTModel` built with `scatter_embedding_sequence_parallel=False`.
        vision: module `(pixel_values [P, C], grid_thw [I, 3]) -> [M, H]`, used for images and
            videos, one row per placeholder in token order (a tuple, another shape or row count is a
            ValueError: `merge.check_tower_output`); None for a model without vision.
        image_token_id: the placeholder id each image embedding replaces.
        video_token_id: the placeholder id of video embeddings; None for a model without video.
        audio: module `(input_features [A, F, L], feature_attention_mask [A, L]) -> [M, H]`
            (Qwen3-Omni style) with an int `n_window` attribute, its encoder's window: each clip of F real
            frames takes `rope.omni.audio_output_length(F, n_window)` placeholders; None for a model
            without audio.
        audio_token_id: the placeholder id of audio embeddings (needed with `audio`).
        mrope: `rope.MRopeConfig` for a language model built with position_embedding_type="mrope":
            installs the packed mRoPE rotary (`rope.use_packed_mrope`) and is the default `mrope=`
            of `make_forward_step`. Required for an mRoPE language model.
        spatial_merge_size: vision patches per side merged into one token (2 for the tiny tower).

    Raises:
        ValueError: the LM scatters its own embeddings under SP, an audio tower without
            `audio_token_id`, an mRoPE config for a 1D-rotary LM (or the reverse), or placeholder ids
            that disagree with the mRoPE config.
    """

    def __init__(self, language_model: nn.Module, vision: nn.Module | None = None, *, image_token_id: int | None = None,
                 video_token_id: int | None = None, audio: nn.Module | None = None, audio_token_id: int | None = None,
                 mrope=None, spatial_merge_size: int = 2):
        super().__init__()
        _check_arguments(language_model, vision, audio, spatial_merge_size, mrope,
                         {"image_token_id": image_token_id, "video_token_id": video_token_id,
                          "audio_token_id": audio_token_id})
        embedding = getattr(language_model, "embedding", None)
        if embedding is not None and getattr(embedding, "scatter_to_sequence_parallel", False) \
                and language_model.config.sequence_parallel:
            raise ValueError("build the language model with scatter_embedding_sequence_parallel=False: "
                             "PackedVLM scatters once, after merging vision embeddings and selecting CP tokens")
        if audio is not None and audio_token_id is None:
            raise ValueError("an audio tower needs audio_token_id (the placeholder its embeddings replace)")
        self.language_model, self.vision, self.audio = language_model, vision, audio
        # numpy ints (accepted) kept as Python ints
        self.image_token_id, self.video_token_id, self.audio_token_id = (
            None if token_id is None else int(token_id) for token_id in (image_token_id, video_token_id, audio_token_id))
        self.spatial_merge_size = int(spatial_merge_size)
        self.config = language_model.config
        self.model_type = language_model.model_type  # read by Megatron's schedules
        self.mrope = mrope
        self._install_mrope(mrope)
        self._lm_takes_padding_mask = "padding_mask" in inspect.signature(type(language_model).forward).parameters

    def _install_mrope(self, mrope) -> None:
        kind = getattr(self.language_model, "position_embedding_type", None)
        if mrope is None:
            if kind == "mrope":
                raise ValueError("the language model uses position_embedding_type='mrope': pass "
                                 "PackedVLM(mrope=MRopeConfig(...)) so the packed mRoPE rotary is installed")
            return
        if kind != "mrope":
            raise ValueError(f"mrope={type(mrope).__name__} given but the language model's rotary is {kind!r} (1D): "
                             f"build it with position_embedding_type='mrope' or drop mrope=")
        for name in ("image_token_id", "video_token_id", "audio_token_id", "spatial_merge_size"):
            ours, theirs = getattr(self, name), getattr(mrope, name)
            if ours is not None and theirs is not None and ours != theirs:
                raise ValueError(f"{name}={ours} but the mRoPE config says {theirs}")
        from megatron_vlm_packing.rope import use_packed_mrope

        use_packed_mrope(self.language_model, interleaved=mrope.mrope_interleaved)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline stages after the first receive hidden states here (Megatron's schedule calls it)."""
        self.language_model.set_input_tensor(input_tensor)

    def _merge(self, flat, input_ids, bounds, *, token_id, embeddings, tokens_per_item, checked_rows, per_sample,
               field, tower):
        """Check each sample's placeholders against its items and the tower's rows against the placeholders, then
        place the rows (`merge.check_tower_output`).

        `bounds` None: packing's one read already checked the placeholders (`media_checked`): `checked_rows()`
        counts them from host values and the rows are placed without a sync.
        """
        if token_id is None:
            raise ValueError(f"the micro-batch has {field} inputs but this PackedVLM has no {field}_token_id")
        if bounds is None:
            rows = checked_rows()
        else:
            tokens = tokens_per_item()
            check_placeholders_per_sample(input_ids, bounds, tokens, token_id=token_id, field=field,
                                          items_per_sample=per_sample)
            rows = sum(tokens)
        check_tower_output(embeddings, tower=tower, field=field, token_id=token_id, rows=rows, hidden=flat.shape[-1],
                           device=flat.device)
        if bounds is None:
            return place_checked_embeddings(flat, input_ids, embeddings, token_id=token_id)
        return merge_vision_embeddings(flat, input_ids, embeddings, token_id=token_id, field=field)

    def _vision_embeddings(self, pixels, grid, checked: bool):
        if checked and _takes(self.vision, "inputs_checked"):
            return self.vision(pixels, grid, inputs_checked=True)
        return self.vision(pixels, grid)

    def _audio_embeddings(self, features, mask, audio_lengths, checked: bool):
        if audio_lengths is not None and not checked:
            check_audio_lengths(audio_lengths, mask)
        if audio_lengths is not None and _takes(self.audio, "audio_lengths"):
            return self.audio(features, mask, audio_lengths=tuple(audio_lengths))
        return self.audio(features, mask)

    def _refuse_orphan_placeholders(self, input_ids, present: dict, checked) -> None:
        """Placeholders of a kind without inputs are a ValueError (one read per kind), unless packing
        already checked that kind's placeholders with the same id in its one read (`checked`)."""
        for field, token_id in (("image", self.image_token_id), ("video", self.video_token_id),
                                ("audio", self.audio_token_id)):
            if token_id is not None and not present[field] and (field, token_id) not in checked:
                refuse_orphan_placeholders(input_ids, field, token_id)

    def embed(self, input_ids: torch.Tensor, *, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None, input_features=None, feature_attention_mask=None, packed_seq_params=None,
              images_per_sample=None, videos_per_sample=None, audios_per_sample=None, audio_lengths=None,
              media_checked: bool = False, placeholders_checked=()) -> torch.Tensor:
        """Full-sequence embeddings with image / video / audio rows merged: [S, B, H] (packed: [T, 1, H]).

        `media_checked`: packing's one read already checked every sample's placeholders against its
        items, the grids against the patches and the audio masks (packing/media*.py; the adapter sets
        it when the micro-batch carries those per-sample counts), so no host sync is made here.
        `audio_lengths`: A host ints, real frames per clip (the tower then reads no mask back).
        `placeholders_checked`: (kind, id) pairs whose placeholders packing checked in its one read
        (`MicroBatch.placeholders_checked`); a kind without inputs is then not looked at again when
        the id is this model's (otherwise: one read per such kind).
        """
        emb = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        present = dict(image=pixel_values is not None, video=pixel_values_videos is not None,
                       audio=input_features is not None)
        self._refuse_orphan_placeholders(input_ids, present, frozenset(placeholders_checked))
        if not any(present.values()):
            return emb
        self._check_media_inputs(present, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                 input_features, feature_attention_mask)
        bounds = None if media_checked else sample_boundaries(input_ids, packed_seq_params)
        flat = emb.transpose(0, 1).reshape(-1, emb.shape[-1])  # [B*S, H], row-major like input_ids
        if present["image"]:
            flat = self._merge_vision(flat, input_ids, bounds, "image", pixel_values, image_grid_thw,
                                      images_per_sample, media_checked)
        if present["video"]:
            flat = self._merge_vision(flat, input_ids, bounds, "video", pixel_values_videos, video_grid_thw,
                                      videos_per_sample, media_checked)
        if present["audio"]:
            flat = self._merge_audio(flat, input_ids, bounds, input_features, feature_attention_mask,
                                     audios_per_sample, audio_lengths)
        return flat.reshape(emb.shape[1], emb.shape[0], -1).transpose(0, 1)

    def _check_media_inputs(self, present: dict, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                            input_features, feature_attention_mask) -> None:
        """ValueError for media this model has no tower for, patches without their grid, audio features
        without their mask, or media of a dtype the towers would cast (`merge.check_media_dtypes`); reads
        nothing."""
        if (present["image"] or present["video"]) and self.vision is None:
            raise ValueError("the micro-batch has images or videos but this PackedVLM has no vision tower")
        if present["audio"] and self.audio is None:
            raise ValueError("the micro-batch has audio but this PackedVLM has no audio tower")
        for field, pixels, grid in (("image_grid_thw", pixel_values, image_grid_thw),
                                    ("video_grid_thw", pixel_values_videos, video_grid_thw)):
            if pixels is not None and grid is None:
                raise ValueError(f"{pixels.shape[0]} patches given without {field}: the tower cannot split them")
        if present["audio"] and feature_attention_mask is None:
            raise ValueError("input_features given without feature_attention_mask: audio lengths are unknown")
        check_media_dtypes(pixel_values=pixel_values, pixel_values_videos=pixel_values_videos,
                           input_features=input_features, feature_attention_mask=feature_attention_mask)

    def _merge_vision(self, flat, input_ids, bounds, field: str, pixels, grid, per_sample, checked: bool):
        """`flat` [B*S, H] with the vision tower's embeddings of `field` ("image" or "video") placed:
        pixels [P, C] and grid [I, 3] of that kind, `per_sample` its items per sample."""
        merge = self.spatial_merge_size
        # checked: packing found the grids' t*h*w to sum to the patches, h and w multiples of the merge
        return self._merge(flat, input_ids, bounds, token_id=getattr(self, f"{field}_token_id"), field=field,
                           embeddings=self._vision_embeddings(pixels, grid, checked), tower="vision",
                           tokens_per_item=lambda: tokens_per_grid(grid, merge),
                           checked_rows=lambda: pixels.shape[0] // merge ** 2, per_sample=per_sample)

    def _merge_audio(self, flat, input_ids, bounds, features, mask, per_sample, audio_lengths):
        """`flat` [B*S, H] with the audio tower's embeddings placed: features [A, F, L], mask [A, L]."""
        from megatron_vlm_packing.models.audio import audio_tokens_per_clip_from_mask
        from megatron_vlm_packing.rope.omni import audio_output_length

        window = self.audio.n_window

        def checked_rows() -> int:  # from packing's host lengths (no sync); a direct call without them reads the mask
            if audio_lengths is None:
                return sum(audio_tokens_per_clip_from_mask(mask, window))
            return sum(int(audio_output_length(int(n), window)) for n in audio_lengths)

        return self._merge(flat, input_ids, bounds, token_id=self.audio_token_id, field="audio",
                           embeddings=self._audio_embeddings(features, mask, audio_lengths, bounds is None),
                           tower="audio", tokens_per_item=lambda: audio_tokens_per_clip_from_mask(mask, window),
                           checked_rows=checked_rows, per_sample=per_sample)

    def _decoder_input(self, input_ids, cp_index, media: dict, packed_seq_params):
        emb = self.embed(input_ids, packed_seq_params=packed_seq_params, **media)
        if cp_index is not None:
            emb = emb.index_select(0, cp_index)  # [Tl, B, H]: the one CP index of the micro-batch
        if self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb

    def _padding_mask(self, padding_mask, scatter: bool):
        if padding_mask is None or not self._lm_takes_padding_mask:
            return {}
        if scatter and self.config.sequence_parallel:
            # GPTModel scatters padding_mask only when it embeds itself; with decoder_input we must.
            from megatron.core import tensor_parallel

            pad = tensor_parallel.scatter_to_sequence_parallel_region(padding_mask.transpose(0, 1).contiguous())
            padding_mask = pad.transpose(0, 1).contiguous()
        return {"padding_mask": padding_mask}

    def forward(self, input_ids, position_ids, labels=None, *, packed_seq_params=None, cp_index=None,
                attention_mask=None, padding_mask=None, **media):
        """Per-token loss [B, Sl] (labels given) or logits.

        Args:
            input_ids: [B, S] long, FULL sequence (packed: [1, T]); never CP-sliced.
            position_ids: CP-local [B, Sl] positions, or full [3, B, S] mRoPE positions.
            labels: CP-local [B, Sl] targets.
            cp_index: [Sl] long, this CP rank's token indices (None when cp = 1).
            padding_mask: CP-local [B, Sl] bool, True = pad (for MoE routing).
            media: pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, input_features,
                feature_attention_mask, images_per_sample, videos_per_sample, audios_per_sample
                (see `embed`); any other keyword is a TypeError.
        """
        unknown = sorted(set(media) - set(inspect.signature(self.embed).parameters) - {"input_ids"})
        if unknown:
            raise TypeError(f"PackedVLM.forward got unexpected keywords {unknown}")
        decoder_input = None
        if getattr(self.language_model, "pre_process", True):
            decoder_input = self._decoder_input(input_ids, cp_index, media, packed_seq_params)
        kwargs = self._padding_mask(padding_mask, scatter=decoder_input is not None)
        return self.language_model(None, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                                   packed_seq_params=packed_seq_params, **kwargs)


class PackedVLMAdapter(ModelAdapter):
    """`PackedVLM` takes the full ids (it merges media, then selects its CP tokens with `cp_index`)."""

    checks_unpacked_ids = True  # check() refuses ids no packer checked: the step reads them in its one read

    def __init__(self, model: PackedVLM):
        super().__init__(model)
        # PackedVLM hands its language model the padding mask only where its forward names it (only a router reads it)
        self.language_model_name = type(model.language_model).__name__
        self.lm_is_moe = bool(getattr(model.config, "num_moe_experts", None))
        self.lm_takes_padding_mask = model._lm_takes_padding_mask
        # A pipeline stage after the first holds no towers: the first stage consumed the media.
        later_stage = not getattr(model.language_model, "pre_process", True)
        consumes = set()
        if model.image_token_id is not None and (model.vision is not None or later_stage):
            consumes.add("images")
        if model.video_token_id is not None and (model.vision is not None or later_stage):
            consumes.add("videos")
        if model.audio_token_id is not None and (model.audio is not None or later_stage):
            consumes.add("audio")
        self.consumes = frozenset(consumes)
        self.mrope = model.mrope
        self.rotary = "mrope" if model.mrope is not None else "1d"
        self.needs = LocalizeNeeds(full_input_ids=True, full_position_ids=model.mrope is not None)
        ids = dict(image_token_id=model.image_token_id if "images" in consumes else None,
                   video_token_id=model.video_token_id if "videos" in consumes else None,
                   audio_token_id=model.audio_token_id if "audio" in consumes else None)
        self.media_token_ids = {k: v for k, v in ids.items() if v is not None}
        if self.media_token_ids:
            self.media_token_ids["spatial_merge_size"] = model.spatial_merge_size

    def check(self, micro_batch: MicroBatch) -> None:
        refuse_unread_seconds(micro_batch, self.rotary, self.model_name)  # first: it says why (a 1D rotary)
        super().check(micro_batch)
        check_unpacked_ids(micro_batch, self.vocab_size)
        check_position_kind(micro_batch, self.rotary, self.model_name)
        refuse_pads_unmasked_for_moe(micro_batch, self.language_model_name, is_moe=self.lm_is_moe,
                                     takes_padding_mask=self.lm_takes_padding_mask)

    def _packing_counts_clips_like(self, model: nn.Module) -> bool:
        """Packing counted each clip's tokens with the mRoPE config's `audio_n_window` (else its
        default): trust its check only when the audio tower uses the same window."""
        from megatron_vlm_packing.packing.media_tokens import MediaTokens

        window = getattr(self.mrope, "audio_n_window", None) or MediaTokens.audio_n_window
        tower = getattr(unwrap_model(model), "audio", None)  # under Megatron's wrappers too
        return tower is not None and getattr(tower, "n_window", None) == window

    def forward(self, model: nn.Module, micro_batch: MicroBatch):
        media = {}
        vision, audio = micro_batch.vision, micro_batch.audio
        if vision is not None and vision.has_images:
            media.update(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                         images_per_sample=vision.images_per_sample)
        if vision is not None and vision.has_videos:
            media.update(pixel_values_videos=vision.pixel_values_videos, video_grid_thw=vision.video_grid_thw,
                         videos_per_sample=vision.videos_per_sample)
        if audio is not None:
            media.update(input_features=audio.input_features, feature_attention_mask=audio.feature_attention_mask,
                         audios_per_sample=audio.audios_per_sample, audio_lengths=audio.audio_lengths)
        # Packing fills the per-sample counts only after checking every sample's placeholders against
        # its items (packing/media*.py, in its one read): the model then needs no read of its own, when
        # packing counted the placeholder ids this model places (a loader may be configured otherwise), and only
        # for the ids and media packing checked: after a replace (a transform, an edited loader micro-batch)
        # the marks are kept but no longer hold, so the model checks everything itself.
        by_packer = micro_batch.media_checked_by_packer
        kinds = [(kind, key) for kind, key in (("image", "images_per_sample"), ("video", "videos_per_sample"),
                                               ("audio", "audios_per_sample")) if key in media]
        checked = set(micro_batch.placeholders_checked) if by_packer else set()
        media["media_checked"] = by_packer and bool(kinds) and all(media[key] is not None for _, key in kinds) \
            and all((kind, self.media_token_ids.get(f"{kind}_token_id")) in checked for kind, _ in kinds) \
            and (vision is None or vision.spatial_merge_size == self.media_token_ids.get("spatial_merge_size")) \
            and (audio is None or self._packing_counts_clips_like(model))
        # position_ids by keyword: Megatron's Float16Module casts float32 positional inputs to bf16 / fp16,
        # which would round Qwen3-Omni's fractional positions.
        return model(micro_batch.input_ids, position_ids=micro_batch.position_ids, labels=micro_batch.labels,
                     packed_seq_params=micro_batch.packed_seq_params, cp_index=micro_batch.cp_index,
                     padding_mask=micro_batch.padding_mask, placeholders_checked=tuple(sorted(checked)),
                     **media)

