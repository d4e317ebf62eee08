"""GPU parity for Megatron-Bridge's Qwen3-VL with Transformer Engine in bf16: packed vs each sample alone.

    python benchmarks/bridge_qwen3_vl_gpu.py --out benchmarks/results/bridge_qwen3_vl_gpu.md
    python benchmarks/bridge_qwen3_vl_gpu.py --isolate --out benchmarks/results/bridge_qwen3_vl_isolate_gpu.md  # + .json
    python benchmarks/bridge_qwen3_vl_gpu.py --device cpu --max-text 24    # CPU smoke (TE-free, fp32)
    python benchmarks/bridge_qwen3_vl_gpu.py --device cpu --dtype bf16 --isolate   # CPU bf16 (not the GPU's kernels)

Needs one CUDA GPU, Transformer Engine and megatron-bridge 0.6.2 (scripts/setup.sh). The model is
Bridge's own `Qwen3VLModel`, built by `Qwen3VLModelProvider.provide()` with Bridge's TE specs
untouched (no name swaps: this is the GPU build), TP = CP = 1, bf16. Samples carry text, images and
videos; the packed micro-batch goes through `Qwen3VLAdapter`, each sample alone through the same
adapter as a pack of one (same TE THD kernel, so the comparison isolates packing). Reports
token_mult_prob_error = exp(mean |logp_packed - logp_alone|) over real target tokens (1.0 =
identical) and the same metric with the whole pack declared one document (the control: packing
done wrong must show). Exit status 1 when the error exceeds --max-error (1.001) or the control
does not.

--isolate: where packed and alone first differ. Forward hooks on Bridge's own modules record each
stage: mRoPE positions, the rotary table and its cos/sin; the vision tower's patch embedding, layers
and merger (each per sub-module), its output per image / video and its deepstack levels; the
language model's decoder input and layers (each per sub-module; the table shows layer 0's and the
first differing layer's sub-modules, the JSON all). Packed is compared with the samples alone, token
rows per sample, in four setups: as is; each sample alone fed the pack's vision-tower output (the
language model with vision held fixed); the vision tower run one image / video at a time in both
arms; the one-document control. Every hook must fire once per forward (per tower call for the
vision modules), else it raises. Exit status 0 once the table is written (a diagnosis, not a gate).
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

# --- --isolate: per stage, where packed and alone first differ -------------------------------------------------

SETUPS = ("as is", "alone fed packed vision", "vision one item at a time", "control: pack as one document")


LAYER_DETAIL = ("input_layernorm", "self_attention.linear_qkv", "self_attention.q_layernorm",
                "self_attention.k_layernorm", "self_attention.core_attention", "self_attention.linear_proj",
                "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")
MERGER_DETAIL = ("patch_norm", "linear_fc1", "linear_fc2")


def detail_modules(prefix: str, module, names) -> dict:
    """{prefix.name: submodule} for the `names` that `module` has (a missing or None one is skipped)."""
    out = {}
    for name in names:
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            continue
        if sub is not None:
            out[f"{prefix}.{name}"] = sub
    return out


def layer_modules(prefix: str, layers) -> dict:
    """{prefix.layerI: layer}, each after its sub-modules (LAYER_DETAIL), in call order."""
    out = {}
    for i, layer in enumerate(layers):
        out.update(detail_modules(f"{prefix}.layer{i}", layer, LAYER_DETAIL))
        out[f"{prefix}.layer{i}"] = layer
    return out


class Probe:
    """Forward hooks on Bridge's own modules recording, for one forward, each stage's output rows
    (token or patch rows first): the vision tower's patch embedding, layers, merger, output and deepstack
    levels; the language model's rotary table, decoder input and layers. `substitute` (a list of
    (embeds, [deepstack]) per vision-tower call) replaces what the vision tower hands the language model.
    `fired` counts every hook call; `check` raises when a forward's counts are not the expected ones.
    """

    def __init__(self, model):
        vision, lm = model.vision_model, model.language_model
        self.vision, self.records, self.substitute, self.fired, self.miscounted = vision, {}, None, {}, set()
        self.row_modules = {"vision.patch_embed": vision.patch_embed,
                            **layer_modules("vision", vision.decoder.layers),
                            **detail_modules("vision.merger", vision.merger, MERGER_DETAIL), "vision.merger": vision.merger,
                            "lm.rotary": lm.rotary_pos_emb, **layer_modules("lm", lm.decoder.layers)}
        self.handles = [m.register_forward_hook(self._rows(name)) for name, m in self.row_modules.items()]
        self.handles.append(vision.register_forward_hook(self._tower, with_kwargs=True))
        self.handles.append(lm.decoder.register_forward_pre_hook(self._decoder_input, with_kwargs=True))

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        self.records.setdefault(name, []).append(tensor.detach().clone())
        self.fired[name] = self.fired.get(name, 0) + 1

    def _rows(self, name):
        def hook(module, args, output):
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(tensor, torch.Tensor):  # else not counted: `check` drops or refuses the stage
                self._add(name, tensor)
        return hook

    def _tower(self, module, args, kwargs, output):
        if self.substitute is not None:
            output = self.substitute.pop(0)
        self._add("vision.grid", kwargs["grid_thw"])
        self._add("vision.embeds", output[0])
        for level, embeds in enumerate(output[1]):
            self._add(f"vision.deepstack{level}", embeds)
        return output

    def _decoder_input(self, module, args, kwargs):
        self._add("lm.decoder_input", kwargs["hidden_states"])

    def forward(self, model, adapter, micro_batch) -> tuple[torch.Tensor, dict]:
        """(per-token logp, {stage: rows concatenated over this forward's calls}) of one forward."""
        self.records, before = {}, dict(self.fired)
        logp = per_token_logp(model, adapter, micro_batch)
        self.check(micro_batch, before)
        out = {}
        for name, tensors in self.records.items():
            try:
                out[name] = torch.cat(tensors)
            except RuntimeError:  # a detail module called with different shapes (see check)
                self.miscounted.add(name)
        return logp, out

    def check(self, micro_batch, before: dict) -> None:
        """Raise unless every hook fired as often as this forward must make it (a silent hook would
        make the isolation compare nothing)."""
        vision = micro_batch.vision
        items = sum(len(g) for g in (vision.image_grid_thw, vision.video_grid_thw) if g is not None) if vision else 0
        tower_calls = int(items > 0)
        inner = items if "forward" in self.vision.__dict__ else tower_calls
        expect = {name: (inner if name.startswith("vision.") else 1) for name in self.row_modules}
        expect.update({"vision.grid": tower_calls, "vision.embeds": tower_calls, "lm.decoder_input": 1})
        got = {name: self.fired.get(name, 0) - before.get(name, 0) for name in expect}
        detail = {name for name in expect if name.count(".") > 1}  # a fused kernel (TE) may skip or repeat these
        self.miscounted |= {name for name in detail if got[name] != expect[name]}
        if any(got[name] != expect[name] for name in expect if name not in detail):
            raise RuntimeError(f"isolate: hooks fired {got}, expected {expect}")

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def per_item_vision(vision):
    """Make `vision` (Bridge's `Qwen3VLVisionModel`) run each image / video (grid row) as its own call;
    the instance attribute is removed by `del vision.forward`."""
    original = vision.forward

    def forward(hidden_states, grid_thw, **kwargs):
        outs = [original(hidden_states=x, grid_thw=g[None], **kwargs)
                for x, g in zip(hidden_states.split(grid_thw.prod(-1).tolist()), grid_thw)]
        return torch.cat([o[0] for o in outs]), [torch.cat(level) for level in zip(*(o[1] for o in outs))]

    vision.forward = forward


def token_spans(micro_batch) -> list[tuple[int, int]]:
    """[(start, length)] of each sample's real tokens in the pack."""
    params = micro_batch.packed_seq_params
    cu = params.cu_seqlens_q.tolist()
    starts = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q).tolist()
    return [(starts[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    """(max |a - b|, bitwise equal); inf when the shapes differ."""
    if a.shape != b.shape:
        return float("inf"), False
    return ((a.double() - b.double()).abs().max().item() if a.numel() else 0.0), bool(torch.equal(a, b))


def compare(packed: dict, packed_spans, alones: list[dict], alone_spans) -> dict:
    """{stage: (max |diff|, bitwise)} packed vs alone: language-model stages on each sample's token
    rows, vision stages on the pack's rows vs the samples' rows concatenated (the pack's images and
    videos are the samples' in order)."""
    out = {}
    for name, rows in packed.items():
        if name.startswith("lm.") or name == "positions":
            out[name] = difference(*packed_rows(name, packed, packed_spans, alones, alone_spans))
        else:
            out[name] = difference(rows, torch.cat([alone[name] for alone in alones if name in alone]))
    rotary, dtype = packed_rows("lm.rotary", packed, packed_spans, alones, alone_spans), packed["lm.decoder_input"].dtype
    out["lm.rotary cos/sin"] = max(difference(f(rotary[0]).to(dtype), f(rotary[1]).to(dtype)) for f in (torch.cos, torch.sin))
    return out


def packed_rows(name, packed, packed_spans, alones, alone_spans) -> tuple[torch.Tensor, torch.Tensor]:
    """(pack's real-token rows of `name`, the samples' rows concatenated); rows are dim 0, or the last
    dim for "positions" ([3, 1, T])."""
    def rows(t, s, n):
        return t[..., s:s + n] if name == "positions" else t[s:s + n]

    return (torch.cat([rows(packed[name], s, n) for s, n in packed_spans], dim=-1 if name == "positions" else 0),
            torch.cat([rows(alone[name], s, n) for alone, ((s, n),) in zip(alones, alone_spans)],
                      dim=-1 if name == "positions" else 0))


def items_equal(packed: dict, alones: list[dict], merge: int) -> dict:
    """{vision output stage: (items bitwise equal, items)} per image / video (grid row)."""
    if "vision.grid" not in packed:
        return {}
    sizes = (packed["vision.grid"].prod(-1) // merge ** 2).tolist()
    out = {}
    for name in [k for k in packed if k == "vision.embeds" or k.startswith("vision.deepstack")]:
        pairs = zip(packed[name].split(sizes), torch.cat([a[name] for a in alones if name in a]).split(sizes))
        out[name] = (sum(bool(torch.equal(p, q)) for p, q in pairs), len(sizes))
    return out


def vision_rows(micro_batch, merge: int) -> int:
    """Vision-tower output rows (merged tokens) of a micro-batch's images and videos."""
    vision = micro_batch.vision
    grids = [g for g in (vision.image_grid_thw, vision.video_grid_thw) if g is not None] if vision else []
    return int(sum((g.prod(-1) // merge ** 2).sum() for g in grids))


def fed_packed_vision(probe, model, adapter, packed_records, alone_batches, merge) -> list:
    """Each sample alone, its vision tower's output replaced by the pack's rows for its images / videos."""
    names = ["vision.embeds"] + [k for k in packed_records if k.startswith("vision.deepstack")]  # level order
    start, out = 0, []
    for mb in alone_batches:
        n = vision_rows(mb, merge)
        rows = [packed_records[k][start:start + n] for k in names] if n else None
        probe.substitute = [(rows[0], rows[1:])] if n else None
        out.append(probe.forward(model, adapter, mb))
        if probe.substitute:
            raise RuntimeError("isolate: the vision tower did not take the substituted embeddings")
        start, probe.substitute = start + n, None
    return out


def run_setups(probe, model, adapter, packed_mb, alone_batches, merge) -> dict:
    """{setup: (packed (logp, records), [alone (logp, records)])} for every setup of SETUPS."""
    as_is = probe.forward(model, adapter, packed_mb), [probe.forward(model, adapter, mb) for mb in alone_batches]
    fed = as_is[0], fed_packed_vision(probe, model, adapter, as_is[0][1], alone_batches, merge)
    per_item_vision(model.vision_model)
    try:
        per_item = (probe.forward(model, adapter, packed_mb),
                    [probe.forward(model, adapter, mb) for mb in alone_batches])
    finally:
        del model.vision_model.forward
    control = probe.forward(model, adapter, one_document(packed_mb)), as_is[1]
    return dict(zip(SETUPS, (as_is, fed, per_item, control)))


def stage_order(probe) -> list[str]:
    """Stages in the order the model computes them (positions and rotary first)."""
    tower = [k for k in probe.row_modules if k.startswith("vision.")]
    lm = [k for k in probe.row_modules if k.startswith("lm.") and k != "lm.rotary"]
    deepstack = [f"vision.deepstack{i}" for i in range(len(probe.vision.decoder.deepstack_merger_list))]
    return ["positions", "lm.rotary", "lm.rotary cos/sin", *tower, "vision.embeds", *deepstack, "lm.decoder_input", *lm]


def isolate(model, adapter, samples, to_device) -> dict:
    """Per stage and setup (SETUPS), packed vs each sample alone: max |diff|, bitwise equal, items of
    the vision output bitwise equal, token_mult_prob_error, the first stage that differs, hook counts."""
    from megatron_vlm_packing.bridge.parity import micro_batch_of
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.testing.parity import token_mult_prob_error

    merge, layout = int(model.vision_transformer_config.spatial_merge_size), ParallelLayout()
    packed_mb = micro_batch_of(to_device(collate_qwen_vl(samples)), adapter.mrope, layout)
    alone_batches = [micro_batch_of(to_device(collate_qwen_vl([s])), adapter.mrope, layout) for s in samples]
    probe = Probe(model)
    try:
        with torch.no_grad():
            runs = run_setups(probe, model, adapter, packed_mb, alone_batches, merge)
    finally:
        probe.remove()
    spans, alone_spans = token_spans(packed_mb), [token_spans(mb) for mb in alone_batches]
    order, setups = stage_order(probe), {}
    for setup, ((lp_packed, packed), alones) in runs.items():
        packed = dict(packed, positions=packed_mb.position_ids)
        alone_records = [dict(r, positions=mb.position_ids) for (_, r), mb in zip(alones, alone_batches)]
        stages = compare(packed, spans, alone_records, alone_spans)
        if setup == "alone fed packed vision":  # the alone tower's own work is replaced: not compared
            stages = {k: v for k, v in stages.items() if k not in probe.row_modules or not k.startswith("vision.")}
        error = token_mult_prob_error(lp_packed, torch.cat([lp for lp, _ in alones]))
        stages = {k: v for k, v in stages.items() if k not in probe.miscounted}
        first = next((k for k in order if k in stages and not stages[k][1]), "none")
        setups[setup] = {"token_mult_prob_error": error, "first_difference": first,
                         "stages": {k: list(stages[k]) for k in order if k in stages},
                         "items_bitwise": items_equal(packed, alone_records, merge)}
    return {"tokens": int(sum(len(s["input_ids"]) for s in samples)),
            "images": int(sum(len(s["image_grid_thw"]) for s in samples)),
            "videos": int(sum(len(s["video_grid_thw"]) for s in samples)),
            "dtype": str(next(model.parameters()).dtype), "setups": setups, "hooks": dict(probe.fired),
            "dropped_stages": sorted(probe.miscounted)}


def cell(stage: str, value, items) -> str:
    if value is None:
        return "-"
    diff, bitwise = value
    text = "0 (bitwise)" if bitwise else f"{diff:.3g}"
    if stage in items:
        text += f", {items[stage][0]}/{items[stage][1]} items bitwise"
    return text


def verdict(setups: dict) -> str:
    """Where the packed-vs-alone gap of the "as is" setup comes from, in one sentence."""
    error = {name: round(s["token_mult_prob_error"], 6) for name, s in setups.items()}
    if error["as is"] == 1.0:
        return "packed matches each sample alone (1.000000); nothing to isolate at this precision."
    if error["alone fed packed vision"] == 1.0:
        return (f"packed vs alone {error['as is']:.6f}, but 1.000000 with the vision output held fixed: the "
                "language model packs exactly; the gap is the vision tower run over the whole pack's images "
                f"(first difference: {setups['as is']['first_difference']}).")
    return (f"with the vision output held fixed the error is still {error['alone fed packed vision']:.6f}: the "
            f"language-model path has it (first difference: {setups['alone fed packed vision']['first_difference']}).")


def shown(stage: str, setups: dict) -> bool:
    """Sub-module rows appear for layer 0 and for a layer where some setup first differs (all are in the
    JSON); every other row always."""
    parts = stage.split(".")
    if len(parts) < 3 or not parts[1].startswith("layer") or parts[1] == "layer0":
        return True
    layer = ".".join(parts[:2]) + "."
    return any(s["first_difference"].startswith(layer) for s in setups.values())


def isolate_markdown(result: dict) -> str:
    """The isolate table: stages (rows) x setups (columns), token_mult_prob_error, first difference."""
    setups = result["setups"]
    names = list(setups)
    order = [k for k in dict.fromkeys(k for s in setups.values() for k in s["stages"]) if shown(k, setups)]
    counts = f"{result['tokens']} tokens, {result['images']} images, {result['videos']} videos"
    lines = [f"{result['model']} (parameters {result['dtype']}): {counts}; "
             "packed vs each sample alone, max |diff| per stage (rows) and setup (columns).", "",
             "| stage | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for stage in order:
        lines.append(f"| {stage} | " + " | ".join(cell(stage, setups[n]["stages"].get(stage), setups[n]["items_bitwise"])
                                                  for n in names) + " |")
    lines.append("| token_mult_prob_error | " + " | ".join(f"{setups[n]['token_mult_prob_error']:.6f}" for n in names) + " |")
    lines.append("| first stage that differs | " + " | ".join(setups[n]["first_difference"] for n in names) + " |")
    lines += ["", "Verdict: " + verdict(setups)]
    if result["dropped_stages"]:
        lines.append(f"Not compared (their hooks did not fire once per forward): {', '.join(result['dropped_stages'])}.")
    if "CPU" in result["model"] and "bf16" in result["model"]:
        lines.append("CPU bf16: CPU kernels, not the GPU's (TE, cuBLAS); these numbers only exercise the bf16 path.")
    return "\n".join(lines) + "\n"


def setup(device: str, dtype: torch.dtype):
    """(cfg, model, dtype): parallel state (a single gloo / nccl process unless one is running) and the model.

    cuda: the GPU config with Bridge's TE specs, bf16. cpu: the tiny TE-free build in fp32, or in bf16
    (provider fields as the GPU build sets them; CPU bf16 kernels, not the GPU's).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if device == "cpu":
        from megatron_vlm_packing.testing.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    if device == "cpu":
        cfg = TinyBridgeConfig(family="qwen3_vl")
        return cfg, build_cpu(cfg, dtype), dtype
    cfg = TinyBridgeConfig(family="qwen3_vl", num_layers=4, hidden_size=1024, num_attention_heads=8,
                           num_query_groups=4, ffn_hidden_size=2816, vocab_size=4096, mrope_section=(24, 20, 20),
                           vision_depth=4, vision_hidden=256, vision_heads=4, patch_size=16,
                           deepstack_visual_indexes=(0, 1, 2))
    return cfg, build(cfg), torch.bfloat16


def build_cpu(cfg, dtype: torch.dtype):
    """The tiny TE-free build (`build_tiny_bridge_model`'s), in fp32 or with the GPU build's bf16 fields."""
    from megatron_vlm_packing.bridge.build import build_with_provider, packed_core_attention, qwen3_vl_te_free_swaps
    from megatron_vlm_packing.bridge.tiny import build_tiny_bridge_model, qwen3_vl_provider

    if dtype == torch.float32:
        return build_tiny_bridge_model(cfg, seed=0).eval()
    provider = qwen3_vl_provider(cfg)
    for name, value in dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=None).items():
        setattr(provider, name, value)
    swaps = qwen3_vl_te_free_swaps(packed_core_attention(cfg.attention_backend))
    return build_with_provider(provider, swaps=swaps, seed=0).to(torch.bfloat16).eval()


def model_label(device: str, dtype: torch.dtype) -> str:
    if device == "cuda":
        return "megatron.bridge Qwen3VLModel (TE, bf16, TP=1)"
    return "megatron.bridge Qwen3VLModel (CPU smoke, " + ("fp32)" if dtype == torch.float32 else "bf16)")


def parity(model, adapter, samples, to_device, args) -> tuple[dict, str, int]:
    """The default run: (result, markdown / json text, exit status)."""
    from megatron_vlm_packing.bridge.parity import micro_batch_of
    from megatron_vlm_packing.bridge.samples import collate_qwen_vl
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.testing.parity import token_mult_prob_error

    layout = ParallelLayout()
    with torch.no_grad():
        packed = micro_batch_of(to_device(collate_qwen_vl(samples)), adapter.mrope, layout)
        lp_packed = per_token_logp(model, adapter, packed)
        lp_one_doc = per_token_logp(model, adapter, one_document(packed))
        lp_alone = torch.cat([per_token_logp(model, adapter, micro_batch_of(to_device(collate_qwen_vl([s])), adapter.mrope,
                                                                              layout)) for s in samples])
    error = token_mult_prob_error(lp_packed, lp_alone)
    control = token_mult_prob_error(lp_one_doc, lp_alone)
    result = {"model": model_label(args.device, args.torch_dtype), "tokens": int(lp_alone.numel()),
              "images": int(sum(len(s["image_grid_thw"]) for s in samples)),
              "videos": int(sum(len(s["video_grid_thw"]) for s in samples)),
              "token_mult_prob_error": error, "one_document_control": control}
    text = json.dumps(result, indent=1) if (args.out or "").endswith(".json") else (
        "| model | tokens | images | videos | token_mult_prob_error packed vs alone | whole pack as one document |\n"
        "|---|---|---|---|---|---|\n"
        f"| {result['model']} | {result['tokens']} | {result['images']} | {result['videos']} | {error:.6f} | {control:.4f} |\n")
    return result, text, 0 if error <= args.max_error and control > args.max_error else 1


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-text", type=int, default=512)
    parser.add_argument("--max-error", type=float, default=1.001)
    parser.add_argument("--out", default=None, help=".md or .json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of this script on the tiny TE-free build")
    parser.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                        help="cpu only (default fp32); cuda is always bf16")
    parser.add_argument("--isolate", action="store_true",
                        help="per stage, where packed and alone first differ (see bridge_qwen3_vl_isolate)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.dtype == "fp32":
        parser.error("--dtype fp32 is CPU only: the GPU build is Bridge's TE build in bf16")
    args.torch_dtype = torch.float32 if (args.dtype or ("bf16" if args.device == "cuda" else "fp32")) == "fp32" \
        else torch.bfloat16
    return args


def run(argv=None) -> tuple[dict, str, int]:
    """(result, text, exit status) of the run `argv` asks for (the process group is left to the caller)."""
    from megatron_vlm_packing.bridge.adapters import Qwen3VLAdapter
    from megatron_vlm_packing.bridge.samples import qwen_vl_samples

    args = parse(argv)
    cfg, model, dtype = setup(args.device, args.torch_dtype)
    adapter = Qwen3VLAdapter(model)
    samples = qwen_vl_samples(cfg, args.samples, seed=0, max_text=args.max_text)

    def to_device(batch):  # on the chosen device; pixels in the model's dtype
        return {k: (v.to(args.device, dtype) if v.is_floating_point() else v.to(args.device)) for k, v in batch.items()}

    if not args.isolate:
        return parity(model, adapter, samples, to_device, args)
    result = isolate(model, adapter, samples, to_device)
    result["model"] = model_label(args.device, dtype)
    text = json.dumps(result, indent=1) if (args.out or "").endswith(".json") else isolate_markdown(result)
    return result, text, 0


def main(argv=None) -> int:
    import torch.distributed as dist

    result, text, status = run(argv)
    print(text)
    args = parse(argv)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        if args.isolate and args.out.endswith(".md"):  # the raw numbers beside the table
            with open(args.out[:-3] + ".json", "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
