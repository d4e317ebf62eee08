"""The parity probe on batches with images, videos (with their seconds) and audio clips (with their masks and
raw lengths), as the Qwen-VL / Qwen3-Omni models take them: `make_forward_step(parity_probe_every=1)` and
`with_parity_probe` on a real tiny mRoPE `PackedVLM` with vision and audio towers (Qwen3-Omni's rotary, the
samples of `tests/models/test_packed_vlm_omni.py`), one CPU process, one launch.

Before, the first probed micro-batch of such a batch was a ValueError ("the parity probe splits token rows and
images only"). Now each sample alone gets exactly its own items, and the probe passes on the step's own packs
(images + video + audio; a video with its audio track, `use_audio_in_video`; a collator's [3, B, S] float
positions beside `audio_seqlens`; pre-packed rows of two documents each) and raises `ParityProbeError` on the
same batch packed wrong on purpose (`testing.probe_controls`: a boundary moved, an image / video / audio clip
holding another sample's values), so the passes cannot be vacuous.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed

TOLERANCE = 2e-5  # fp32 on CPU, as tests/models/test_packed_vlm_omni.py; measured up to ~1e-6
CONTROLS = ("moved_boundary", "foreign_image", "foreign_video", "foreign_audio")


def _pre_packed(batch: dict) -> dict:
    """Rows 0 + 1 and 2 + 3 of `batch` as two pre-packed rows of two documents each (`document_lengths`); the
    media keep their token order, so they are the same batch's."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    pairs = ((0, 1), (2, 3))
    width = max(lengths[a] + lengths[b] for a, b in pairs)
    ids = torch.zeros(len(pairs), width, dtype=batch["input_ids"].dtype)
    labels = torch.full_like(ids, -100)
    for row, pair in enumerate(pairs):
        start = 0
        for source in pair:
            n = lengths[source]
            ids[row, start:start + n] = batch["input_ids"][source, :n]
            labels[row, start:start + n] = batch["labels"][source, :n]
            start += n
    mask = (torch.arange(width)[None] < torch.tensor([lengths[a] + lengths[b] for a, b in pairs])[:, None]).long()
    media = {k: v for k, v in batch.items() if k not in ("input_ids", "labels", "attention_mask")}
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "document_lengths": torch.tensor([[lengths[a], lengths[b]] for a, b in pairs]), **media}


def _probed(model, batch, transform=None) -> dict:
    """One micro-batch through `make_forward_step(parity_probe_every=1)`: the printed result, or the
    ParityProbeError's numbers."""
    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.validate import ParityProbeError

    printed = io.StringIO()
    step = make_forward_step(label_style="hf", parity_probe_every=1, transform=transform)
    try:
        with contextlib.redirect_stdout(printed):
            step(iter([batch]), model)
    except ParityProbeError as err:
        return dict(raised=True, max_abs_diff=err.result.max_abs_diff, message=str(err))
    line = next(line for line in printed.getvalue().splitlines() if line.startswith("parity probe:"))
    return dict(raised=False, max_abs_diff=float(line.split("max |dloss| ")[1].split(",")[0]), message=line)


def run_media_probe_cases(rank, world_size):
    from tests.models.test_packed_vlm_omni import (
        _audio_in_video_samples, _build, _collate, _omni_batch_with_positions, _omni_cfg, _samples)

    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.testing import probe_controls
    from megatron_vlm_packing.validate import with_parity_probe

    cfg = _omni_cfg()
    model = _build(cfg, cp=1)
    batch = _collate(_samples(cfg))
    out = {"keys": sorted(batch), "clean": _probed(model, batch),
           "audio_in_video": _probed(model, _collate(_audio_in_video_samples(cfg), audio_in_video=True)),
           "given_positions": _probed(model, _omni_batch_with_positions()[1]),
           "pre_packed": _probed(model, _pre_packed(batch))}
    controls = {"moved_boundary": probe_controls.moved_boundary,
                **{f"foreign_{kind}": probe_controls.foreign_media(kind) for kind in ("image", "video", "audio")}}
    for name, transform in controls.items():
        out[name] = _probed(model, batch, transform)
    seen = []
    wrapped = with_parity_probe(make_forward_step(label_style="hf"), every=1, label_style="hf",
                                mrope=cfg.mrope_config(), on_result=seen.append)
    wrapped(iter([batch]), model)
    out["wrapped"] = [(r.max_abs_diff, len(r.per_document)) for r in seen]
    return out


@pytest.fixture(scope="module")
def cases():
    return run_distributed(run_media_probe_cases, 1)


def test_the_batch_holds_every_media_input(cases):
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
            "input_features", "feature_attention_mask", "audio_seqlens"} <= set(cases["keys"])


@pytest.mark.parametrize("name", ["clean", "audio_in_video", "given_positions", "pre_packed"])
def test_the_step_probe_passes_on_its_own_packs_of_media(cases, name):
    result = cases[name]
    assert not result["raised"] and result["max_abs_diff"] <= TOLERANCE, result
    samples = 3 if name == "audio_in_video" else 4
    assert f"of {samples} samples" in result["message"], result


@pytest.mark.parametrize("name", CONTROLS)
def test_the_step_probe_raises_on_the_same_batch_packed_wrong(cases, name):
    result = cases[name]
    assert result["raised"] and result["max_abs_diff"] > 100 * TOLERANCE, result
    assert "packing is not exact" in result["message"]


def test_with_parity_probe_splits_the_media_too(cases):
    assert len(cases["wrapped"]) == 1
    max_diff, documents = cases["wrapped"][0]
    assert max_diff <= TOLERANCE and documents == 4
