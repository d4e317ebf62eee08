"""Two processes: the tiny LLaVA fed the same samples in Megatron-LM's examples/multimodal batch format
(tests/llava/mlm_batches.py: right-padded rows, padded to a dataloader_seq_length, its own pack with the
expanded cu_lengths, that pack with FP8 pads) and in the usual one (Hugging Face labels), through the shipped
step and `get_forward_backward_func`, against LLaVA's own batched run of the usual batches. Micro-batches: the
parity suite's two (tiles [1, 2, 1, 3, 1], images at starts, back-to-back and last) and a text-only one. The
single-process runs are made on each rank alike; then under TP=2 + SP, Megatron-LM's pack read by TP rank 0
only and broadcast (`broadcast_from_tp_rank0=True`: its `dataloader_provider` builds the loader there only, the
other rank's iterator is None); and under CP=2.

`launch()` runs it once per test session."""

from __future__ import annotations

import functools

import torch

from megatron_vlm_packing.testing.distributed import run_distributed


@functools.cache
def launch() -> dict:
    return run_distributed(run_mlm_checks, 2, timeout_s=900)


def _forms(data: list[dict], img_seq_len: int) -> dict:
    """Each Megatron-LM form of the usual micro-batches `data`, and the step's pack option for it."""
    from tests.llava.mlm_batches import mlm_pack, mlm_rows

    def width(batch):  # collapsed slots of all its samples
        return int(batch["attention_mask"].sum())

    return {
        "rows": ([mlm_rows(b) for b in data], True),
        "rows, dataloader_seq_length": ([mlm_rows(b, width=24) for b in data], True),
        "pack": ([mlm_pack(b, img_seq_len, width=width(b) + 5) for b in data], True),
        "pack, fp8 pads": ([mlm_pack(b, img_seq_len, width=width(b), fp8_pad=3) for b in data], True),
        "rows, pack=False": ([mlm_rows(b) for b in data], False),
        "pack, pack=False": ([mlm_pack(b, img_seq_len, width=width(b) + 5) for b in data], False),
    }


def _identical(run: tuple, usual: tuple) -> bool:
    """Per-token logprobs and every gradient bit for bit the same."""
    logps, grads, _ = run
    ref_logps, ref_grads, _ = usual
    return len(logps) == len(ref_logps) and all(torch.equal(a, b) for a, b in zip(logps, ref_logps)) \
        and grads.keys() == ref_grads.keys() and all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def _tp_sp_broadcast(ref_model, ref: tuple, mlm: list[dict], seed: int) -> dict:
    """The TP=2 + SP model (the reference's weights) on `mlm` through the step, TP rank 0 reading and broadcasting."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.llava_reference import MAX_LENGTH, build_tiny_llava, llava_cp_without_te
    from megatron_vlm_packing.testing.parity import full_gradients, global_name, load_full_state
    from megatron_vlm_packing.train.step import make_forward_step
    from tests.llava.llava_workers import compared
    from tests.llava.mlm_batches import PAD

    state = {global_name(ref_model, n): p.detach().clone() for n, p in ref_model.named_parameters()}
    initialize_parallel(tp=2, seed=seed)
    with llava_cp_without_te():
        model = build_tiny_llava(seed, tp=2, sp=True)
        load_full_state(model, state, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=2)
        step = make_forward_step(label_style="megatron", megatron_lm_pad_id=PAD, broadcast_from_tp_rank0=True)
        outputs = []

        def forward_step(data_iterator, model):
            out, loss = step(data_iterator, model)
            outputs.append((out[0].detach(), out[1].detach()))
            return out, loss

        reader = iter(mlm) if ps.get_tensor_model_parallel_rank() == 0 else None
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=reader, model=[model],
                                    num_microbatches=len(mlm), seq_length=MAX_LENGTH, micro_batch_size=1)
    logps = [-losses[mask.bool()] for losses, mask in outputs]
    grads = full_gradients(model, tp_group=ps.get_tensor_model_parallel_group())
    return compared(ref, (logps, grads, [tuple(mask.shape) for _, mask in outputs]))


def _cp(ref_model, ref: tuple, mlm: list[dict], seed: int) -> dict:
    """The CP=2 model (the reference's weights) on `mlm` through the step: LLaVA's CP tokens gathered back."""
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.llava_parity import compare, load_state, packed_run
    from megatron_vlm_packing.testing.llava_reference import build_tiny_llava, llava_cp_without_te
    from tests.llava.mlm_batches import PAD

    state = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    initialize_parallel(cp=2, seed=seed)
    with llava_cp_without_te():
        model = build_tiny_llava(seed, cp=2)
        load_state(model, state)
        return compare(ref[1], ref[2], *packed_run(model, mlm, "megatron", megatron_lm_pad_id=PAD))


def run_mlm_checks(rank: int, world_size: int, seed: int = 11) -> dict:
    from megatron_vlm_packing.models.llava import LlavaSpace
    from megatron_vlm_packing.patches import (
        apply_llava_packed_boundaries, apply_thd_rotary, undo_llava_packed_boundaries, undo_thd_rotary,
    )
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.testing.llava_reference import T, batches, build_tiny_llava, collated, reference
    from tests.llava.llava_workers import compared, step_run
    from tests.llava.mlm_batches import PAD

    apply_llava_packed_boundaries(), apply_thd_rotary()
    try:
        initialize_parallel(seed=seed)
        model = build_tiny_llava(seed)
        data = batches("hf", seed) + [collated(((T, T, T), (T, T, T, T, T), (T,)), label_style="hf", seed=seed + 7)]
        ref = (data, *reference(model, data, "hf"))
        result = {"params": len(list(model.parameters()))}
        usual = step_run(model, data, "hf")
        result["usual"] = compared(ref, usual)
        img = LlavaSpace.of(model).img_seq_len
        for name, (mlm, pack) in _forms(data, img).items():
            run = step_run(model, mlm, "megatron", pack=pack, megatron_lm_pad_id=PAD)
            result[name] = dict(compared(ref, run), identical_to_usual=_identical(run, usual))
        # control: get_batch's output (its shift made: labels[:, 1:S + 1]) handed to the step under label_style='hf'
        # would be shifted twice, every token trained on the token after its target: the packers' label-style
        # check refuses it (packing/label_style.py)
        shifted = [{"input_ids": b["tokens"], "labels": b["labels"][:, 1:], "attention_mask": u["attention_mask"],
                    "images": u["images"], "num_image_tiles": u["num_image_tiles"]}
                   for b, u in zip(_forms(data, 1)["rows"][0], data)]
        try:
            step_run(model, shifted, "hf")
            result["control: shifted twice"] = "accepted"
        except ValueError as err:
            result["control: shifted twice"] = str(err)
        pack = _forms(data, img)["pack"][0]
        result["TP=2+SP, pack, broadcast from TP rank 0"] = _tp_sp_broadcast(model, ref, pack, seed)
        result["CP=2, pack"] = _cp(model, ref, pack, seed)
    finally:
        undo_thd_rotary()
        undo_llava_packed_boundaries()
    return result
