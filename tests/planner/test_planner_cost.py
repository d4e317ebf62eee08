"""Cost model and token counting: vectorised columns equal per-sample formulas; FLOP counts by hand."""

import io

import numpy as np
import pytest

from megatron_vlm_packing.planner import (BinLayout, CostModel, PlannerConfig, SampleMetadata, SampleTable, TokenCounter,
                                          TransformerShape, plan_epoch)
from megatron_vlm_packing.planner.metadata import llava_tokens
from megatron_vlm_packing.planner.progress import Progress
from megatron_vlm_packing.planner.synthetic import synthetic_table


def test_flops_of_a_small_shape_by_hand():
    shape = TransformerShape(hidden=8, layers=2, heads=2, head_dim=4, kv_groups=1, ffn=16, gated=False, vocab=10)
    # per layer: q and o 8x8 each, k and v 8x4 each, MLP 2 x 8x16 -> 128 + 64 + 256 = 448; head 80.
    assert shape.linear_flops_per_token() == 6 * (2 * 448 + 80)
    assert shape.attention_flops_per_pair(causal=True) == 3 * 4 * 8 * 2 * 0.5
    assert shape.attention_flops_per_pair(causal=False, layers=1) == 3 * 4 * 8
    default = CostModel.qwen2_5_vl_7b()
    assert default.lm_linear == pytest.approx(4.24e10, rel=0.01)
    assert default.lm_attention == 6 * 28 * 3584
    with pytest.raises(ValueError, match="lm_linear"):
        CostModel(lm_linear=-1.0, lm_attention=0.0)


def _by_hand(sample: SampleMetadata, cost: CostModel, counter: TokenCounter):
    tokens = sample.text_tokens
    extra = 0.0
    for t, h, w in sample.image_grids + sample.video_grids:
        tokens += t * h * w // counter.spatial_merge ** 2 + counter.vision_wrappers
        extra += cost.vision_linear * t * h * w + cost.vision_attention * t * (h * w) ** 2
    for n in sample.audio_frames:
        tokens += -(-n // counter.audio_pool) + counter.audio_wrappers
        extra += cost.audio_linear * n + cost.audio_attention * n * n
    return tokens, extra + cost.lm_attention * tokens ** 2


def test_columns_equal_per_sample_formulas():
    table = synthetic_table(200, seed=2)
    cost, counter = CostModel.qwen2_5_vl_7b(), TokenCounter()
    tokens, extra = counter(table), cost.extra_costs(table, counter(table))
    for i in range(0, 200, 7):
        sample = table.sample(i)
        assert SampleTable.from_samples([sample]).sample(0) == sample
        want_tokens, want_extra = _by_hand(sample, cost, counter)
        assert tokens[i] == want_tokens and extra[i] == pytest.approx(want_extra, rel=1e-12)
    assert np.allclose(cost.sample_costs(table, tokens), cost.lm_linear * tokens + extra)


def test_llava_expansion_and_bad_metadata():
    table = SampleTable.from_samples([SampleMetadata(10, image_grids=((1, 4, 4), (1, 2, 2))), SampleMetadata(3)])
    assert llava_tokens(576)(table).tolist() == [10 + 2 * 576, 3]
    # Bins are sized in the space attention sees: 1162 expanded tokens do not fit 1024 slots.
    config = PlannerConfig(layout=BinLayout(capacity=2048), expanded_tokens=llava_tokens(576))
    assert sorted(b.tokens for b in plan_epoch(table, config).bins()) == [(10 + 2 * 576, 3)]
    with pytest.raises(ValueError, match=r"sample 0 \(1162 slots\)"):
        plan_epoch(table, PlannerConfig(layout=BinLayout(capacity=1024), expanded_tokens=llava_tokens(576)))
    with pytest.raises(ValueError, match="image_grids"):
        SampleTable.from_samples([SampleMetadata(1, image_grids=((1, 0, 4),))])
    with pytest.raises(ValueError, match="text_tokens"):
        SampleTable(text_tokens=np.asarray([3, -1]))


def test_progress_line_only_when_enabled():
    out = io.StringIO()
    bar = Progress(200, enabled=True, label="planning", stream=out, interval_s=0.0)
    bar.update(50)
    bar.close()
    assert "planning:  25% (50/200 samples)" in out.getvalue() and out.getvalue().endswith("100% (200/200 samples)\n")
    quiet = io.StringIO()
    Progress(200, enabled=False, stream=quiet).close()
    assert quiet.getvalue() == ""
