"""Patch of Megatron-Bridge's `Qwen3OmniThinkerModel.forward`: packed THD input (images, videos, audio).

Bridge 0.6.2's thinker raises `NotImplementedError: Qwen3-Omni packed sequence support is not
implemented yet` when `packed_seq_params` is given (Megatron-Bridge #4304). The patch gives it a
packed path and leaves every dense call to Bridge's own code:

    full ids [1, T] -> embed -> vision / video / audio features placed at their placeholders
    -> this CP rank's tokens (`cp_partition_index`, TE's per-document zigzag) for the embeddings,
       the deepstack features and the positions -> SP scatter -> Bridge's `Qwen3VLGPTModel`
       with `packed_seq_params` and rank-local per-token mRoPE positions.

- Positions: the caller's [3, 1, T] positions, each document's as if it were alone (float: video
  t positions are fractional), e.g. `pack_batch(mrope=TinyOmniConfig.mrope_config())` /
  `rope.get_rope_index`; never recomputed from the packed ids as one sequence.
- Rotary state is per call (bug class 5): the rotary's `is_thd_format` is set from each call
  (True packed, False dense) and restored after it, so a dense call slices for CP exactly as if no
  packed call ran, whatever flag another caller left behind.
- Deepstack features enter the language model as dense [T, H] tensors (zero outside vision
  tokens) that go through the same CP index and Megatron's SP scatter as the embeddings; the
  scatter's backward all-gathers, so every TP rank's vision tower gets the whole gradient (Bridge's
  `split_deepstack_embs` slices per SP rank with no backward collective: bug class 12).
- Audio clips are encoded in groups whose chunks pad alike when alone (`audio_embeddings`: Hugging
  Face's encoder carries chunk padding into the last real frames, so clips of different lengths
  encoded in one call differ from each clip alone), one by one where the encoder's attention lets the
  clips of a call read each other (transformers 5.8 under eager or sdpa), and placed in token order; the count of audio
  placeholders must equal the encoder's output length (Bridge's own dense path trims per row and
  cannot take two clips in a row).
- Labels and loss mask are this CP rank's (`packing.localize`); ids and positions full length.
- Pipeline stages: the first holds the embedding and the encoders and places the features; a later
  stage (Bridge built it with `pre_process=False`) takes its hidden states from the previous stage
  (`set_input_tensor`), so it only needs the boundaries and this rank's positions. Bridge's deepstack
  block asserts that every deepstack level feeds a layer of the first stage.

Feature check: the original forward is run with `packed_seq_params` on an object whose every attribute
read stops the call; the defect raises NotImplementedError mentioning "packed" before touching the model,
a fixed forward reads the model. Any other failure is a RuntimeError, never read as fixed. Delete this patch once
Bridge's thinker takes packed input (Megatron-Bridge #4304) and passes the parity tests.

Shape legend: T = physical packed tokens, Tl = T / cp, H = hidden size, A = audio clips.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_vlm_packing.patches.owned import OwnedAttributes, patch_target, probe_failure, signature_naming

THINKER_MODULE = "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model"
_OWNED = OwnedAttributes(__name__)  # Bridge's Qwen3OmniThinkerModel.forward while the patch is applied
_MEDIA_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "video_second_per_grid",
               "input_features", "feature_attention_mask", "audio_feature_lengths")


def _thinker_class():
    from megatron_vlm_packing.bridge.imports import import_bridge_module

    return patch_target(import_bridge_module(THINKER_MODULE), "Qwen3OmniThinkerModel", __name__)


class _PastTheGuard(Exception):
    """The probed forward read an attribute of its model: it got past any packing guard. Not an
    AttributeError, so that `getattr(self, name, default)` and `hasattr` inside the forward let it through."""


class _StatelessThinker:
    """The probe's `self`: reading any attribute raises `_PastTheGuard`."""

    def __getattr__(self, name):
        raise _PastTheGuard(name)


