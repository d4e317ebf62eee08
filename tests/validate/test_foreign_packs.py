"""Other packers' layouts, our own packs over random plans, and the typed MicroBatch."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.packing.localize import localize
from megatron_vlm_packing.packing.micro_batch import BatchStats, MicroBatch, VisionInputs
from megatron_vlm_packing.parallel.layout import ParallelLayout
from megatron_vlm_packing.validate import SourceRows, validate_packed_batch

from tests.validate.conftest import DATA, pack_fields, vlm_batch


def bridge_uniform_step_layout(batch: dict, multiple: int = 16) -> dict:
    """Megatron-Bridge's qwen3_vl_step layout, written from its description: every row right-padded
    to a multiple of 16 (fp8 padding), rows laid end to end, cu_seqlens = cu_seqlens_padded =
    [0, S, 2S, ...]; labels shifted inside each row, no loss at pads, 1D positions per row."""
    ids, keep, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["labels"]
    rows, length = ids.shape
    padded = -(-length // multiple) * multiple
    pad = lambda x, v: torch.cat([x, torch.full((rows, padded - length), v, dtype=x.dtype)], 1)  # noqa: E731
    ids, keep, labels = pad(ids, 0), pad(keep, False), pad(labels, -100)
    shifted = torch.where(torch.cat([keep[:, 1:], keep[:, :1] & False], 1), torch.roll(labels, -1, 1), -100)
    cu = torch.arange(rows + 1, dtype=torch.int32) * padded
    return dict(input_ids=ids.reshape(1, -1), labels=shifted.reshape(1, -1),
                loss_mask=(shifted != -100).float().reshape(1, -1),
                position_ids=torch.arange(padded).repeat(rows)[None], cu_seqlens=cu, cu_seqlens_padded=cu.clone(),
                max_seqlen=padded), ~keep.reshape(1, -1)


def test_bridge_uniform_boundaries_are_bug_class_4_whatever_the_evidence():
    batch = vlm_batch(seed=7)
    fields, pads = bridge_uniform_step_layout(batch)
    source = SourceRows(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    for evidence in (dict(padding_mask=pads), dict(source=source), dict(pad_token_id=0)):
        report = validate_packed_batch(**fields, **evidence, fp8=True)
        assert report.failed_checks == {"uniform_boundaries"}, (evidence.keys(), str(report))
        assert report.bug_classes == {4}
        assert "uniform cu_seqlens [0, " in str(report)
        assert report.num_real_tokens == int(batch["attention_mask"].sum())
    assert "suspected" in str(validate_packed_batch(**fields, pad_token_id=0))
    no_evidence = validate_packed_batch(**fields)
    assert no_evidence.ok and any(name == "uniform_boundaries" for name, _ in no_evidence.skipped)


def test_bridge_layout_with_real_boundaries_is_clean():
    """The same layout with TE's two sets (real inside physical) is a correct pack."""
    batch = vlm_batch(seed=7)
    fields, pads = bridge_uniform_step_layout(batch)
    lengths = batch["attention_mask"].sum(1)
    fields["cu_seqlens"] = torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32)
    source = SourceRows(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    report = validate_packed_batch(**fields, padding_mask=pads, source=source, fp8=True)
    assert report.ok, str(report)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5).filter(any),
       cp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2]), sp=st.booleans(), fp8=st.booleans(),
       seed=st.integers(0, 1000))
def test_our_packs_validate_clean_over_random_plans(lengths, cp, tp, sp, fp8, seed):
    sp = sp and tp > 1  # SP needs TP (Megatron-Core refuses it at tp=1)
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    keep = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(1, 50, (len(lengths), width), generator=g), 0)
    labels = torch.where(keep & (torch.rand(ids.shape, generator=g) < 0.8), ids, -100)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": keep.long()}
    fields = pack_fields(batch, cp_size=cp, mrope=None, tp_size=tp, sequence_parallel=sp, fp8=fp8)
    report = validate_packed_batch(**fields)
    assert report.ok, str(report)


def micro_batch(batch: dict, *, cp_size: int) -> MicroBatch:
    packed = pack_batch(batch, cp_size=cp_size, label_style="hf", image_token_id=DATA.image_token_id)
    images = (batch["input_ids"] == DATA.image_token_id)
    return MicroBatch(
        input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
        position_ids=packed.position_ids, padding_mask=packed.padding_mask,
        packed_seq_params=packed.packed_seq_params, rope_cu_seqlens=packed.rope_cu_seqlens,
        stats=BatchStats(packed.num_real_tokens, packed.num_physical_tokens, batch["input_ids"].numel()),
        vision=VisionInputs(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                            images_per_sample=tuple(_images_per_row(images))),
        plan=packed.plan, indices=packed.indices)


def _images_per_row(images: torch.Tensor) -> list[int]:
    starts = images & ~torch.cat([torch.zeros_like(images[:, :1]), images[:, :-1]], 1)
    return starts.sum(1).tolist()


