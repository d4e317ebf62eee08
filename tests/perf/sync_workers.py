"""`run_distributed` targets for the host-sync budget tests (module-level so spawn can pickle them).

A tiny mRoPE GPTModel with the packed rotary, fed 3D positions from the synthetic VLM data's own
`get_rope_index` (the model has no vision tower: image placeholders are plain tokens to it). The
reference core attention is left out of the count: it stands in, on the CPU, for TE's fused
attention on the GPU and builds its masks from the boundaries on the host.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_vlm_packing.data import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.packing import pack_batch
from megatron_vlm_packing.packing.collate import PackingCollator
from megatron_vlm_packing.rope import MRopeConfig, get_rope_index, use_packed_mrope
from megatron_vlm_packing.testing.distributed import initialize_parallel
from megatron_vlm_packing.testing.sync_counter import count_host_syncs
from megatron_vlm_packing.train.step import make_forward_step

DATA = SyntheticVLMConfig(max_text=24, max_images=2, grid_choices=(2, 4))
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=DATA.image_token_id, video_token_id=DATA.vocab_size + 1,  # no videos: an id no token has
                   vision_start_token_id=DATA.vision_start_id, mrope_section=(1, 1, 2))
LM = TinyGPTConfig(vocab_size=DATA.vocab_size, position_embedding_type="mrope", mrope_section=(1, 1, 2),
                   max_sequence_length=1024)


def text_batch_with_mrope_positions(seed: int) -> dict:
    """A right-padded batch with [3, B, S] positions; the images' pixels are dropped (GPTModel has no tower)."""
    batch = collate(synthetic_samples(5, seed=seed, cfg=DATA))
    positions = get_rope_index(batch["input_ids"], ROPE, image_grid_thw=batch["image_grid_thw"],
                               attention_mask=batch["attention_mask"]).position_ids
    return dict(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"],
                position_ids=positions)


def counted_step(model, step, item, exclude):
    """(loss sum, host syncs) of one forward + backward through the step."""
    with count_host_syncs(exclude=exclude) as syncs:
        output, loss_fn = step(iter([item]), model)
        loss_sum = loss_fn(output)[0]
        loss_sum.backward()
    return loss_sum.detach(), syncs


