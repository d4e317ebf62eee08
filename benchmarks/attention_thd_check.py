"""GPU check: THD attention on a `pack_batch` plan equals each sample alone (TE and torch varlen).

    python benchmarks/attention_thd_check.py --out benchmarks/results/attention_thd_check.md

For random lognormal lengths packed with `pack_batch` (cp_size=2 alignment so real != padded
boundaries), runs TransformerEngine's `DotProductAttention` (qkv_format="thd", both boundary sets)
and torch's `varlen_attn` (given the padded boundaries: real tokens sit at the start of each
physical document, so causal attention from a real token only sees real tokens of its own
document) in bf16, and compares the real tokens with float32 causal attention of each sample alone.
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F

from megatron_vlm_packing import pack_batch


def reference(q, k, v, cu_real, cu_padded):
    """Float32 causal attention of every sample alone, at the sample's real slots. [T, H, D]."""
    out = torch.zeros_like(q, dtype=torch.float32)
    for i in range(len(cu_real) - 1):
        start, n = cu_padded[i], cu_real[i + 1] - cu_real[i]
        sl = slice(start, start + n)
        qs, ks, vs = (x[sl].float().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        out[sl] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def real_slots(cu_real, cu_padded, total):
    keep = torch.zeros(total, dtype=torch.bool)
    for i in range(len(cu_real) - 1):
        keep[cu_padded[i]: cu_padded[i] + cu_real[i + 1] - cu_real[i]] = True
    return keep


def run_te(q, k, v, params):
    import transformer_engine.pytorch as te

    heads, dim = q.shape[1], q.shape[2]
    attn = te.DotProductAttention(heads, dim, qkv_format="thd", attn_mask_type="padding_causal").cuda()
    out = attn(q, k, v, cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv,
               cu_seqlens_q_padded=params.cu_seqlens_q_padded, cu_seqlens_kv_padded=params.cu_seqlens_kv_padded,
               max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=params.max_seqlen_kv)
    return out.view(q.shape)


def run_varlen(q, k, v, params):
    from torch.nn.attention.varlen import varlen_attn

    cu = params.cu_seqlens_q_padded
    out = varlen_attn(q, k, v, cu, cu, params.max_seqlen_q, params.max_seqlen_kv, window_size=(-1, 0))
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    lengths = torch.distributions.LogNormal(torch.log(torch.tensor(600.0)), 0.9).sample((12,)).clamp(1, 4096).long()
    lengths[0] = 1  # a length-1 sample
    seq = 4096
    keep = torch.arange(seq)[None] < lengths[:, None]
    ids = torch.ones(len(lengths), seq, dtype=torch.long)
    packed = pack_batch({"input_ids": ids, "labels": ids, "attention_mask": keep.long()}, cp_size=2, label_style="hf")
    params = packed.packed_seq_params
    params.cu_seqlens_q, params.cu_seqlens_kv = params.cu_seqlens_q.cuda(), params.cu_seqlens_kv.cuda()
    params.cu_seqlens_q_padded = params.cu_seqlens_q_padded.cuda()
    params.cu_seqlens_kv_padded = params.cu_seqlens_kv_padded.cuda()
    total = packed.num_physical_tokens
    q, k, v = (torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_real, cu_padded = packed.plan.cu_seqlens().tolist(), packed.plan.cu_seqlens_padded().tolist()
    ref = reference(q, k, v, cu_real, cu_padded)
    mask = real_slots(cu_real, cu_padded, total).cuda()
    lines = [f"lengths {lengths.tolist()}; T = {total} physical slots, {packed.num_real_tokens} real",
             f"torch {torch.__version__}", "", "| backend | max abs err vs fp32 per-sample (real tokens) | mean abs err | NaN in pad slots |",
             "|---|---|---|---|"]
    for name, fn in (("te DotProductAttention thd", run_te), ("torch varlen_attn", run_varlen)):
        try:
            out = fn(q, k, v, params).float()
        except Exception as err:  # report, do not hide: the table says which backend could not run
            lines.append(f"| {name} | failed: {type(err).__name__}: {str(err)[:120]} | | |")
            continue
        diff = (out[mask] - ref[mask]).abs()
        lines.append(f"| {name} | {diff.max().item():.2e} | {diff.mean().item():.2e} | {bool(out[~mask].isnan().any())} |")
    try:
        from torch.nn.attention.varlen import varlen_attn
        lines += ["", f"varlen_attn signature: `{inspect.signature(varlen_attn)}`"]
    except ImportError:
        pass
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# THD attention on a pack_batch plan vs each sample alone (GPU)\n\n" + text + "\n")


if __name__ == "__main__":
    main()
