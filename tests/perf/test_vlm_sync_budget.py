"""Host syncs of a packed forward + backward of `PackedVLM` (vision tower for images and videos, audio
tower, mRoPE) through `make_forward_step`: 0 when the DataLoader packed (`PackingCollator`), exactly
pack_batch's one read when the step packs or pads, with positions given in the batch or computed
in the step from the model's `MRopeConfig` (the index's checks ride that read); `get_rope_index`
alone makes one read, its checks'. The model reads nothing back itself: packing's
one read already checked every sample's placeholders against its items, the grids and the audio
masks, and carries the per-sample counts and clip lengths as host ints (packing/media*.py), so the
towers take host lengths and the embeddings are placed by a scatter of host-known size. A micro-batch
without some kinds (text only, images only) costs the same: packing's read also counts the absent
kinds' placeholders, and the model trusts it (`MicroBatch.placeholders_checked`).

One process launch; a count, not a time (testing/sync_counter.py says what counts).
"""

import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed
from tests.perf.sync_workers import counted_step


def _build(seed: int):
    """(PackedVLM with vision + audio towers and mRoPE, its placeholder ids, a media batch with positions)."""
    from dataclasses import replace

    from megatron_vlm_packing.models.audio import TinyAudioTower
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.models.tiny_gpt import build_tiny_gpt
    from megatron_vlm_packing.models.vision import TinyVisionTower
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from tests.perf.sync_workers import LM, MEDIA_DATA, MEDIA_ROPE, media_batch_with_mrope_positions

    initialize_parallel(cp=1, seed=seed)
    torch.manual_seed(seed)
    lm = build_tiny_gpt(replace(LM, vocab_size=MEDIA_DATA.vocab_size), scatter_embedding_sequence_parallel=False)
    ids = dict(image_token_id=MEDIA_DATA.image_token_id, video_token_id=MEDIA_DATA.video_token_id,
               audio_token_id=MEDIA_DATA.audio_token_id)
    model = PackedVLM(lm, TinyVisionTower(patch_features=MEDIA_DATA.patch_features, width=16,
                                          out_hidden=LM.hidden_size, heads=2),
                      audio=TinyAudioTower(mel_bins=MEDIA_DATA.mel_bins, width=16, out_hidden=LM.hidden_size),
                      mrope=MEDIA_ROPE, **ids)
    return model, ids, media_batch_with_mrope_positions(seed)


def _checked_vs_own_checks(model, ids: dict, batch: dict) -> dict:
    """PackedVLM.embed on one packed micro-batch through the host-checked path and through its own
    checks: the same embeddings and tower gradients (the sync-free placement changes no result)."""
    from megatron_vlm_packing.packing import pack_batch

    mb = pack_batch(batch, label_style="hf", **ids)
    vision, audio = mb.vision, mb.audio
    media = dict(pixel_values=vision.pixel_values, image_grid_thw=vision.image_grid_thw,
                 images_per_sample=vision.images_per_sample, pixel_values_videos=vision.pixel_values_videos,
                 video_grid_thw=vision.video_grid_thw, videos_per_sample=vision.videos_per_sample,
                 input_features=audio.input_features, feature_attention_mask=audio.feature_attention_mask,
                 audios_per_sample=audio.audios_per_sample, packed_seq_params=mb.packed_seq_params)
    weight, out = None, {}
    for name, extra in (("own_checks", {}), ("checked", dict(media_checked=True, audio_lengths=audio.audio_lengths))):
        model.zero_grad(set_to_none=True)
        emb = model.embed(mb.input_ids, **media, **extra)
        weight = torch.randn_like(emb) if weight is None else weight
        (emb * weight).sum().backward()
        towers = [p.grad.reshape(-1) for p in [*model.vision.parameters(), *model.audio.parameters()]]
        out[name] = (emb.detach(), torch.cat(towers))
    return dict(emb_equal=torch.equal(out["own_checks"][0], out["checked"][0]),
                grad_diff=(out["own_checks"][1] - out["checked"][1]).abs().max().item())


def run_vlm_sync_budget(rank: int, world_size: int, seed: int = 11) -> dict:
    """Syncs and loss of the step packing, the loader packing and the padded step; `_checked_vs_own_checks`."""
    from megatron_vlm_packing.packing.collate import PackingCollator
    from megatron_vlm_packing.train.step import make_forward_step
    from tests.perf.sync_workers import media_subset_syncs

    model, ids, batch = _build(seed)
    core = [layer.self_attention.core_attention for layer in model.language_model.decoder.layers]
    unpositioned = {k: v for k, v in batch.items() if k != "position_ids"}  # the step computes them (model's mrope)
    cases = (("in_step", make_forward_step(label_style="hf"), batch),
             ("in_step_mrope", make_forward_step(label_style="hf"), unpositioned),
             ("loader", make_forward_step(label_style="hf"), PackingCollator(label_style="hf", pack_options=ids)(batch)),
             ("padded", make_forward_step(pack=False, label_style="hf"), batch))
    row = {}
    for name, step, item in cases:
        counted_step(model, step, item, core)  # warm-up: adapters and patches settle on the first call
        model.zero_grad(set_to_none=True)
        loss, syncs = counted_step(model, step, item, core)
        row[name] = dict(syncs=syncs.total, report=syncs.report(), loss=loss.item(),
                         packing=sum(1 for e in syncs.events if "/packing/" in e.where))
    row["parity"] = _checked_vs_own_checks(model, ids, batch)
    row["subsets"] = media_subset_syncs(model, ids, core, seed)
    row["rope"] = _rope_syncs(ids, batch)
    return row


