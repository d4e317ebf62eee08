"""Megatron-Bridge's own Qwen3-Omni collate output (`tests/bridge/bridge_omni_collate.py`: its `qwen3_omni_collate_fn`
run on the processor's keys) through the shipped step, on the tiny Bridge Qwen3-Omni thinker.

Bridge's Omni batches keep the processor's keys, two of them named otherwise than here: `video_second_per_grid`
(seconds per temporal grid step, this format's `second_per_grid_ts`) and `audio_feature_lengths` (each clip's real
mel frames, `feature_attention_mask.sum(-1)`, this format's `audio_seqlens`); their labels are already next-token
targets. Before, both keys were refused as unknown. Now the step reads them under `label_style="megatron"`: the
pack is the one the Hugging Face-style batch of the same samples gives (per-token losses and every gradient
identical, vision and audio encoders included), packed and as dense rows, and equals each sample alone; under
`label_style="hf"` either key is a ValueError. CPU, one process.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from tests.bridge.bridge_omni_collate import bridge_omni_collate
from tests.bridge.step_run import run_step

pytestmark = pytest.mark.bridge
SEED = 3
README_BRIDGE_STEP = dict(pack=True, label_style="megatron", with_state=True)  # the README's arguments
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-5
TOWERS = ("thinker.visual.", "thinker.audio_model.")
ZERO_GRADS = ("self_attn.k_proj.bias",)  # exactly 0 (softmax ignores a per-query constant): rounding noise compared


@pytest.fixture(scope="module")
def omni(single_process_megatron):
    """The tiny thinker (Bridge's dense audio path runnable: `bridge.truth.dense_audio_shim`), its packed path
    patched for the module, and five samples: 0 an image and a clip, 1 a video, 2 text, 3 all three, 4 drawn."""
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, omni_samples
    from megatron_vlm_packing.bridge.truth import build_family
    from megatron_vlm_packing.patches import bridge_qwen3_omni_packed as patch

    applied_before = patch.is_applied()
    assert patch.apply_bridge_qwen3_omni_packed()
    cfg = TinyOmniConfig()
    yield dict(model=build_family("qwen3_omni", cfg, seed=SEED), cfg=cfg, samples=omni_samples(cfg, 5, seed=SEED))
    if not applied_before:
        patch.undo_bridge_qwen3_omni_packed()


def _hf_batch(samples):
    from megatron_vlm_packing.bridge.build_omni import collate_omni

    return collate_omni(samples)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _same_run(bridge: dict, ours: dict) -> None:
    """Identical per-token losses, target count and gradients, both encoders' among them."""
    assert bridge["count"] == ours["count"] > 0 and torch.equal(bridge["losses"], ours["losses"])
    assert bridge["grads"].keys() == ours["grads"].keys()
    assert all(torch.equal(bridge["grads"][n], ours["grads"][n]) for n in ours["grads"])
    for tower in TOWERS:
        assert any(n.startswith(tower) and g.abs().sum() > 0 for n, g in ours["grads"].items()), tower


def test_the_stand_in_is_bridges_collate_output(omni):
    """Bridge's own collate ran: the processor's keys plus audio_feature_lengths (the clips' real mel frames), rows
    padded to 128, labels the next token where the shifted loss mask is 1, arange positions."""
    samples = omni["samples"]
    batch, hf = bridge_omni_collate(samples), _hf_batch(samples)
    assert set(batch) == {"input_ids", "attention_mask", "labels", "loss_mask", "position_ids", "pixel_values",
                          "image_grid_thw", "pixel_values_videos", "video_grid_thw", "video_second_per_grid",
                          "input_features", "feature_attention_mask", "audio_feature_lengths"}
    assert batch["input_ids"].shape[1] == 128 and hf["input_ids"].shape[1] < 128
    assert torch.equal(batch["audio_feature_lengths"], hf["audio_seqlens"])
    assert torch.equal(batch["video_second_per_grid"], hf["second_per_grid_ts"])
    width = hf["input_ids"].shape[1]
    trained = hf["labels"][:, 1:] != -100
    assert torch.equal(batch["labels"][:, :width - 1][trained], hf["input_ids"][:, 1:][trained])
    assert torch.equal(batch["loss_mask"][:, :width - 1], trained.float())
    assert (batch["labels"][:, width - 1:] == -100).all() and not batch["attention_mask"][:, width:].any()
    assert torch.equal(batch["position_ids"], torch.arange(128).expand(len(samples), -1))


def test_bridge_omni_batch_packs_as_the_hf_batch(omni):
    """Bridge's batch (the README's arguments) and the HF-style batch (label_style="hf") give the same pack: each
    sample's mRoPE positions (the seconds per grid read as second_per_grid_ts, the clips' frames as audio_seqlens),
    identical per-token losses and gradients, both encoders included; the 128-padding is not packed."""
    model, samples = omni["model"], omni["samples"]
    ours = run_step(model, _hf_batch(samples), pack=True, label_style="hf")
    bridge = run_step(model, bridge_omni_collate(samples), **README_BRIDGE_STEP)
    assert bridge["micro_batch"].stats.real_tokens == sum(len(s["input_ids"]) for s in samples)
    assert torch.equal(bridge["micro_batch"].position_ids, ours["micro_batch"].position_ids)
    assert torch.equal(bridge["micro_batch"].vision.second_per_grid_ts, ours["micro_batch"].vision.second_per_grid_ts)
    _same_run(bridge, ours)


@pytest.mark.parametrize("rows", [[0, 3], [1, 2]], ids=["a clip in each row", "a video row and a text row"])
def test_bridge_omni_batch_dense_rows_as_the_hf_batch(omni, rows):
    """pack=False (Bridge's own dense thinker: one clip per row once any row has audio): the same dense rows as the
    HF-style batch, the 128-padding cut back to the layout's length."""
    from megatron_vlm_packing.bridge.audio_windows import encoder_keeps_clips_apart

    model, samples = omni["model"], [omni["samples"][i] for i in rows]
    if rows == [0, 3] and not encoder_keeps_clips_apart(model.thinker.audio_model):
        # transformers 5.8 (eager): Bridge's one encoder call of both rows' clips would let each read the other's
        for batch, style in ((_hf_batch(samples), "hf"), (bridge_omni_collate(samples), "megatron")):
            with pytest.raises(ValueError, match=r"encodes the micro-batch's 2 audio clips in one call"):
                run_step(model, batch, pack=False, label_style=style)
        return
    ours = run_step(model, _hf_batch(samples), pack=False, label_style="hf")
    bridge = run_step(model, bridge_omni_collate(samples), pack=False, label_style="megatron")
    assert bridge["count"] == ours["count"] and torch.equal(bridge["losses"], ours["losses"])
    assert all(torch.equal(bridge["grads"][n], ours["grads"][n]) for n in ours["grads"])
    tower = "thinker.audio_model." if rows == [0, 3] else "thinker.visual."
    assert any(n.startswith(tower) and g.abs().sum() > 0 for n, g in ours["grads"].items())


def test_bridge_omni_batch_packed_equals_each_sample_alone(omni):
    """The pack of Bridge's batch against each sample's own Bridge batch (padded to 128 alone) through the step:
    per-token losses and the summed gradients, vision and audio encoders included."""
    model, samples = omni["model"], omni["samples"]
    packed = run_step(model, bridge_omni_collate(samples), pack=True, label_style="megatron")
    alone = [run_step(model, bridge_omni_collate([s]), pack=True, label_style="megatron") for s in samples]
    assert packed["count"] == sum(a["count"] for a in alone) > 0
    assert _max_rel(packed["losses"], torch.cat([a["losses"] for a in alone])) < LOSS_TOLERANCE
    for tower in TOWERS:
        assert any(n.startswith(tower) for n in packed["grads"]), tower
    for name, grad in packed["grads"].items():  # a sample without a clip alone leaves the audio encoder without grads
        if name.endswith(ZERO_GRADS):
            continue
        summed = sum(a["grads"].get(name, torch.zeros_like(grad)) for a in alone)
        assert _max_rel(grad, summed) < GRAD_TOLERANCE, name


@pytest.mark.parametrize("rows, message", [
    ([0, 3], r"'audio_feature_lengths' is Megatron-Bridge's qwen3_omni_collate_fn's key .* label_style='megatron'"),
    ([1], r"'video_second_per_grid' is the Qwen3-Omni processor's name for second_per_grid_ts.* "
          r"label_style='megatron' .* rename it second_per_grid_ts"),
], ids=["audio", "a video, no audio"])
def test_bridge_omni_batch_with_hf_labels_is_refused(omni, rows, message):
    """label_style="hf" would shift Bridge's next-token labels a second time."""
    batch = bridge_omni_collate([omni["samples"][i] for i in rows])
    with pytest.raises(ValueError, match=message):
        step_loss(omni["model"], batch, pack=True, label_style="hf")


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("kind", ["images only", "text only"])
def test_bridge_omni_batch_without_its_keys_with_hf_labels_is_refused(omni, kind, pack):
    """An image-only or text-only Bridge Omni batch carries neither Omni key (nothing of Bridge's): under "hf" the
    packers' check of the labels against the ids refuses it (without it: 17 wrong targets for 18, silently)."""
    from megatron_vlm_packing.bridge.build_omni import omni_sample

    rng = torch.Generator().manual_seed(7)
    images = int(kind == "images only")
    samples = [omni_sample(rng, omni["cfg"], images=images, videos=0, audios=0, text=n) for n in (12, 9)]
    batch = bridge_omni_collate(samples)
    assert not batch.keys() & {"video_second_per_grid", "audio_feature_lengths", "pixel_values_videos"}
    assert ("pixel_values" in batch) == bool(images)
    with pytest.raises(ValueError, match=r"labels look already shifted \(Megatron style\) but label_style=\"hf\""):
        step_loss(omni["model"], batch, pack=pack, label_style="hf")
    assert step_loss(omni["model"], batch, pack=pack, label_style="megatron") == \
        step_loss(omni["model"], _hf_batch(samples), pack=pack, label_style="hf")


@pytest.mark.parametrize("bridge_key, ours", [("video_second_per_grid", "second_per_grid_ts"),
                                              ("audio_feature_lengths", "audio_seqlens")])
def test_bridge_omni_key_also_given_in_our_name_is_refused(omni, bridge_key, ours):
    batch = bridge_omni_collate(omni["samples"])
    batch[ours] = batch[bridge_key].clone()
    with pytest.raises(ValueError, match=rf"{bridge_key} \(Megatron-Bridge's name for {ours}\) is given and so is"):
        step_loss(omni["model"], batch, pack=True, label_style="megatron")


def test_audio_feature_lengths_disagreeing_with_the_feature_mask_is_refused(omni):
    """Read as audio_seqlens, it is checked against feature_attention_mask clip by clip (the index and the tower
    would read different lengths), never dropped."""
    batch = bridge_omni_collate(omni["samples"])
    batch["audio_feature_lengths"][0] -= 1
    with pytest.raises(ValueError, match=r"audio_seqlens and feature_attention_mask disagree on audio 0"):
        step_loss(omni["model"], batch, pack=True, label_style="megatron")


def test_packing_collator_takes_bridge_omni_batches(omni):
    """`PackingCollator(label_style="megatron")` around Bridge's collate: the step's pack, loss for loss."""
    from megatron_vlm_packing.packing.collate import PackingCollator

    cfg, model, samples = omni["cfg"], omni["model"], omni["samples"]
    collator = PackingCollator(collate=bridge_omni_collate, label_style="megatron", mrope=cfg.mrope_config())
    assert step_loss(model, collator(samples), pack=True, label_style="megatron") == \
        step_loss(model, _hf_batch(samples), pack=True, label_style="hf")


def test_parity_probe_on_bridge_omni_batches(omni, capsys):
    """The step's parity probe splits Bridge's Omni batch (its keys read under our names) per sample: packed ==
    alone within its bound."""
    step_loss(omni["model"], bridge_omni_collate(omni["samples"]), pack=True, label_style="megatron",
              parity_probe_every=1)
    assert "parity probe" in capsys.readouterr().out
