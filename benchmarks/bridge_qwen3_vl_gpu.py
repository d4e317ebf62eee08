"""GPU parity for Megatron-Bridge's Qwen3-VL with Transformer Engine in bf16: packed vs each sample alone.

    python benchmarks/bridge_qwen3_vl_gpu.py --out benchmarks/results/bridge_qwen3_vl_gpu.md
    python benchmarks/bridge_qwen3_vl_gpu.py --device cpu --max-text 24    # CPU smoke (TE-free, fp32)

Needs one CUDA GPU, Transformer Engine and megatron-bridge 0.6.2 (scripts/setup.sh). The model is
Bridge's own `Qwen3VLModel`, built by `Qwen3VLModelProvider.provide()` with Bridge's TE specs
untouched (no name swaps: this is the GPU build), TP = CP = 1, bf16. Samples carry text, images and
videos; the packed micro-batch goes through `Qwen3VLAdapter`, each sample alone through the same
adapter as a pack of one (same TE THD kernel, so the comparison isolates packing). Reports
token_mult_prob_error = exp(mean |logp_packed - logp_alone|) over real target tokens (1.0 =
identical) and the same metric with the whole pack declared one document (the control: packing
done wrong must show). Exit status 1 when the error exceeds --max-error (1.001) or the control
does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch


def build(cfg):
    from megatron_vlm_packing.bridge.build import build_with_provider
    from megatron_vlm_packing.bridge.tiny import qwen3_vl_provider

    provider = qwen3_vl_provider(cfg)
    for name, value in dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=None, use_cpu_initialization=False,
                            init_method_std=0.02).items():
        setattr(provider, name, value)
    return build_with_provider(provider, seed=0).cuda().to(torch.bfloat16).eval()


def per_token_logp(model, adapter, micro_batch) -> torch.Tensor:
    """[real target tokens] log-probabilities of the targets, in pack order."""
    out = adapter.forward(model, micro_batch)
    losses = out[0] if isinstance(out, tuple) else out
    return -losses.float()[micro_batch.loss_mask.bool()]


def one_document(micro_batch):
    """The same pack with its boundaries replaced by one document covering everything."""
    from megatron.core.packed_seq_params import PackedSeqParams

    total = micro_batch.input_ids.shape[-1]
    cu = torch.tensor([0, total], dtype=torch.int32, device=micro_batch.input_ids.device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=total, max_seqlen_kv=total)
    return replace(micro_batch, packed_seq_params=params)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-text", type=int, default=512)
    parser.add_argument("--max-error", type=float, default=1.001)
    parser.add_argument("--out", default=None, help=".md or .json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of this script on the tiny TE-free fp32 build")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_vlm_packing.bridge.adapters import Qwen3VLAdapter
    from megatron_vlm_packing.bridge.parity import micro_batch_of
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl, qwen_vl_samples
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.testing.parity import token_mult_prob_error

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if args.device == "cpu":
        from megatron_vlm_packing.bridge.tiny import build_tiny_bridge_model
        from megatron_vlm_packing.testing.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        cfg = TinyBridgeConfig(family="qwen3_vl")
        model, dtype = build_tiny_bridge_model(cfg, seed=0).eval(), torch.float32
    else:
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        parallel_state.initialize_model_parallel()
        cfg = TinyBridgeConfig(family="qwen3_vl", num_layers=4, hidden_size=1024, num_attention_heads=8,
                               num_query_groups=4, ffn_hidden_size=2816, vocab_size=4096, mrope_section=(24, 20, 20),
                               vision_depth=4, vision_hidden=256, vision_heads=4, patch_size=16,
                               deepstack_visual_indexes=(0, 1, 2))
        model, dtype = build(cfg), torch.bfloat16
    adapter = Qwen3VLAdapter(model)
    layout = ParallelLayout()
    samples = qwen_vl_samples(cfg, args.samples, seed=0, max_text=args.max_text)

    def on_gpu(batch):  # on the chosen device; pixels in the model's dtype
        return {k: (v.to(args.device, dtype) if v.is_floating_point() else v.to(args.device)) for k, v in batch.items()}

    with torch.no_grad():
        packed = micro_batch_of(on_gpu(collate_qwen_vl(samples)), adapter.mrope, layout)
        lp_packed = per_token_logp(model, adapter, packed)
        lp_one_doc = per_token_logp(model, adapter, one_document(packed))
        lp_alone = torch.cat([per_token_logp(model, adapter, micro_batch_of(on_gpu(collate_qwen_vl([s])), adapter.mrope,
                                                                              layout)) for s in samples])
    error = token_mult_prob_error(lp_packed, lp_alone)
    control = token_mult_prob_error(lp_one_doc, lp_alone)
    result = {"model": "megatron.bridge Qwen3VLModel " + ("(TE, bf16, TP=1)" if args.device == "cuda" else "(CPU smoke, fp32)"), "tokens": int(lp_alone.numel()),
              "images": int(sum(len(s["image_grid_thw"]) for s in samples)),
              "videos": int(sum(len(s["video_grid_thw"]) for s in samples)),
              "token_mult_prob_error": error, "one_document_control": control}
    text = json.dumps(result, indent=1) if (args.out or "").endswith(".json") else (
        "| model | tokens | images | videos | token_mult_prob_error packed vs alone | whole pack as one document |\n"
        "|---|---|---|---|---|---|\n"
        f"| {result['model']} | {result['tokens']} | {result['images']} | {result['videos']} | {error:.6f} | {control:.4f} |\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    dist.destroy_process_group()
    return 0 if error <= args.max_error and control > args.max_error else 1


if __name__ == "__main__":
    sys.exit(main())