def thinker_refuses_packing(forward=None) -> bool:
    """True when the thinker's (original) forward refuses `packed_seq_params` (the defect).

    The forward is called with `packed_seq_params` on an object whose every attribute read raises
    `_PastTheGuard`. Bridge 0.6.2 raises NotImplementedError naming packing before it reads the model (the
    defect); a forward that reads its model's state (or returns) got past any such guard (fixed).

    Raises:
        RuntimeError: the forward failed otherwise (a signature without `packed_seq_params`, another
            NotImplementedError, any other exception; named, with the exception): neither answer can be told.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    forward = forward or _OWNED.original("forward") or _thinker_class().forward
    try:
        forward(_StatelessThinker(), input_ids=torch.zeros(1, 1, dtype=torch.long),
                packed_seq_params=PackedSeqParams(qkv_format="thd"))
    except _PastTheGuard:
        return False
    except Exception as err:
        if isinstance(err, NotImplementedError) and "packed" in str(err).lower():
            return True
        raise probe_failure(forward, err, __name__) from err
    return False


def is_applied() -> bool:
    return _OWNED.active()


def apply_bridge_qwen3_omni_packed() -> bool:
    """Give Bridge's Qwen3-Omni thinker a packed THD path. Idempotent; returns whether it is active.

    Raises:
        RuntimeError: the thinker is gone, the defect probe cannot tell (`thinker_refuses_packing`), or an
            earlier wrapper hides the forward's arguments; nothing is applied.
    """
    if is_applied():
        return True
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    cls = _thinker_class()
    if not thinker_refuses_packing(cls.forward):
        return False
    original = cls.forward
    signature = signature_naming(original, ("input_ids", "position_ids", "packed_seq_params"), __name__)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        call = signature.bind(self, *args, **kwargs).arguments
        if call.get("packed_seq_params") is None:  # dense: Bridge's code, with the rotary in dense mode
            with rotary_mode(self, thd=False):
                return original(self, *args, **kwargs)
        call.pop("self")
        extra = call.pop("kwargs", {})
        return packed_thinker_forward(self, **call, **extra)

    _OWNED.set(cls, "forward", forward)
    return True


def undo_bridge_qwen3_omni_packed() -> None:
    """Restore Qwen3OmniThinkerModel.forward. A no-op when not applied.

    Raises:
        RuntimeError: a later patch wraps the thinker's forward; nothing is restored.
    """
    _OWNED.restore()


def packed_thinker_forward(thinker, *, input_ids, position_ids, packed_seq_params, labels=None, loss_mask=None,
                           attention_mask=None, inference_params=None, extra_block_kwargs=None,
                           runtime_gather_output=None, **media):
    """The thinker on one packed THD sequence. Returns the language model's output (per-token loss
    [1, Tl] with labels, else logits), for this rank's tokens.

    Args:
        input_ids: [1, T] long, the full packed ids (every CP rank).
        position_ids: [3, 1, T] (float or long), every document's mRoPE positions as if alone.
        packed_seq_params: THD boundaries; `cu_seqlens_q_padded[-1] == T`.
        labels, loss_mask: [1, Tl], this CP rank's tokens.
        media: pixel_values [P, C] + image_grid_thw [I, 3], pixel_values_videos + video_grid_thw
            (+ video_second_per_grid, used only by positions), input_features [A, F, L] +
            feature_attention_mask [A, L] (or flat [F, sum L] features + audio_feature_lengths [A]).

    Raises:
        ValueError: inputs the packed path cannot take (named), shapes that disagree, placeholder
            counts that disagree with the features.
    """
    unknown = sorted(set(media) - set(_MEDIA_KEYS))
    if unknown or inference_params is not None or attention_mask is not None:
        named = unknown + [n for n, v in (("inference_params", inference_params),
                                          ("attention_mask", attention_mask)) if v is not None]
        raise ValueError(f"packed Qwen3-Omni thinker cannot take {named}: boundaries come from packed_seq_params, "
                         f"media from {list(_MEDIA_KEYS)}")
    pg = thinker.pg_collection
    cp_size, cp_rank = pg.cp.size(), pg.cp.rank()
    _check_packed_layout(input_ids, position_ids, packed_seq_params, labels, cp_size)
    index = None
    if cp_size > 1:
        from megatron_vlm_packing.parallel.cp import cp_partition_index

        index = cp_partition_index(packed_seq_params.cu_seqlens_q_padded, cp_size, cp_rank)  # [Tl]
    embeddings = deepstack = None  # later pipeline stages: hidden states from the previous stage
    if thinker.pre_process:  # the first stage holds the embedding and the encoders
        embeddings, deepstack = merged_embeddings(thinker, input_ids, **media)  # [T, 1, H], list of [T, 1, H]
        embeddings, deepstack = (_local_tokens(x, index, thinker) for x in (embeddings, deepstack))
    positions = position_ids if index is None else position_ids.index_select(-1, index)  # [3, 1, Tl]
    visual_pos_masks = deepstack_embeds = None
    if deepstack:  # all-True mask: the dense features are zero outside vision tokens
        deepstack_embeds = [d[:, 0] for d in deepstack]  # [Tl / tp, H]
        visual_pos_masks = torch.ones(1, deepstack_embeds[0].shape[0], dtype=torch.bool, device=input_ids.device)
    with rotary_mode(thinker, thd=True):  # positions are this rank's already: the rotary must not slice for CP
        return thinker.language_model(
            input_ids=None, position_ids=positions, attention_mask=None, decoder_input=embeddings, labels=labels,
            loss_mask=loss_mask, packed_seq_params=packed_seq_params, runtime_gather_output=runtime_gather_output,
            extra_block_kwargs=extra_block_kwargs, visual_pos_masks=visual_pos_masks,
            deepstack_visual_embeds=deepstack_embeds)


@contextlib.contextmanager
def rotary_mode(thinker, *, thd: bool):
    """The language model's rotary `is_thd_format` set for one call and restored after it (bug class 5)."""
    rotary = getattr(getattr(thinker, "language_model", None), "rotary_pos_emb", None)
    if rotary is None or not hasattr(rotary, "is_thd_format"):
        yield
        return
    saved = rotary.is_thd_format
    rotary.is_thd_format = thd
    try:
        yield
    finally:
        rotary.is_thd_format = saved