def run_sync_budget(rank: int, world_size: int, cp_sizes: list[int], seed: int = 5) -> dict:
    """{"text": one row per CP size (a text mRoPE GPTModel), "media": `run_media_sync_budget`'s row}."""
    results = []
    batch = text_batch_with_mrope_positions(seed)
    for cp in cp_sizes:
        initialize_parallel(cp=cp, seed=seed)
        torch.manual_seed(seed)
        model = build_tiny_gpt(replace(LM, context_parallel=cp))
        use_packed_mrope(model)
        core = [layer.self_attention.core_attention for layer in model.decoder.layers]
        step = make_forward_step(label_style="hf")
        loader_packed = PackingCollator(cp_size=cp, label_style="hf")(batch)  # what a DataLoader worker returns
        row = dict(cp=cp)
        for name, item in (("in_step", batch), ("loader", loader_packed)):
            counted_step(model, step, item, core)  # warm-up: adapters and patches settle on the first call
            model.zero_grad(set_to_none=True)
            loss, syncs = counted_step(model, step, item, core)
            row[name] = dict(syncs=syncs.total, report=syncs.report(), loss=loss.item(),
                             grad=torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        with count_host_syncs() as packing_alone:
            pack_batch(batch, cp_size=cp, label_style="hf")
        row["pack_batch"] = dict(syncs=packing_alone.total, report=packing_alone.report())
        row["loss_diff"] = abs(row["in_step"]["loss"] - row["loader"]["loss"])
        row["grad_diff"] = (row["in_step"].pop("grad") - row["loader"].pop("grad")).abs().max().item()
        results.append(row)
    return {"text": results, "media": run_media_sync_budget(rank, world_size)}


MEDIA_DATA = SyntheticVLMConfig(max_text=10, max_images=2, grid_choices=(2, 4), max_videos=1, max_audios=1)
MEDIA_ROPE = MRopeConfig(family="qwen2_vl", image_token_id=MEDIA_DATA.image_token_id,
                         video_token_id=MEDIA_DATA.video_token_id, vision_start_token_id=MEDIA_DATA.vision_start_id,
                         mrope_section=(1, 1, 2))


def media_batch_with_mrope_positions(seed: int) -> dict:
    """Images, a video and audio clips with [3, B, S] positions from the data's own `get_rope_index`."""
    batch = collate(synthetic_samples(4, seed=seed, cfg=MEDIA_DATA))
    assert {"pixel_values", "pixel_values_videos", "input_features"} <= set(batch), sorted(batch)
    positions = get_rope_index(batch["input_ids"], MEDIA_ROPE, image_grid_thw=batch["image_grid_thw"],
                               video_grid_thw=batch["video_grid_thw"],
                               attention_mask=batch["attention_mask"]).position_ids
    return {**batch, "position_ids": positions}


def run_media_sync_budget(rank: int, world_size: int, seed: int = 11) -> dict:
    """Host syncs of an mRoPE vision + audio model's packed forward + backward through the step, packed
    in the step and by the loader's collator: the difference is what packing in the step costs."""
    from megatron_vlm_packing.models.audio import TinyAudioTower
    from megatron_vlm_packing.models.packed_vlm import PackedVLM
    from megatron_vlm_packing.models.vision import TinyVisionTower

    initialize_parallel(cp=1, seed=seed)
    torch.manual_seed(seed)
    lm = build_tiny_gpt(replace(LM, vocab_size=MEDIA_DATA.vocab_size), scatter_embedding_sequence_parallel=False)
    vision = TinyVisionTower(patch_features=MEDIA_DATA.patch_features, width=16, out_hidden=LM.hidden_size, heads=2)
    audio = TinyAudioTower(mel_bins=MEDIA_DATA.mel_bins, width=16, out_hidden=LM.hidden_size)
    ids = dict(image_token_id=MEDIA_DATA.image_token_id, video_token_id=MEDIA_DATA.video_token_id,
               audio_token_id=MEDIA_DATA.audio_token_id)
    model = PackedVLM(lm, vision, audio=audio, mrope=MEDIA_ROPE, **ids)
    batch = media_batch_with_mrope_positions(seed)
    step = make_forward_step(label_style="hf")
    core = [layer.self_attention.core_attention for layer in lm.decoder.layers]
    row = {}
    loader_packed = PackingCollator(label_style="hf", pack_options=ids)(batch)
    for name, item in (("in_step", batch), ("loader", loader_packed)):
        counted_step(model, step, item, core)  # warm-up
        model.zero_grad(set_to_none=True)
        loss, syncs = counted_step(model, step, item, core)
        row[name] = dict(syncs=syncs.total, report=syncs.report(), loss=loss.item(),
                         packing=sum(1 for e in syncs.events if "/packing/" in e.where))
    with count_host_syncs() as packing_alone:
        packed = pack_batch(batch, label_style="hf", **ids)
    row["pack_batch"] = dict(syncs=packing_alone.total, report=packing_alone.report(),
                             counts=(packed.vision.images_per_sample, packed.vision.videos_per_sample,
                                     packed.audio.audios_per_sample))
    return row


def _without_other_placeholders(ids: torch.Tensor) -> torch.Tensor:
    """Text ids of a config without videos or audio may hit MEDIA_DATA's video / audio placeholder ids
    (text_vocab grows when those kinds are off): move such text ids below MEDIA_DATA.text_vocab."""
    collides = (ids > MEDIA_DATA.text_vocab) & (ids < MEDIA_DATA.image_token_id)
    return torch.where(collides, ids - 100, ids)


def media_subset_batch(seed: int, *, images: bool) -> dict:
    """A text-only (`images=False`: no media keys at all) or images-only batch of MEDIA_DATA's ids,
    with [3, B, S] positions from the data's own `get_rope_index`: what a mixed dataset's micro-batch
    without videos or audio looks like to a model that has towers for them."""
    cfg = replace(MEDIA_DATA, max_images=2 if images else 0, max_videos=0, max_audios=0)
    batch = collate(synthetic_samples(4, seed=seed, cfg=cfg))
    batch["input_ids"] = _without_other_placeholders(batch["input_ids"])
    batch["labels"] = _without_other_placeholders(batch["labels"])
    if not images:
        del batch["pixel_values"], batch["image_grid_thw"]
    else:
        assert batch["pixel_values"].shape[0], "the seed gives no image: pick another"
    grid = batch.get("image_grid_thw")
    positions = get_rope_index(batch["input_ids"], MEDIA_ROPE, image_grid_thw=grid,
                               attention_mask=batch["attention_mask"]).position_ids
    return {**batch, "position_ids": positions}


def media_subset_syncs(model, ids: dict, core, seed: int) -> dict:
    """Syncs of a text-only and an images-only micro-batch through a PackedVLM with image, video and
    audio towers, packed in the step and by the loader's collator: {"text": {...}, "images": {...}}."""
    rows = {}
    for kind, images in (("text", False), ("images", True)):
        batch = media_subset_batch(seed, images=images)
        loader = PackingCollator(label_style="hf", pack_options=ids)(batch)
        for name, item in (("in_step", batch), ("loader", loader)):
            step = make_forward_step(label_style="hf")
            counted_step(model, step, item, core)  # warm-up
            model.zero_grad(set_to_none=True)
            loss, syncs = counted_step(model, step, item, core)
            rows.setdefault(kind, {})[name] = dict(syncs=syncs.total, report=syncs.report(), loss=loss.item(),
                                                   packing=sum(1 for e in syncs.events if "/packing/" in e.where))
        rows[kind]["loss_diff"] = abs(rows[kind]["in_step"]["loss"] - rows[kind]["loader"]["loss"])
        if images:  # as a loader configured with another merge size would record it: the model checks itself
            other = replace(loader, vision=replace(loader.vision, spatial_merge_size=1))
            step = make_forward_step(label_style="hf")
            counted_step(model, step, other, core)  # warm-up
            model.zero_grad(set_to_none=True)
            loss, syncs = counted_step(model, step, other, core)
            rows[kind]["other_merge"] = dict(syncs=syncs.total, loss=loss.item(), report=syncs.report())
    return rows