def test_a_micro_batch_is_read_directly_and_a_localized_one_checks_its_cp_index():
    batch = vlm_batch(seed=3)
    mb = micro_batch(batch, cp_size=2)
    report = validate_packed_batch(mb, image_token_id=DATA.image_token_id, cp_size=2)
    assert report.ok and "vision_placeholders" in report.checked, str(report)
    wrong = dict(zip(("images_per_sample",), [tuple(reversed(mb.vision.images_per_sample))]))
    moved = validate_packed_batch(mb, image_token_id=DATA.image_token_id,
                                  images_per_document=wrong["images_per_sample"])
    assert moved.failed_checks == {"vision_placeholders"}, str(moved)
    local = localize(mb, ParallelLayout(cp_size=2, cp_rank=1))
    assert validate_packed_batch(local, cp_rank=1).ok
    bad = validate_packed_batch(local, cp_rank=0)
    assert bad.failed_checks == {"cp_partition"} and "not TE's zigzag for rank 0" in str(bad)
    assert "localized to one CP rank" in str(bad)


def test_alignment_under_sequence_parallelism_and_fp8():
    for seed in range(9, 20):  # a pack whose T (a multiple of 2 for SP) is not one of 32 (FP8 too)
        fields = pack_fields(vlm_batch(seed=seed), cp_size=1, mrope=None, tp_size=2, sequence_parallel=True)
        if fields["input_ids"].shape[1] % 32:
            break
    assert validate_packed_batch(**fields).ok
    report = validate_packed_batch(**{**fields, "fp8": True})
    assert report.failed_checks == {"alignment"} and "is not a multiple of 32" in str(report), str(report)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), cp=st.sampled_from([1, 2]))
def test_our_vlm_packs_validate_clean(seed, cp):
    batch = vlm_batch(seed=seed, num=3)
    report = validate_packed_batch(**pack_fields(batch, cp_size=cp))
    assert report.ok, str(report)


def bridge_in_batch():
    import pytest

    from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason, import_bridge_module

    reason = bridge_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return import_bridge_module("megatron.bridge.data.packing.in_batch")


def test_bridge_collate_time_packs_validate_clean():
    """Megatron-Bridge's own collate-time packing (data.packing.in_batch) packs at real lengths."""
    in_batch = bridge_in_batch()
    g = torch.Generator().manual_seed(4)
    lengths = [9, 2, 13, 5]
    keep = torch.arange(13)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(1, 90, (4, 13), generator=g), 0)
    labels = torch.where(keep, torch.randint(1, 90, (4, 13), generator=g), -100)  # Megatron style, aligned
    rows = {"tokens": ids.clone(), "labels": labels.clone(), "loss_mask": keep.float(),
            "position_ids": torch.arange(13).expand(4, 13).clone(), "attention_mask": keep.long()}
    source = SourceRows(input_ids=ids, attention_mask=keep.long(), labels=labels, loss_mask=keep.float(),
                        label_style="megatron")
    for multiple, cp in ((1, 1), (4, 2)):
        packed = dict(rows)
        in_batch.pack_right_padded_sequence_batch_to_mcore_thd(packed, pad_to_multiple_of=multiple)
        fields = dict(input_ids=packed["tokens"], labels=packed["labels"], loss_mask=packed["loss_mask"],
                      position_ids=packed["position_ids"], cu_seqlens=packed["cu_seqlens_q"],
                      cu_seqlens_padded=packed.get("cu_seqlens_q_padded"), cu_seqlens_kv=packed["cu_seqlens_kv"],
                      max_seqlen=packed["max_seqlen_q"], source=source, pad_token_id=0)
        report = validate_packed_batch(**fields, cp_size=cp)
        assert report.ok, (multiple, str(report))
        if multiple == 1:  # the same pack claimed for CP=2: Bridge was not asked to align it
            assert validate_packed_batch(**fields, cp_size=2).failed_checks == {"alignment"}


def test_pack_batch_micro_batch_with_an_empty_row_maps_images_to_documents():
    batch = vlm_batch(seed=3)
    rows = batch["input_ids"].shape[0]
    batch = {**batch, **{k: torch.cat([batch[k][:1], torch.full_like(batch[k][:1], fill), batch[k][1:]])
                         for k, fill in (("input_ids", 0), ("labels", -100), ("attention_mask", 0))}}
    mb = pack_batch(batch, label_style="hf", image_token_id=DATA.image_token_id)  # row 1: no tokens, no document
    assert mb.vision.images_per_sample[1] == 0 and len(mb.vision.images_per_sample) == rows + 1
    report = validate_packed_batch(mb, image_token_id=DATA.image_token_id)
    assert report.ok and report.num_documents == rows and "vision_placeholders" in report.checked, str(report)
