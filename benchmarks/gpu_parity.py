"""GPU parity: packed THD GPTModel vs each sample alone, per core-attention backend, in bf16.

    python benchmarks/gpu_parity.py --out benchmarks/results/gpu_parity.md     # or .json
    python benchmarks/gpu_parity.py --device cpu --dtype float32 --median-length 12 --out /tmp/p.json  # CPU smoke

For every backend that runs here (reference, torch varlen, Megatron-Core's TE spec), packs
lognormal-length samples (a length-1 sample included) with `pack_batch` at CP alignment (so real
and padded boundaries differ), and reports token_mult_prob_error = exp(mean |logp_packed -
logp_alone|) over real tokens (1.0 = identical), plus the same metric when the whole pack is
declared one document (what the metric looks like when packing is wrong).
Exit status 1 when a backend that ran exceeds `--max-error` (default 1.001), or when the
one-document control does not (the metric would then be blind).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch


def per_token_logp(model, ids, pos, labels, params=None):
    return -model(ids, pos, None, labels=labels, packed_seq_params=params).float()


def run_backend(backend: str, lengths, vocab: int, seed: int, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.parity import token_mult_prob_error

    cfg = TinyGPTConfig(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                        ffn_hidden_size=2048, vocab_size=vocab, max_sequence_length=4096, backend=backend,
                        params_dtype=dtype)
    torch.manual_seed(seed)
    model = build_tiny_gpt(cfg).to(device=device, dtype=dtype).eval()  # torch norms ignore params_dtype
    seq = max(lengths)
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(1, vocab, (len(lengths), seq), generator=g), 0).to(device)
    keep = keep.to(device)
    batch = {"input_ids": ids, "labels": torch.where(keep, ids, -100), "attention_mask": keep.long()}
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
        one_doc = torch.tensor([0, total], dtype=torch.int32, device=device)
        wrong = replace(packed.packed_seq_params, cu_seqlens_q=one_doc, cu_seqlens_kv=one_doc,
                        cu_seqlens_q_padded=one_doc, cu_seqlens_kv_padded=one_doc, max_seqlen_q=total,
                        max_seqlen_kv=total)
        positions = torch.arange(total, device=device)[None]
        lp_wrong = per_token_logp(model, packed.input_ids, positions, packed.labels.clamp_min(0), wrong)[0][real]
    return token_mult_prob_error(lp_packed, lp_alone), token_mult_prob_error(lp_wrong, lp_alone)


def write_result(path: str, header: str, rows: list[dict]) -> None:
    """Markdown (a table) or JSON (when `path` ends in .json)."""
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump({"setup": header, "results": rows}, f, indent=2)
        return
    lines = [header, "", "| backend | token_mult_prob_error packed vs alone | same, whole pack as one document |",
             "|---|---|---|"]
    for r in rows:
        if r["packed_vs_alone"] is None:
            lines.append(f"| {r['backend']} | not run: {r['skipped']} | |")
        else:
            lines.append(f"| {r['backend']} | {r['packed_vs_alone']:.6f} | {r['one_document']:.4f} |")
    with open(path, "w") as f:
        f.write("# GPU parity: packed THD vs each sample alone\n\n`python benchmarks/gpu_parity.py`\n\n"
                + "\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="result file: markdown, or JSON when it ends in .json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--median-length", type=float, default=245.0, help="median of the lognormal lengths")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="bf16 on GPU; float32 for a CPU smoke run (CPU bf16 GEMMs round differently per row count)")
    parser.add_argument("--max-error", type=float, default=1.001)
    args = parser.parse_args()
    from megatron_vlm_packing.attention import resolve_backend
    from megatron_vlm_packing.demo.main import setup_distributed

    setup_distributed(args.device, 1, 1, args.seed)
    torch.manual_seed(args.seed)
    lengths = torch.exp(torch.randn(10) * 0.8 + torch.log(torch.tensor(args.median_length))).clamp(2, 2048)
    lengths = lengths.long().tolist()
    lengths[0] = 1
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    header = (f"{name}, torch {torch.__version__}, {args.dtype}, 4 layers, hidden 512, GQA 8/4, lengths {lengths}, "
              f"pass: packed <= {args.max_error} < one document")
    rows, failed = [], False
    for backend in ("reference", "torch", "te"):
        try:
            resolve_backend(backend)
        except ValueError as err:
            rows.append(dict(backend=backend, packed_vs_alone=None, one_document=None, skipped=str(err)))
            continue
        ok, wrong = run_backend(backend, lengths, 32000, args.seed, args.device, getattr(torch, args.dtype))
        passed = ok <= args.max_error < wrong
        failed |= not passed
        rows.append(dict(backend=backend, packed_vs_alone=ok, one_document=wrong, passed=passed))
        print(f"{backend}: packed vs alone {ok:.6f}, whole pack as one document {wrong:.4f}, "
              f"{'pass' if passed else 'FAIL'}")
    if args.out:
        write_result(args.out, header, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
