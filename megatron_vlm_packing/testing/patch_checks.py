"""Checks of the SP patches on a real GPTModel (TP=2 + SP on CPU), for `run_distributed`."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.patches import gpt_model_forward as patch
from megatron_vlm_packing.testing.distributed import initialize_parallel
from megatron_vlm_packing.testing.parity import variable_batch
from megatron_vlm_packing.testing.parity_cases import load_sharded


def _decoder_inputs(model):
    seen = {}

    def hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen["tokens"] = None if hidden is None else hidden.shape[0]
        mask = kwargs.get("padding_mask")
        seen["padding_mask"] = None if mask is None else tuple(mask.shape)

    return seen, model.decoder.register_forward_pre_hook(hook, with_kwargs=True)


def _loss(model, packed, **kwargs):
    out = model(packed.input_ids, packed.position_ids, None, labels=packed.labels.clamp_min(0),
                packed_seq_params=packed.packed_seq_params, **kwargs)
    return (out * packed.loss_mask).sum().item(), out.shape[-1]


def run_sp_patch_checks(rank: int, world_size: int, seed: int = 9) -> dict:
    from megatron.core import parallel_state as ps

    cfg = TinyGPTConfig()
    batch = variable_batch([7, 3, 12, 5], 12, vocab_size=cfg.vocab_size, seed=seed)
    batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
    packed = pack_batch(batch, tp_size=2, sequence_parallel=True, label_style="hf")
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    reference = build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False)
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_loss, _ = _loss(reference, packed)
    initialize_parallel(tp=2, seed=seed)
    model = build_tiny_gpt(replace(cfg, tensor_parallel=2, sequence_parallel=True),
                           scatter_embedding_sequence_parallel=False)
    load_sharded(model, state, ps.get_tensor_model_parallel_rank(), 2)
    from megatron.core.models.gpt.gpt_model import GPTModel

    original_forward = GPTModel.forward
    seen, hook = _decoder_inputs(model)
    result = dict(total=packed.num_physical_tokens, upstream_has_fix=patch.upstream_scatters_standalone_embeddings())
    try:
        unpatched = _loss(model, packed)
        result["unpatched"] = dict(loss=unpatched[0], output_tokens=unpatched[1], decoder_tokens=seen["tokens"])
    except Exception as err:  # the bug's symptom on old versions may be a shape error
        result["unpatched"] = dict(error=f"{type(err).__name__}: {str(err)[:200]}")
    active = patch.apply_sp_embedding_scatter()
    patch.apply_sp_embedding_scatter()  # idempotent
    loss, tokens = _loss(model, packed)
    result["patched"] = dict(active=active, loss=loss, ref_loss=ref_loss, output_tokens=tokens,
                             decoder_tokens=seen["tokens"])
    # padding_mask with a caller-supplied decoder_input (what a VLM wrapper passes).
    emb = patch.scatter_sequence(model.embedding(input_ids=packed.input_ids, position_ids=None), 0)
    model(None, packed.position_ids, None, decoder_input=emb, labels=packed.labels.clamp_min(0),
          packed_seq_params=packed.packed_seq_params, padding_mask=packed.padding_mask)
    result["mask_unpatched"] = seen["padding_mask"]
    patch.apply_sp_padding_mask_scatter()
    model(None, packed.position_ids, None, decoder_input=emb, labels=packed.labels.clamp_min(0),
          packed_seq_params=packed.packed_seq_params, padding_mask=packed.padding_mask)
    result["mask_patched"] = seen["padding_mask"]
    local_mask = patch.scatter_sequence(packed.padding_mask, 1)  # already local: must not scatter twice
    model(None, packed.position_ids, None, decoder_input=emb, labels=packed.labels.clamp_min(0),
          packed_seq_params=packed.packed_seq_params, padding_mask=local_mask)
    result["mask_already_local"] = seen["padding_mask"]
    hook.remove()
    patched_forward = GPTModel.forward
    patch.undo_sp_padding_mask_scatter()
    patch.undo_sp_embedding_scatter()
    result["was_wrapped"] = patched_forward is not original_forward
    result["restored"] = GPTModel.forward is original_forward
    result["decoder_local_tokens_expected"] = packed.num_physical_tokens // 2
    dist.barrier()
    return result


def _step_outcome(step, model, batch: dict) -> dict:
    """The shipped step's loss sum and token count on `batch`, or the exception it raised (type: message)."""
    try:
        output, loss_func = step(iter([dict(batch)]), model)
        loss_sum, num_tokens, _ = loss_func(output)
        return dict(loss=float(loss_sum), tokens=int(num_tokens))
    except Exception as err:  # the outcome is the point: a refusal, or the bug's shape error
        return dict(error=f"{type(err).__name__}: {err}")


def run_standalone_sp_step_checks(rank: int, world_size: int, seed: int = 13) -> dict:
    """The shipped `make_forward_step` on a GPTModel built with `scatter_embedding_sequence_parallel=False` (as
    a VLM's language model is) and called standalone at TP=2 + SP (bug class 3). One step (so one adapter,
    built at its first call) runs with the embedding-scatter patch off, on, and off again; also the TP=1
    step's loss on the same weights, the truth. Where megatron-core lacks the fix the patch is needed: off,
    the step must refuse (not crash inside attention, or train every rank on the whole sequence)."""
    from megatron.core import parallel_state as ps

    from megatron_vlm_packing.step import make_forward_step

    cfg = TinyGPTConfig()
    batch = variable_batch([7, 3, 12, 5], 12, vocab_size=cfg.vocab_size, seed=seed)
    patch.undo_sp_embedding_scatter()
    initialize_parallel(seed=seed)
    torch.manual_seed(seed)
    reference = build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False)
    state = {n: p.detach().clone() for n, p in reference.named_parameters()}
    result = dict(upstream_has_fix=patch.upstream_scatters_standalone_embeddings(),
                  reference=_step_outcome(make_forward_step(), reference, batch))
    initialize_parallel(tp=2, seed=seed)
    model = build_tiny_gpt(replace(cfg, tensor_parallel=2, sequence_parallel=True),
                           scatter_embedding_sequence_parallel=False)
    load_sharded(model, state, ps.get_tensor_model_parallel_rank(), 2)
    step = make_forward_step()
    result["unpatched"] = _step_outcome(step, model, batch)
    patch.apply_sp_embedding_scatter()
    try:
        result["patched"] = _step_outcome(step, model, batch)
    finally:
        patch.undo_sp_embedding_scatter()
    result["undone_after_the_adapter_was_built"] = _step_outcome(step, model, batch)
    dist.barrier()
    return result
