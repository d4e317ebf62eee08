"""The cost model: how long a packed micro-batch takes, from sample metadata only.

A bin (one packed THD micro-batch) costs

    lm_linear * T                       every physical token goes through every GEMM (pads too)
  + lm_attention * sum_d s_d^2          causal attention per document d of real length s_d
  + vision_linear * patches             per vision patch (GEMMs, merger; windowed attention)
  + vision_attention * sum_f p_f^2      full-attention layers, per frame f of p_f = h*w patches
  + audio_linear * frames + audio_attention * sum_c n_c^2     audio encoder, per clip c

Coefficients are FLOPs of one forward + backward (3x the forward). `CostModel.from_shapes` derives
them from model shapes; `CostModel.qwen2_5_vl_7b()` is the documented default:

- LM (Qwen2.5-VL-7B: hidden 3584, 28 layers, 28 heads x 128, 4 KV groups, SwiGLU 18944, vocab
  152064): linear = 6 * (28 * (2*3584*3584 + 2*3584*512 + 3*3584*18944) + 3584*152064)
  = 4.24e10 per token; causal attention = 6 * 28 * 3584 = 6.02e5 per s^2 (QK^T and AV, 2 FLOPs
  per multiply-add, halved by the causal mask, x3 for backward).
- Vision (675M ViT: hidden 1280, 32 layers, 16 heads x 80, SwiGLU 3420, 2x2 merger to 3584):
  28 layers attend within 8x8-patch windows (a linear term: 12 * 1280 * 64 per patch per layer),
  4 layers attend over the whole frame (12 * 1280 * 4 = 6.1e4 per p^2; bidirectional, no halving).
- Audio (Qwen2.5-Omni Whisper-style encoder: hidden 1280, 32 layers, GELU 5120): bidirectional
  attention counted over each whole clip, an upper bound where the encoder attends within chunks.

The benchmark `benchmarks/planner_cost_fit.py` fits `lm_linear` and `lm_attention` (and a
per-document term) from timed forward + backward steps and reports how well the form fits.

Shape legend: N = samples.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np

from megatron_vlm_packing.packing.bounds import checked_int
from megatron_vlm_packing.planner.metadata import SampleTable


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """What the FLOP count of a transformer stack depends on."""

    hidden: int
    layers: int
    heads: int
    head_dim: int
    kv_groups: int
    ffn: int
    gated: bool = True
    vocab: int = 0  # output projection (LM head); 0 for encoders

    def __post_init__(self) -> None:
        # Unchecked, hidden=0 or 1.5 priced every token wrong and "2" was a TypeError in the FLOP count.
        for f in dataclasses.fields(self):
            value, least = getattr(self, f.name), 0 if f.name == "vocab" else 1
            if f.name == "gated":
                if not isinstance(value, bool):
                    raise ValueError(f"TransformerShape.gated must be a bool, got {value!r}")
            else:  # kept as a Python int: numpy int32 sizes wrapped in the FLOP products (71x low at 70B)
                object.__setattr__(self, f.name, checked_int(value, f"TransformerShape.{f.name}", least=least))

    def linear_flops_per_token(self) -> float:
        """Forward + backward GEMM FLOPs per token: 6 x parameters touched per token."""
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_groups * self.head_dim
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return 6.0 * (self.layers * (attn + mlp) + self.hidden * self.vocab)

    def attention_flops_per_pair(self, *, layers: int | None = None, causal: bool) -> float:
        """Forward + backward FLOPs per (query, key) pair over `layers` layers (default all)."""
        layers = self.layers if layers is None else layers
        per_pair = 4.0 * self.heads * self.head_dim  # QK^T and AV: 2 multiply-adds per pair per channel
        return 3.0 * per_pair * layers * (0.5 if causal else 1.0)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Coefficients of the cost of a bin (see the module docstring). All >= 0."""

    lm_linear: float
    lm_attention: float
    lm_per_document: float = 0.0
    vision_linear: float = 0.0
    vision_attention: float = 0.0
    audio_linear: float = 0.0
    audio_attention: float = 0.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items()
               if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf}
        if bad:  # "1" and None were TypeErrors from the comparison
            raise ValueError(f"cost coefficients must be finite numbers >= 0; got {bad}")
        for name, value in vars(self).items():  # numpy floats as Python floats (float16 sums round)
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_shapes(cls, lm: TransformerShape, *, vision: TransformerShape | None = None,
                    vision_full_layers: int | None = None, vision_window_patches: int = 0,
                    vision_merger_per_patch: float = 0.0, audio: TransformerShape | None = None) -> "CostModel":
        """FLOP coefficients from shapes.

        Args:
            vision_full_layers: vision layers attending over a whole frame (default: all).
            vision_window_patches: patches per attention window in the other layers (0: none).
            vision_merger_per_patch: merger FLOPs per patch (forward + backward).
        """
        kwargs = dict(lm_linear=lm.linear_flops_per_token(), lm_attention=lm.attention_flops_per_pair(causal=True))
        if vision is not None:
            full = vision.layers if vision_full_layers is None else vision_full_layers
            windowed = vision.attention_flops_per_pair(layers=vision.layers - full, causal=False)
            kwargs["vision_linear"] = (vision.linear_flops_per_token() + windowed * vision_window_patches
                                       + vision_merger_per_patch)
            kwargs["vision_attention"] = vision.attention_flops_per_pair(layers=full, causal=False)
        if audio is not None:
            kwargs["audio_linear"] = audio.linear_flops_per_token()
            kwargs["audio_attention"] = audio.attention_flops_per_pair(causal=False)
        return cls(**kwargs)

    @classmethod
    def qwen2_5_vl_7b(cls) -> "CostModel":
        """The default: Qwen2.5-VL-7B's LM and ViT, Qwen2.5-Omni's audio encoder (FLOPs)."""
        lm = TransformerShape(hidden=3584, layers=28, heads=28, head_dim=128, kv_groups=4, ffn=18944, vocab=152064)
        vit = TransformerShape(hidden=1280, layers=32, heads=16, head_dim=80, kv_groups=16, ffn=3420)
        whisper = TransformerShape(hidden=1280, layers=32, heads=20, head_dim=64, kv_groups=20, ffn=5120, gated=False)
        merger = 6.0 * (16 * 1280 * 1280 + 4 * 1280 * 3584) / 4  # 2x2 patches -> one LM token
        return cls.from_shapes(lm, vision=vit, vision_full_layers=4, vision_window_patches=64,
                               vision_merger_per_patch=merger, audio=whisper)

    @classmethod
    def text_only(cls, *, linear: float, attention: float) -> "CostModel":
        """a*s + b*s^2 per document, nothing else (what verl balances)."""
        return cls(lm_linear=linear, lm_attention=attention)

    def extra_costs(self, table: SampleTable, tokens: np.ndarray) -> np.ndarray:
        """[N] float64: every term of a sample's cost except `lm_linear` x its physical tokens.

        Args:
            tokens: [N] int64, expanded (real) tokens of each sample: its document length s.
        """
        s = tokens.astype(np.float64)
        cost = self.lm_attention * s * s + self.lm_per_document
        if self.vision_linear or self.vision_attention:
            for grids, owner in ((table.image_grids, table.image_owner), (table.video_grids, table.video_owner)):
                frames = grids[:, 0].astype(np.float64)
                patches = grids[:, 1].astype(np.float64) * grids[:, 2]
                per_item = self.vision_linear * frames * patches + self.vision_attention * frames * patches ** 2
                cost += table.per_sample_sum(per_item, owner)
        if self.audio_linear or self.audio_attention:
            n = table.audio_frames.astype(np.float64)
            cost += table.per_sample_sum(self.audio_linear * n + self.audio_attention * n * n, table.audio_owner)
        return cost

    def sample_costs(self, table: SampleTable, tokens: np.ndarray) -> np.ndarray:
        """[N] float64: the cost of each sample alone, counting its real tokens as physical."""
        return self.lm_linear * tokens.astype(np.float64) + self.extra_costs(table, tokens)

    def bin_cost(self, physical_tokens: int | np.ndarray, extra_sum: float | np.ndarray):
        """Cost of bins of `physical_tokens` (T, pads included) whose samples' extras sum to `extra_sum`."""
        return self.lm_linear * np.asarray(physical_tokens, dtype=np.float64) + extra_sum


