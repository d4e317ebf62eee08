"""Patch of `megatron.core.models.multimodal.llava_model.LLaVAModel.forward`: packed boundaries in
the expanded space, on every pipeline stage, and no silently lost token.

`LLaVAModel._preprocess_data` expands each image token into `num_tiles * img_seq_len` embeddings
but `forward` passes `packed_seq_params` through unchanged (bug class 2), so attention runs with
collapsed-space boundaries on the expanded sequence and documents bleed into each other. The patch,
for a THD call:
- fills `num_image_tiles` when it is omitted with LLaVA's documented default (one tile per image:
  per image tile given, else per image token on stages without images), so every stage agrees;
- remaps both boundary sets (`models.llava_expansion.remap_packed_seq_params`) on every stage that runs the
  language model, `pre_process=False` stages included (their input has the expanded length too),
  with LLaVA's own shard factor and, under PP, the fixed length LLaVA pads rows to;
- refuses (ValueError) a pack whose expansion breaks 2*cp per document or the shard factor, that
  LLaVA would truncate, or where a document opening with an image would make LLaVA zero the
  previous document's last weighted token (bug class 13; `models.llava_pack.pack_llava_batch`
  plans packs that satisfy all of this).
For `PlannedPackedSeqParams` (what `LLaVAAdapter` passes for a micro-batch with a `LlavaPackPlan`)
the same is done from the plan's host ints (`expand_planned_call`): nothing is read back to the host.
Feature check: upstream would have to hand `packed_seq_params` to `_preprocess_data` to fix it;
the patch applies only while it does not. Delete it once upstream remaps the boundaries itself.

Why a signature and not a behaviour probe (as the rotary and Bridge patches run): the behaviour is only
observable through a built `LLaVAModel` (a vision tower, a projector and a language model, whose
constructors need Megatron's model-parallel state, which `apply_all` may precede) running a forward with
an image (under PP only the first stage holds the encoder, so stages could disagree). Without a model,
the signature is the one observable. It reads "fixed" only for an upstream that names `packed_seq_params`
in `_preprocess_data`, which is when this patch must be re-checked anyway (tests/llava's parity suite runs
the packed model against each sample alone); a wrapper without functools.wraps that hides the name reads
as the defect present. A missing `_preprocess_data` is a RuntimeError (`patch_target`), never read as fixed.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_vlm_packing.patches.owned import OwnedAttributes, patch_target, signature_naming

_OWNED = OwnedAttributes(__name__)  # LLaVAModel.forward while the patch is applied


def _llava():
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    return LLaVAModel


def upstream_remaps_packed_boundaries() -> bool:
    """Does `LLaVAModel._preprocess_data` take `packed_seq_params` (upstream's fix; why a signature: see
    the module docstring)?

    Raises:
        RuntimeError: `LLaVAModel._preprocess_data` does not exist here (renamed or removed upstream).
    """
    return "packed_seq_params" in inspect.signature(patch_target(_llava(), "_preprocess_data", __name__)).parameters


def _default_tiles(call: dict, input_ids: torch.Tensor, image_token: int) -> torch.Tensor:
    images = call.get("images")
    if isinstance(images, torch.Tensor) and images.dim() > 1 and images.shape[0] > 0:
        count = images.shape[0]  # LLaVA's own default: one tile per image given
    else:
        count = int((input_ids == image_token).sum())
    return torch.ones(count, dtype=torch.int, device=input_ids.device)


def packed_boundaries_expanded() -> bool:
    """Does LLaVAModel.forward hand attention expanded boundaries (upstream's fix, or this patch applied)?"""
    return _OWNED.active() or upstream_remaps_packed_boundaries()


def expand_packed_call(model, call: dict) -> None:
    """Rewrite `call` (LLaVAModel.forward's bound arguments) for a THD pack: tiles, expanded boundaries."""
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.models.llava_expansion import leak_message, leaking_documents, remap_packed_seq_params

    params, input_ids = call["packed_seq_params"], call.get("input_ids")
    if getattr(params, "llava_plan", None) is not None:
        expand_planned_call(model, call)
        return
    if input_ids is None:
        raise ValueError("LLaVAModel with THD packed_seq_params needs input_ids on every pipeline stage "
                         "(the boundaries are expanded from the image tokens)")
    image_token = call.get("image_token_index")
    image_token = model.image_token_index if image_token is None else image_token
    if call.get("num_image_tiles") is None:
        call["num_image_tiles"] = _default_tiles(call, input_ids, image_token)
    if call.get("labels") is not None:  # checked on every stage, so that no stage waits for a failed peer
        leaks = leaking_documents(input_ids, params.cu_seqlens_q, params.cu_seqlens_q_padded,
                                  call.get("loss_mask"), image_token_index=image_token)
        if leaks:
            raise ValueError(leak_message(leaks))
    space = LlavaSpace.of(model)
    call["packed_seq_params"] = remap_packed_seq_params(
        params, input_ids, call["num_image_tiles"], img_seq_len=space.img_seq_len, image_token_index=image_token,
        segment_multiple=space.segment_multiple, total_multiple=space.total_multiple,
        pad_to=space.pipeline_length, max_length=space.max_length)


def expand_planned_call(model, call: dict) -> None:
    """`expand_packed_call` for `models.llava.PlannedPackedSeqParams`: every count from the plan's host
    ints (tiles, leaks, expanded lengths), so nothing is read back to the host."""
    from megatron_vlm_packing.models.llava import LlavaSpace, expanded_packed_seq_params
    from megatron_vlm_packing.models.llava_expansion import leak_message

    params = call["packed_seq_params"]
    plan, space = params.llava_plan, LlavaSpace.of(model)
    token = call.get("image_token_index")
    if token is not None and token != plan.space.image_token_index:
        raise ValueError(f"image_token_index={token} but the pack was planned for {plan.space.image_token_index}")
    if plan.space.img_seq_len != space.img_seq_len or plan.space.pipeline_length != space.pipeline_length \
            or plan.space.segment_multiple != space.segment_multiple or plan.space.total_multiple % space.total_multiple:
        raise ValueError(f"the pack was planned for {plan.space}, not this LLaVAModel's {space}")
    if call.get("num_image_tiles") is None:
        call["num_image_tiles"] = torch.tensor(plan.tiles, dtype=torch.int).to(call["input_ids"].device,
                                                                                non_blocking=True)
    leaks = plan.leaking_documents() if call.get("labels") is not None else []
    if leaks:
        raise ValueError(leak_message(leaks))
    call["packed_seq_params"] = expanded_packed_seq_params(plan, params)


def apply_llava_packed_boundaries() -> bool:
    """Remap packed boundaries inside LLaVAModel.forward. Idempotent; returns whether it is active."""
    if upstream_remaps_packed_boundaries():
        return False
    if _OWNED.active():
        return True
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    LLaVAModel = _llava()
    original = LLaVAModel.forward
    signature = signature_naming(original, ("images", "input_ids", "labels", "loss_mask", "num_image_tiles",
                                            "image_token_index", "packed_seq_params"), __name__)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs)
        params = bound.arguments.get("packed_seq_params")
        if params is not None and params.qkv_format == "thd" and self.add_decoder:
            expand_packed_call(self, bound.arguments)
        return original(*bound.args, **bound.kwargs)

    _OWNED.set(LLaVAModel, "forward", forward)
    return True


def undo_llava_packed_boundaries() -> None:
    """Restore LLaVAModel.forward. A no-op when not applied.

    Raises:
        RuntimeError: a later patch wraps LLaVAModel.forward; nothing is restored.
    """
    _OWNED.restore()