def _rope_syncs(ids: dict, batch: dict) -> dict:
    """Syncs of `get_rope_index` alone and of `pack_batch(mrope=...)` computing the positions itself."""
    from megatron_vlm_packing.packing import pack_batch
    from megatron_vlm_packing.rope import get_rope_index
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs
    from tests.perf.sync_workers import MEDIA_ROPE

    rope_inputs = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "attention_mask")}
    with count_host_syncs() as alone:
        positions = get_rope_index(batch["input_ids"], MEDIA_ROPE, **rope_inputs).position_ids
    unpositioned = {k: v for k, v in batch.items() if k != "position_ids"}
    with count_host_syncs() as packing:
        packed = pack_batch(unpositioned, label_style="hf", mrope=MEDIA_ROPE, audio_token_id=ids["audio_token_id"])
    given = pack_batch(batch, label_style="hf", **ids)  # the same positions, given in the batch
    return dict(alone=alone.total, alone_report=alone.report(), packing=sorted(e.where.rsplit("/", 1)[-1].split(":")[0]
                for e in packing.events), packing_report=packing.report(),
                same=torch.equal(positions, batch["position_ids"]) and torch.equal(packed.position_ids,
                                                                                   given.position_ids))


@pytest.fixture(scope="module")
def vlm_sync_row() -> dict:
    """The one process launch of this module's cases."""
    return run_distributed(run_vlm_sync_budget, 1, timeout_s=600)


def test_packed_vlm_with_media_syncs_once_in_step_and_never_with_loader_packing(vlm_sync_row):
    row = vlm_sync_row
    assert row["loader"]["syncs"] == 0, row["loader"]["report"]
    assert row["in_step"]["syncs"] == 1 and row["in_step"]["packing"] == 1, row["in_step"]["report"]
    # positions computed in the step from PackedVLM's MRopeConfig: still the one read, same loss
    computed = row["in_step_mrope"]
    assert computed["syncs"] == 1 and computed["packing"] == 1, computed["report"]
    assert computed["loss"] == row["in_step"]["loss"], row
    assert row["padded"]["syncs"] == 1 and row["padded"]["packing"] == 1, row["padded"]["report"]  # pad_batch's read
    assert abs(row["in_step"]["loss"] - row["loader"]["loss"]) < 1e-5, row
    assert abs(row["in_step"]["loss"] - row["padded"]["loss"]) < 1e-3 * abs(row["in_step"]["loss"]), row
    assert row["parity"]["emb_equal"] and row["parity"]["grad_diff"] < 1e-6, row["parity"]
    # get_rope_index: its value checks (grids, blocks vs grid rows, tokens per block) in one read;
    # pack_batch(mrope=MRopeConfig) queues them on its own read: one read in all (two before).
    rope = row["rope"]
    assert rope["alone"] == 1, rope["alone_report"]
    assert rope["packing"] == ["checks.py"], rope["packing_report"]
    assert rope["same"]


def test_packed_vlm_without_some_media_kinds_syncs_once_in_step_and_never_with_loader_packing(vlm_sync_row):
    # A text-only and an images-only micro-batch through a PackedVLM with image, video and audio
    # towers: packing counts the absent kinds' placeholders in its one read (exact), and the model,
    # told so by MicroBatch.placeholders_checked, makes no read per absent kind (before: 4 and 3 in
    # the step, 3 and 2 loader-packed).
    for kind, counts in vlm_sync_row["subsets"].items():
        assert counts["loader"]["syncs"] == 0, (kind, counts["loader"]["report"])
        assert counts["in_step"]["syncs"] == 1 and counts["in_step"]["packing"] == 1, (kind, counts["in_step"]["report"])
        assert counts["loss_diff"] < 1e-5, (kind, counts)
    # Counted with another spatial_merge_size than the model's: the model does not trust those counts
    # and makes its own check (reads), with the same loss.
    other = vlm_sync_row["subsets"]["images"]["other_merge"]
    assert other["syncs"] >= 1, other["report"]
    assert abs(other["loss"] - vlm_sync_row["subsets"]["images"]["loader"]["loss"]) < 1e-5, other