def check_cost_model(cost_model) -> None:
    """`cost_model` is a `CostModel` or quacks like one (the planner reads `extra_costs`, `lm_linear` and
    `bin_cost`, which prices each bin).

    Raises:
        ValueError: naming its type (a class given for an instance included).
    """
    needed = ("extra_costs", "lm_linear", "bin_cost")
    if isinstance(cost_model, type) or not all(hasattr(cost_model, a) for a in needed):
        raise ValueError(f"cost_model must be a CostModel (or have extra_costs, lm_linear and bin_cost), got "
                         f"{type(cost_model).__name__}")


def checked_extra_costs(cost_model, table: SampleTable, tokens: np.ndarray) -> np.ndarray:
    """[N] float64: `cost_model.extra_costs(table, tokens)`, checked (a duck-typed cost model is taken as it is).

    Raises:
        ValueError: not N numbers (naming the shape or dtype), or a cost that is NaN, infinite or negative (naming
            the first such sample): the sums, heaps and rank split below would fail on it with an IndexError or a
            TypeError, or name a bin instead, or (unbalanced) plan it.
    """
    values = np.asarray(cost_model.extra_costs(table, tokens))
    what = f"cost_model.extra_costs must return [N] finite costs >= 0 (N = {len(table)} samples)"
    if values.dtype.kind not in "iuf":
        raise ValueError(f"{what}; it must return numbers, got dtype {values.dtype}")
    if values.shape != (len(table),):
        raise ValueError(f"{what}; it returned shape {values.shape} for {len(table)} samples")
    values = values.astype(np.float64)
    bad = np.flatnonzero(~(np.isfinite(values) & (values >= 0)))
    if len(bad):
        raise ValueError(f"{what}; sample {int(bad[0])} costs {float(values[bad[0]])}")
    return values