def _check_packed_layout(input_ids, position_ids, packed_seq_params, labels, cp_size: int) -> int:
    """T, after checking that ids, positions and labels have the packed layout."""
    if packed_seq_params.qkv_format != "thd" or packed_seq_params.cu_seqlens_q_padded is None:
        raise ValueError("packed Qwen3-Omni needs THD packed_seq_params with cu_seqlens_q_padded "
                         f"(qkv_format={packed_seq_params.qkv_format!r})")
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        got = None if input_ids is None else tuple(input_ids.shape)
        raise ValueError(f"packed input_ids must be [1, T], got {got}")
    total = input_ids.shape[1]
    if position_ids is None or tuple(position_ids.shape) != (3, 1, total):
        got = None if position_ids is None else tuple(position_ids.shape)
        raise ValueError(f"packed Qwen3-Omni needs every document's mRoPE position_ids [3, 1, {total}] "
                         f"(pack_batch(mrope=...)), got {got}")
    if total % cp_size:
        raise ValueError(f"packed length {total} does not divide by cp_size {cp_size}")
    if labels is not None and tuple(labels.shape) != (1, total // cp_size):
        raise ValueError(f"labels must be this CP rank's [1, {total // cp_size}] tokens (packing.localize), "
                         f"got {tuple(labels.shape)}")
    return total


def _local_tokens(x, index, thinker):
    """[T, 1, H] (or a list of them) -> this rank's [Tl / tp, 1, H]: CP index, then SP scatter."""
    if x is None or isinstance(x, list):
        return None if x is None else [_local_tokens(item, index, thinker) for item in x]
    if index is not None:
        x = x.index_select(0, index)
    if thinker.config.sequence_parallel:
        from megatron.core import tensor_parallel

        tp = thinker.pg_collection.tp
        if x.shape[0] % tp.size():
            raise ValueError(f"{x.shape[0]} tokens per CP rank do not divide by tp {tp.size()} under SP")
        x = tensor_parallel.scatter_to_sequence_parallel_region(x, group=tp)  # backward: all-gather
    return x


def merged_embeddings(thinker, input_ids, *, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
                      video_grid_thw=None, video_second_per_grid=None, input_features=None,
                      feature_attention_mask=None, audio_feature_lengths=None):
    """Token embeddings with every image, video and audio feature at its placeholders.

    Returns:
        ([T, 1, H] embeddings, list of [T, 1, H] deepstack features (zero outside image/video tokens)
        or None when the pack has no image or video).
    """
    del video_second_per_grid  # positions carry the temporal scale
    ids = input_ids[0]
    text = thinker.language_model.embedding(input_ids=input_ids, position_ids=None)[:, 0]  # [T, H]
    where, features, deepstack = [], [], []
    for kind, pixels, grid, token in (("image", pixel_values, image_grid_thw, thinker.image_token_id),
                                      ("video", pixel_values_videos, video_grid_thw, thinker.video_token_id)):
        if pixels is None:
            continue
        if grid is None:
            raise ValueError(f"{kind} pixels were given without {kind}_grid_thw")
        embeds, levels = (thinker.get_image_features if kind == "image" else thinker.get_video_features)(pixels, grid)
        where.append(_placeholders(ids, token, embeds.shape[0], kind))
        features.append(embeds.to(text.dtype))
        deepstack.append([level.to(text.dtype) for level in levels])
    vision_where = torch.cat(where) if where else None
    if input_features is not None:
        audio = audio_embeddings(thinker, input_features, feature_attention_mask, audio_feature_lengths)
        where.append(_placeholders(ids, thinker.audio_token_id, audio.shape[0], "audio"))
        features.append(audio.to(text.dtype))
    merged = text.index_put((torch.cat(where),), torch.cat(features)) if where else text
    levels = None
    if vision_where is not None and deepstack[0]:
        zeros = torch.zeros_like(text)
        levels = [zeros.index_put((vision_where,), torch.cat(level))[:, None] for level in zip(*deepstack)]
    return merged[:, None], levels


def _placeholders(ids: torch.Tensor, token: int, count: int, kind: str) -> torch.Tensor:
    """[count] positions of `token` in ids; a ValueError when the features are not exactly as many."""
    where = torch.nonzero(ids == token).flatten()  # one host sync per media kind
    if where.numel() != count:
        raise ValueError(f"{where.numel()} {kind} placeholder tokens in input_ids but the {kind} encoder "
                         f"produced {count} features")
    return where


def audio_embeddings(thinker, input_features, feature_attention_mask=None, audio_feature_lengths=None):
    """[sum of output lengths, H] audio encoder features of every clip, in clip order, each exactly as
    the clip alone would get them.

    input_features: [A, F, L] with feature_attention_mask [A, L] (1 at real frames), or [F, sum L]
    real frames with audio_feature_lengths [A].

    The encoder pads every clip's 2*n_window-frame chunks to the longest chunk of its call, and its
    convolutions carry values from those pad frames into the last real outputs: clips of different
    lengths encoded together differ from each clip alone. Clips are therefore encoded in groups
    whose chunks pad to the same length alone (min(frames, 2*n_window)), one call per group; where the
    encoder's attention lets clips of one call read each other (transformers 5.8 under eager or sdpa,
    `bridge.audio_windows`), one call per clip.
    """
    if feature_attention_mask is not None:
        lengths = feature_attention_mask.sum(dim=1)
        frames = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)  # [F, sum L]
    elif audio_feature_lengths is not None:
        lengths, frames = audio_feature_lengths, input_features
    else:
        raise ValueError("input_features need feature_attention_mask [A, L] or audio_feature_lengths [A]")
    from megatron_vlm_packing.bridge.audio_windows import clip_groups, encoder_keeps_clips_apart
    from megatron_vlm_packing.rope.omni import audio_output_length

    encoder = thinker.audio_model
    frames = frames.to(next(encoder.parameters()).dtype)
    host = lengths.tolist()  # one host sync: the grouping and the per-clip slices are host ints
    starts = [sum(host[:i]) for i in range(len(host))]
    outputs = audio_output_length(torch.tensor(host), encoder.n_window).tolist()
    per_clip = [None] * len(host)
    groups = clip_groups(host, encoder.n_window)
    # Asked only when a group holds several clips; probed once per encoder attention (its one small read-back),
    # then remembered.
    if any(len(clips) > 1 for clips in groups) and not encoder_keeps_clips_apart(encoder):
        groups = [[clip] for clips in groups for clip in clips]
    for clips in groups:
        chunk = torch.cat([frames[:, starts[c]:starts[c] + host[c]] for c in clips], dim=1)
        encoded = encoder(chunk, feature_lens=lengths[clips]).last_hidden_state  # [sum outputs of clips, H]
        for clip, piece in zip(clips, encoded.split([outputs[c] for c in clips])):
            per_clip[clip] = piece
    return torch.cat(per_clip)
