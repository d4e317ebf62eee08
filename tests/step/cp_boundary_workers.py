"""`run_distributed` target for tests/step/test_copied_boundaries_cp.py (module-level so spawn can pickle it)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.runtime import initialize_parallel
from megatron_vlm_packing.testing.parity import variable_batch
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from megatron_vlm_packing.train.step import make_forward_step


def copied_boundaries(micro_batch):
    """The packer's boundaries as equal copies in a new PackedSeqParams, and a copied rope_cu_seqlens."""
    params = micro_batch.packed_seq_params
    real, padded = params.cu_seqlens_q.clone(), params.cu_seqlens_q_padded.clone()
    copies = dataclasses.replace(params, cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                                 cu_seqlens_kv_padded=padded)
    return dataclasses.replace(micro_batch, packed_seq_params=copies,
                               rope_cu_seqlens=micro_batch.rope_cu_seqlens.clone())


def run_copied_boundaries(rank: int, world_size: int, cp: int) -> dict:
    """{"packers" / "copies": (host syncs of one forward + backward through the step, loss)} for a tiny GPTModel at
    context parallel `cp`, fed a DataLoader-packed micro-batch as it is or with its boundaries copied. The core
    attention (the CPU reference, standing in for TE's) is left out of the count."""
    from megatron_vlm_packing.patches.thd_rotary import apply_thd_rotary

    apply_thd_rotary()  # Megatron-Core's THD rotary reads the boundaries per layer without it (bug class 14)
    initialize_parallel(cp=cp, seed=0)
    torch.manual_seed(0)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=128, context_parallel=cp))
    core = [layer.self_attention.core_attention for layer in model.decoder.layers]
    item = PackingCollator(cp_size=cp, label_style="hf")(variable_batch([13, 5, 21, 9], 21, vocab_size=120, seed=1))
    result = {}
    for name, transform in (("packers", None), ("copies", copied_boundaries)):
        step = make_forward_step(label_style="hf", transform=transform)
        for _ in range(2):  # the first call warms adapters and patches up
            model.zero_grad(set_to_none=True)
            with count_host_syncs(exclude=core) as syncs:
                output, loss_fn = step(iter([item]), model)
                loss = loss_fn(output)[0]
                loss.backward()
        result[name] = (syncs.total, syncs.report(), float(loss))
    return result
