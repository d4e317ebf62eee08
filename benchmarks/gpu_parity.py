"""GPU parity: packed THD GPTModel vs each sample alone, per core-attention backend, in bf16.

    python benchmarks/gpu_parity.py --out benchmarks/results/gpu_parity.md

For every backend that runs here (reference, torch varlen, Megatron-Core's TE spec), packs
lognormal-length samples (a length-1 sample included) with `pack_batch` at CP alignment (so real
and padded boundaries differ), and reports token_mult_prob_error = exp(mean |logp_packed -
logp_alone|) over real tokens (1.0 = identical), plus the same metric when the whole pack is
declared one document (what the metric looks like when packing is wrong).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch


def per_token_logp(model, ids, pos, labels, params=None):
    return -model(ids, pos, None, labels=labels, packed_seq_params=params).float()


def run_backend(backend: str, lengths, vocab: int, seed: int) -> tuple[float, float]:
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.parity import token_mult_prob_error

    cfg = TinyGPTConfig(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                        ffn_hidden_size=2048, vocab_size=vocab, max_sequence_length=4096, backend=backend,
                        params_dtype=torch.bfloat16)
    torch.manual_seed(seed)
    model = build_tiny_gpt(cfg).cuda().to(torch.bfloat16).eval()  # torch norms ignore params_dtype
    seq = max(lengths)
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(1, vocab, (len(lengths), seq), generator=g), 0).cuda()
    batch = {"input_ids": ids, "labels": torch.where(keep.cuda(), ids, -100), "attention_mask": keep.long().cuda()}
    packed = pack_batch(batch, cp_size=2, label_style="hf")
    real = ~packed.padding_mask[0] & packed.loss_mask[0].bool()
    with torch.no_grad():
        lp_packed = per_token_logp(model, packed.input_ids, packed.position_ids, packed.labels.clamp_min(0),
                                   packed.packed_seq_params)[0][real]
        alone = []
        for row, n in enumerate(lengths):
            if n < 2:
                continue  # a length-1 sample has no target
            # Each sample alone, unpadded, through the same attention kernel (THD with one document):
            # the comparison isolates packing from kernel-to-kernel bf16 differences.
            x = ids[row:row + 1, :n]
            one = pack_batch({"input_ids": x, "labels": x}, label_style="hf")
            alone.append(per_token_logp(model, one.input_ids, one.position_ids, one.labels.clamp_min(0),
                                        one.packed_seq_params)[0, :-1])
        lp_alone = torch.cat(alone)
        total = packed.num_physical_tokens
        one_doc = torch.tensor([0, total], dtype=torch.int32, device="cuda")
        wrong = replace(packed.packed_seq_params, cu_seqlens_q=one_doc, cu_seqlens_kv=one_doc,
                        cu_seqlens_q_padded=one_doc, cu_seqlens_kv_padded=one_doc, max_seqlen_q=total,
                        max_seqlen_kv=total)
        positions = torch.arange(total, device="cuda")[None]
        lp_wrong = per_token_logp(model, packed.input_ids, positions, packed.labels.clamp_min(0), wrong)[0][real]
    return token_mult_prob_error(lp_packed, lp_alone), token_mult_prob_error(lp_wrong, lp_alone)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from megatron_vlm_packing.attention import resolve_backend
    from megatron_vlm_packing.demo import setup_distributed

    setup_distributed("cuda", 1, 1, args.seed)
    torch.manual_seed(args.seed)
    lengths = torch.exp(torch.randn(10) * 0.8 + 5.5).clamp(2, 2048).long().tolist()
    lengths[0] = 1
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 4 layers, hidden 512, GQA 8/4, "
             f"lengths {lengths}", "",
             "| backend | token_mult_prob_error packed vs alone | same, whole pack as one document |", "|---|---|---|"]
    for backend in ("reference", "torch", "te"):
        try:
            resolve_backend(backend)
        except ValueError as err:
            lines.append(f"| {backend} | not run: {err} | |")
            continue
        ok, wrong = run_backend(backend, lengths, 32000, args.seed)
        lines.append(f"| {backend} | {ok:.6f} | {wrong:.4f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# GPU parity: packed THD vs each sample alone\n\n`python benchmarks/gpu_parity.py`\n\n" + text + "\n")


if __name__ == "__main__":
    main()
