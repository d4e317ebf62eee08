"""Every contract item / bug class planted in a valid pack is reported, and only that one."""

import pytest
import torch

from megatron_vlm_packing.parallel.cp import cp_partition_index, dense_cp_partition_index
from megatron_vlm_packing.validate import SourceRows, validate_packed_batch

from tests.validate.conftest import DATA, clone, pack_fields, vlm_batch


def only(report, check):
    assert report.failed_checks == {check}, str(report)
    return report


def test_the_valid_pack_is_clean(vlm_pack):
    report = validate_packed_batch(**vlm_pack[1])
    assert report.ok, str(report)
    assert {"mrope_positions", "vision_placeholders", "labels_vs_source"} <= set(report.checked)
    assert "OK" in str(report)


def docs_of(fields):
    cu, pad = fields["cu_seqlens"].tolist(), fields["cu_seqlens_padded"].tolist()
    return [(pad[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]  # (start slot, real length)


def test_bug4_real_boundaries_equal_to_the_physical_ones(vlm_pack):
    fields = vlm_pack[1]
    report = only(validate_packed_batch(**clone(fields, cu_seqlens=fields["cu_seqlens_padded"].clone())),
                  "uniform_boundaries")
    assert report.bug_classes == {4} and "pad slots inside the real spans per the padding mask" in str(report)


@pytest.mark.parametrize("cu, words", [([0, 9, 5, 20], "not monotonic"), ([0, -3, 5], "negative"),
                                       ([1, 5, 9], "must start at 0")])
def test_malformed_boundaries(vlm_pack, cu, words):
    fields = clone(vlm_pack[1], cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    fields.pop("cu_seqlens_padded")
    report = only(validate_packed_batch(**fields), "malformed_boundaries")
    assert words in str(report)


def test_int64_boundaries_are_named(vlm_pack):
    fields = vlm_pack[1]
    report = only(validate_packed_batch(**clone(fields, cu_seqlens=fields["cu_seqlens"].long())), "malformed_boundaries")
    assert "torch.int64" in str(report)


def test_zero_length_segment(vlm_pack):
    fields = vlm_pack[1]
    cu, pad = fields["cu_seqlens"], fields["cu_seqlens_padded"]
    cu = torch.cat([cu[:2], cu[1:]])  # document 1 becomes an empty segment in both sets
    pad = torch.cat([pad[:2], pad[1:]])
    report = only(validate_packed_batch(**clone(fields, cu_seqlens=cu, cu_seqlens_padded=pad)), "zero_length_segment")
    assert report.violations[0].documents == (1,)


def test_real_vs_padded_sets_disagree(vlm_pack):
    fields = vlm_pack[1]
    report = only(validate_packed_batch(**clone(fields, cu_seqlens=fields["cu_seqlens"][:-1])), "real_vs_padded")
    assert "cu_seqlens has 4 documents but cu_seqlens_padded has 5" in str(report)
    kv = fields["cu_seqlens"].clone()
    kv[2] += 1
    only(validate_packed_batch(**clone(fields, cu_seqlens_kv=kv)), "real_vs_padded")


def test_max_seqlen_too_short(vlm_pack):
    fields = vlm_pack[1]
    longest = int((fields["cu_seqlens_padded"][1:] - fields["cu_seqlens_padded"][:-1]).max())
    report = only(validate_packed_batch(**clone(fields, max_seqlen=longest - 1)), "max_seqlen")
    assert f"max_seqlen_q={longest - 1} but the longest document has {longest} slots" in str(report)


def test_alignment_for_a_larger_cp(vlm_pack):
    batch = vlm_pack[0]
    fields = pack_fields(batch, cp_size=1)  # aligned for nothing
    report = only(validate_packed_batch(**clone(fields, cp_size=4)), "alignment")
    assert "multiples of 8" in str(report)


def test_padding_mask_misses_a_pad_slot(vlm_pack):
    fields = clone(vlm_pack[1])
    pad_slot = int(fields["padding_mask"][0].nonzero()[0])
    fields["padding_mask"][0, pad_slot] = False
    only(validate_packed_batch(**fields), "padding_mask")


def test_bug7_padding_mask_from_token_values(vlm_pack):
    fields = clone(vlm_pack[1])
    start, real = docs_of(fields)[0]
    token = int(fields["input_ids"][0, start + 1])  # a real token in the middle of document 0
    ids = fields["input_ids"][0, start:start + real]
    assert int(ids[-1]) != token
    fields["padding_mask"] = fields["padding_mask"] | (fields["input_ids"] == token)  # `ids == pad_id`
    report = only(validate_packed_batch(**clone(fields, pad_token_id=token)), "padding_from_token_values")
    assert report.bug_classes == {7}


def test_1d_positions_not_restarting():
    batch = vlm_batch(seed=5)
    fields = pack_fields(batch, cp_size=2, mrope=None)
    total = fields["input_ids"].shape[1]
    assert validate_packed_batch(**fields).ok
    report = only(validate_packed_batch(**clone(fields, position_ids=torch.arange(total)[None])), "positions_restart")
    assert report.violations[0].documents == tuple(range(1, len(fields["cu_seqlens"]) - 1))


def test_1d_positions_wrong_inside_a_document_name_the_first_wrong_token():
    fields = pack_fields(vlm_batch(seed=5), cp_size=2, mrope=None)
    start, _ = docs_of(fields)[1]
    positions = fields["position_ids"].clone()
    positions[0, start + 3:start + 5] = 40  # the document starts at 0 as it should; its token 3 does not follow
    report = only(validate_packed_batch(**clone(fields, position_ids=positions)), "positions_restart")
    assert "(document, token, position, expected) [(1, 3, 40, 3)]" in str(report)


def test_3d_positions_not_restarting(vlm_pack):
    fields = clone(vlm_pack[1])
    start, real = docs_of(fields)[2]
    fields["position_ids"][:, :, start:start + real] += 7
    report = only(validate_packed_batch(**fields), "positions_restart")
    assert report.violations[0].documents == (2,)


def test_3d_positions_without_an_index_say_what_was_not_checked(vlm_pack):
    fields = clone(vlm_pack[1])
    fields.pop("mrope")  # a saved file cannot hold the model's index
    s, n = docs_of(fields)[0]
    fields["position_ids"][:, :, s + n // 2:s + n] += 5  # a jump inside document 0: only the index sees it
    report = validate_packed_batch(**fields)
    assert report.ok and "not checked: mrope_positions (no mrope" in str(report)


def test_1d_positions_with_an_index_record_the_index_as_not_compared(vlm_pack):
    """1D positions give the index nothing to compare: mrope_positions is skipped with the reason, never
    listed as checked (an OK report must not read as "positions equal the model's index")."""
    fields = clone(vlm_pack[1])
    cu = fields["cu_seqlens_padded"].tolist()
    offsets = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    no_vision = clone(fields, position_ids=offsets[None], input_ids=fields["input_ids"].clone())
    no_vision.pop("image_grid_thw"), no_vision.pop("source")  # source rows would hold the images
    no_vision["input_ids"][no_vision["input_ids"] == DATA.image_token_id] = 5  # text only: the 1D checks hold
    for given in (clone(fields, position_ids=offsets[None]), no_vision):
        report = validate_packed_batch(**given)
        assert "mrope_positions" not in report.checked, str(report)
        skipped = dict(report.skipped)
        assert "1D" in skipped["mrope_positions"] and "mrope_channels_identical" in skipped["mrope_positions"]
        assert "not checked: mrope_positions (position_ids are 1D" in str(report)
    assert report.ok and {"positions_restart", "mrope_channels_identical"} <= set(report.checked), str(report)


def test_bug1_1d_positions_copied_to_three_channels(vlm_pack):
    fields = vlm_pack[1]
    offsets = torch.cat([torch.arange(b - a) for a, b in zip(fields["cu_seqlens_padded"][:-1].tolist(),
                                                             fields["cu_seqlens_padded"][1:].tolist())])
    report = only(validate_packed_batch(**clone(fields, position_ids=offsets.expand(3, 1, -1).clone())),
                  "mrope_channels_identical")
    assert report.bug_classes == {1}
    image = fields["input_ids"][0] == DATA.image_token_id
    image_docs = {d for d, (s, n) in enumerate(docs_of(fields)) if (image[s:s + n - 1] & image[s + 1:s + n]).any()}
    assert image_docs  # documents with an image of more than one token
    assert set(report.violations[0].documents) == image_docs


def test_mrope_positions_differ_from_the_model_index(vlm_pack):
    fields = clone(vlm_pack[1])
    for d, (s, n) in enumerate(docs_of(fields)):
        pos = fields["position_ids"][:, 0, s:s + n]
        if not torch.equal(pos[1], pos[2]):
            pos[[1, 2]] = pos[[2, 1]].clone()  # h and w swapped
            break
    report = only(validate_packed_batch(**fields), "mrope_positions")
    assert report.violations[0].documents == (d,)


def test_bug8_last_token_learns_the_next_documents_first(vlm_pack):
    fields = clone(vlm_pack[1])
    (s0, n0), (s1, _) = docs_of(fields)[:2]
    fields["labels"][0, s0 + n0 - 1] = fields["input_ids"][0, s1]
    fields["loss_mask"][0, s0 + n0 - 1] = 1.0
    report = only(validate_packed_batch(**fields), "labels_cross_documents")
    assert report.bug_classes == {8} and report.violations[0].documents == (0,)
    fields.pop("source")  # no source rows: the sample's own next token is unknown, so not decided (no guess)
    report = validate_packed_batch(**fields)
    assert report.ok and [why for name, why in report.skipped
                          if name == "labels_cross_documents" and why.startswith("documents [0]: ")], str(report)


def test_loss_on_a_pad_slot(vlm_pack):
    fields = clone(vlm_pack[1])
    fields["loss_mask"][0, int(fields["padding_mask"][0].nonzero()[-1])] = 1.0
    only(validate_packed_batch(**fields), "loss_on_pad")


def test_a_label_differs_from_the_source(vlm_pack):
    fields = clone(vlm_pack[1])
    s, n = docs_of(fields)[1]
    slot = s + int((fields["loss_mask"][0, s:s + n - 1] != 0).nonzero()[0])
    fields["labels"][0, slot] += 1
    report = only(validate_packed_batch(**fields), "labels_vs_source")
    assert report.violations[0].documents == (1,)


def test_bug9_a_dropped_sample(vlm_pack):
    batch, fields = vlm_pack
    extra = torch.cat([batch["input_ids"], torch.full_like(batch["input_ids"][:1], 7)])
    mask = torch.cat([batch["attention_mask"], torch.ones_like(batch["attention_mask"][:1])])
    source = SourceRows(input_ids=extra, attention_mask=mask, labels=torch.cat([batch["labels"], batch["labels"][:1]]))
    report = only(validate_packed_batch(**clone(fields, source=source)), "tokens_vs_source")
    assert report.bug_classes == {9} and "dropped" in str(report)


def test_bug9_a_truncated_sample():
    batch = vlm_batch(seed=11)
    lengths = batch["attention_mask"].sum(1)
    text_tail = [b for b in range(len(lengths)) if bool((batch["input_ids"][b, lengths[b] - 4:lengths[b]] < 250).all())]
    row = text_tail[0]
    cut = dict(batch, attention_mask=batch["attention_mask"].clone())
    cut["attention_mask"][row, lengths[row] - 3:] = 0
    fields = pack_fields(cut, cp_size=2)
    fields["source"] = SourceRows(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                  labels=batch["labels"])
    report = only(validate_packed_batch(**fields), "tokens_vs_source")
    assert "truncated" in str(report)


def test_image_grids_moved_between_documents(vlm_pack):
    fields = vlm_pack[1]
    grid = fields["image_grid_thw"].clone()
    sizes = (grid.prod(1) // 4).tolist()
    j = next(j for j in range(1, len(sizes)) if sizes[j] != sizes[0])  # an image of another size
    grid[[0, j]] = grid[[j, 0]]  # the totals still agree: only a per-document check sees it
    report = only(validate_packed_batch(**clone(fields, image_grid_thw=grid)), "vision_placeholders")
    assert 0 in report.violations[0].documents and "placeholder runs per document" in str(report)


def test_an_image_placeholder_on_a_pad_slot(vlm_pack):
    fields = clone(vlm_pack[1])
    fields["input_ids"][0, int(fields["padding_mask"][0].nonzero()[0])] = DATA.image_token_id
    report = only(validate_packed_batch(**fields), "vision_placeholders")
    assert "on pad slots" in str(report)


def cp_ranks(fields, index_of):
    out = {}
    for rank in range(2):
        index = index_of(rank)
        out[rank] = {"cp_index": index, "labels": fields["labels"][..., index],
                     "loss_mask": fields["loss_mask"][..., index], "padding_mask": fields["padding_mask"][..., index],
                     "input_ids": fields["input_ids"], "position_ids": fields["position_ids"]}
    return out


def test_cp_ranks_on_te_rule_are_clean_and_others_are_not(vlm_pack):
    fields = vlm_pack[1]
    te = lambda r: cp_partition_index(fields["cu_seqlens_padded"], 2, r)  # noqa: E731
    assert validate_packed_batch(**clone(fields, cp_ranks=cp_ranks(fields, te))).ok
    total = fields["input_ids"].shape[1]
    whole = lambda r: dense_cp_partition_index(total, 2, r)  # noqa: E731  zigzag over the whole pack
    report = only(validate_packed_batch(**clone(fields, cp_ranks=cp_ranks(fields, whole))), "cp_partition")
    assert "not TE's zigzag for rank 0 at cp=2" in str(report)
    swapped = cp_ranks(fields, te)
    swapped[0]["labels"] = swapped[1]["labels"]
    report = only(validate_packed_batch(**clone(fields, cp_ranks=swapped)), "cp_partition")
    assert "rank 0's labels" in str(report)


def test_cp_ranks_outside_the_cp_group_are_named(vlm_pack):
    fields = vlm_pack[1]
    te = lambda r: cp_partition_index(fields["cu_seqlens_padded"], 2, r)  # noqa: E731
    ranks = cp_ranks(fields, te)
    ranks[5] = ranks.pop(1)  # what rank 1 received, filed under a rank cp=2 does not have: passed as clean
    report = only(validate_packed_batch(**clone(fields, cp_ranks=ranks)), "cp_partition")
    assert "cp_ranks has rank 5, but cp=2 has ranks 0..1" in str(report)


def test_shapes(vlm_pack):
    fields = vlm_pack[1]
    report = only(validate_packed_batch(**clone(fields, labels=fields["labels"][:, :-1])), "shapes")
    assert "labels has" in str(report)


@pytest.mark.parametrize("name, change", [
    ("input_ids", lambda t: t.float()),            # equal values: only the dtype is wrong
    ("labels", lambda t: t.bool()),
    ("labels", lambda t: t.float()),
])
def test_non_integer_ids_labels_positions_are_named(vlm_pack, name, change):
    fields = vlm_pack[1]
    report = only(validate_packed_batch(**clone(fields, **{name: change(fields[name])})), "dtypes")
    assert f"{name} has dtype" in str(report)


@pytest.mark.parametrize("change", [lambda t: t.bool(), lambda t: t.to(torch.complex64)])
def test_input_ids_that_are_not_real_numbers_are_named_not_raised(vlm_pack, change):
    """bool / complex ids reached torch.isin in the placeholder and position checks: a RuntimeError out of
    a function that never raises for bad data. The dtype is reported, and the per-token checks say why not."""
    fields = vlm_pack[1]
    report = only(validate_packed_batch(**clone(fields, input_ids=change(fields["input_ids"]))), "dtypes")
    assert "input_ids has dtype" in str(report)
    assert [check for check, _ in report.skipped] == ["per-token checks"], report.skipped


@pytest.mark.parametrize("name", ["image_token_id", "spatial_merge_size"])
def test_a_many_valued_id_beside_an_mrope_config_is_named(vlm_pack, name):
    """Compared with the config's value before its int check, a [2] tensor was a RuntimeError ('Boolean
    value of Tensor with more than one value is ambiguous'); a one-value tensor equal to it still passes."""
    fields = vlm_pack[1]
    assert fields["mrope"] is not None
    with pytest.raises(ValueError, match=rf"{name} must be an int, got tensor\(\[2, 2\]\)"):
        validate_packed_batch(**clone(fields, **{name: torch.tensor([2, 2])}))
    assert validate_packed_batch(**clone(fields, **{name: torch.tensor(getattr(fields["mrope"], name))})).ok


def test_float32_mrope_positions_are_checked_untruncated(vlm_pack):
    """Qwen3-Omni's fractional temporal positions are float32 [3, 1, T] (pack_batch packs them so):
    whole-valued ones are clean, and half a position off is named by the position checks, not cut back."""
    fields = vlm_pack[1]
    positions = fields["position_ids"]
    assert positions.dim() == 3 and not positions.is_floating_point()
    assert validate_packed_batch(**clone(fields, position_ids=positions.float())).ok
    report = validate_packed_batch(**clone(fields, position_ids=positions.float() + 0.5))
    assert "dtypes" not in report.failed_checks and "positions_restart" in report.failed_checks
    shifted = positions.float()
    first_vision_slot = int((fields["input_ids"][0] == DATA.image_token_id).nonzero()[0])
    shifted[0, 0, first_vision_slot] += 0.5  # one temporal position, not a document's first
    report = only(validate_packed_batch(**clone(fields, position_ids=shifted)), "mrope_positions")
    assert "where the model's index gives" in str(report)


def test_a_qwen3_omni_pack_with_fractional_positions_is_clean():
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, collate_omni, omni_sample

    cfg = TinyOmniConfig()
    rng = torch.Generator().manual_seed(0)
    samples = [omni_sample(rng, cfg, images=1, videos=1, audios=1, text=12),
               omni_sample(rng, cfg, images=0, videos=0, audios=0, text=7)]
    packed = pack_batch(collate_omni(samples), mrope=cfg.mrope_config(), label_style="hf")
    assert packed.position_ids.dtype == torch.float32 and bool((packed.position_ids % 1 != 0).any())
    report = validate_packed_batch(packed)  # was: 'position_ids has dtype torch.float32' on every such pack
    assert report.ok, report


def test_boundaries_that_do_not_cover_the_slots_stop_before_per_token_checks(vlm_pack):
    fields = vlm_pack[1]
    pad = fields["cu_seqlens_padded"].clone()
    pad[-1] -= 4  # the last document stays a multiple of 2*cp, the pack no longer ends at T
    cu = torch.minimum(fields["cu_seqlens"], pad)
    report = only(validate_packed_batch(**clone(fields, cu_seqlens=cu, cu_seqlens_padded=pad)), "real_vs_padded")
    assert "ends at" in str(report) and "not checked: per-token checks" in str(report)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("name", ["input_ids", "cu_seqlens", "image_grid_thw"])
def test_an_undense_tensor_is_named_like_the_packers_refuse_it(vlm_pack, name, layout):
    """Nested tensors are refused as sparse and meta ones are (`row_fields.is_undense`, the packers' rule): a
    strided-layout nested tensor passed the layout test and raised torch's RuntimeError ('NestedTensorImpl
    doesn't support sizes') deep in a check."""
    nested = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4])], layout=layout)
    with pytest.raises(ValueError, match=rf"{name} must be a dense tensor with data, got a nested tensor"):
        validate_packed_batch(**clone(vlm_pack[1], **{name: nested}))
    for undense, got in ((torch.tensor([0, 4]).to_sparse(), "torch.sparse_coo tensor on cpu"),
                         (torch.empty(2, dtype=torch.long, device="meta"), "torch.strided tensor on meta")):
        with pytest.raises(ValueError, match=rf"{name} must be a dense tensor with data, got a {got}"):
            validate_packed_batch(**clone(vlm_pack[1], **{name: undense}))
