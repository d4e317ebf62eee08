"""The validator fed by a hostile user: corrupt packs that were reported clean, and encodings that
crashed or were misread. Each test names what was wrong before its fix."""

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.validate import SourceRows, validate_packed_batch


def text_fields(cp_size: int = 1) -> dict:
    """A correct text pack of 3 rows (lengths 5, 2, 3) at `cp_size`, as validator keywords."""
    ids = torch.tensor([[11, 12, 13, 14, 15, 0], [21, 22, 0, 0, 0, 0], [31, 32, 33, 0, 0, 0]])
    mask = (torch.arange(6) < torch.tensor([[5], [2], [3]])).long()
    labels = torch.where(mask.bool(), ids, -100)
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, cp_size=cp_size,
                        label_style="hf")
    params = packed.packed_seq_params
    return dict(input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
                position_ids=packed.position_ids, padding_mask=packed.padding_mask,
                cu_seqlens=params.cu_seqlens_q, cu_seqlens_padded=params.cu_seqlens_q_padded,
                max_seqlen=params.max_seqlen_q,
                source=SourceRows(input_ids=ids, attention_mask=mask, labels=labels, label_style="hf"))


def only(report, check):
    assert report.failed_checks == {check}, str(report)
    return report


def test_a_cp_split_te_cannot_make_is_named_when_cp_comes_from_the_ranks():
    """Boundaries packed for cp=1 (lengths 5, 2, 3) split in contiguous halves over 2 ranks: TE cannot cut
    these documents in 4 chunks. With cp told only by the ranks (cp_index size, cp_ranks count), alignment
    checked nothing and the partition check returned clean."""
    fields = text_fields()
    total = fields["input_ids"].shape[1]
    halves = {0: torch.arange(total // 2), 1: torch.arange(total // 2, total)}
    ranks = {r: {"cp_index": index, "labels": fields["labels"][:, index]} for r, index in halves.items()}
    report = only(validate_packed_batch(**fields, cp_ranks=ranks), "cp_partition")
    assert "physical lengths [5, 2, 3] are not multiples of 4" in str(report)
    local = validate_packed_batch(input_ids=fields["input_ids"][:, :total // 2], cu_seqlens=fields["cu_seqlens"],
                                  cp_index=halves[0], localized_total=total)
    assert "physical lengths [5, 2, 3] are not multiples of 4" in str(only(local, "cp_partition"))


def test_an_empty_or_ill_sized_cp_index_is_named():
    """An empty cp_index was taken for cp = T and passed (TE's index could not be built)."""
    fields = text_fields(cp_size=2)
    total = fields["input_ids"].shape[1]
    for index in (torch.arange(0), torch.arange(total // 2 - 1)):
        report = only(validate_packed_batch(input_ids=fields["input_ids"][:, :index.numel()],
                                            cu_seqlens=fields["cu_seqlens"], cu_seqlens_padded=fields["cu_seqlens_padded"],
                                            cp_index=index, localized_total=total), "cp_partition")
        assert f"cp_index has {index.numel()} slots" in str(report)


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0])
def test_a_loss_weight_that_is_not_finite_or_negative_is_named(weight):
    """A NaN / inf weight makes the loss sum NaN / inf, a negative one trains away from the target; the packers
    refuse them (`packing.checks`), the validator reported such a pack clean."""
    fields = text_fields()
    loss_mask = fields["loss_mask"].clone()
    slot = int((loss_mask[0] != 0).nonzero()[1])
    loss_mask[0, slot] = weight
    report = only(validate_packed_batch(**{**fields, "loss_mask": loss_mask}), "loss_weights")
    assert f"slots [{slot}]" in str(report) and "documents [0]" in str(report)


def test_a_loss_weight_on_a_slot_without_target_is_named_without_source_rows():
    """Label -100 (or any negative label) where the loss mask trains: Megatron's loss sums every weighted slot
    whatever its label, so the slot trains on a target that does not exist. Without source rows it was clean."""
    fields = text_fields()
    fields.pop("source")
    labels = fields["labels"].clone()
    slot = int((fields["loss_mask"][0] != 0).nonzero()[0])
    for label in (-100, -3):
        labels[0, slot] = label
        report = only(validate_packed_batch(**{**fields, "labels": labels}), "loss_without_target")
        assert f"slots [{slot}]" in str(report) and f"labels [{label}]" in str(report)


def source_rows() -> dict:
    fields = text_fields()
    source = fields["source"]
    return dict(input_ids=source.input_ids, attention_mask=source.attention_mask, labels=source.labels,
                label_style="hf")


@pytest.mark.parametrize("change, words", [
    # a left-padded / holed mask was read as "the first n tokens are real", a 0.5 mask as 1: the pack was
    # judged against rows the source does not hold (the packers refuse such masks: `lengths_from_keep_mask`)
    (lambda rows: {"attention_mask": rows["attention_mask"].flip(1)}, "left padding"),
    (lambda rows: {"attention_mask": rows["attention_mask"].index_fill(1, torch.tensor([1]), 0)}, "holes"),
    (lambda rows: {"attention_mask": rows["attention_mask"] * 0.5}, "values other than 0 and 1"),
    # a [B, S-1] labels row was indexed past its end silently, a [B-1, S] one raised IndexError
    (lambda rows: {"labels": rows["labels"][:, :-1]}, "source_labels must be [B, S] like source_input_ids (3, 6)"),
    (lambda rows: {"labels": rows["labels"][:-1]}, "source_labels must be [B, S] like source_input_ids (3, 6)"),
    (lambda rows: {"attention_mask": rows["attention_mask"][:, :-1]}, "source_attention_mask must be [B, S]"),
    # a list was an AttributeError, an unknown key a TypeError
    (lambda rows: {"input_ids": rows["input_ids"].tolist()}, None),
    (lambda rows: {"input_ids": "abc"}, "source_input_ids must be a tensor"),
    (lambda rows: {"tokens": rows["input_ids"]}, "unknown source fields ['tokens']"),
])
def test_source_rows_that_cannot_be_the_reference_are_a_value_error(change, words):
    rows = {**source_rows(), **change(source_rows())}
    fields = {k: v for k, v in text_fields().items() if k != "source"}
    if words is None:  # a list of ints is a tensor's worth: read as one
        assert validate_packed_batch(**fields, source=rows).ok
        return
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate_packed_batch(**fields, source=rows)
    saved = {f"source_{k}": v for k, v in rows.items() if k not in ("label_style", "tokens")}
    if "tokens" not in rows:  # the saved-batch keys name the same rows
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            validate_packed_batch({**fields, **saved, "label_style": "hf"})


@pytest.mark.parametrize("change, words", [
    # `tokens` silently replaced `input_ids`: a pack whose two id fields differ was judged on one
    (lambda f: {"tokens": f["input_ids"].flip(1)}, "the batch has both input_ids and tokens"),
    # a string / list packed_seq_params read as "no cu_seqlens" (exit 1, a wrong violation), unknown fields dropped
    (lambda f: {"packed_seq_params": "abc"}, "packed_seq_params must be a PackedSeqParams or a mapping"),
    (lambda f: {"packed_seq_params": {"cu_seqlens_q": f["cu_seqlens"], "cu_seqlens_q_pad": f["cu_seqlens_padded"]}},
     "unknown packed_seq_params fields ['cu_seqlens_q_pad']"),
    # a rank's tensor under a name no check reads was ignored: what the rank received went unchecked
    (lambda f: {"cp_ranks": {0: {"label": f["labels"]}}}, "unknown cp_ranks[0] fields ['label']"),
])
def test_fields_that_would_be_ignored_or_misread_are_a_value_error(change, words):
    fields = text_fields()
    saved = {k: v for k, v in fields.items() if k not in ("source", "cu_seqlens", "cu_seqlens_padded", "max_seqlen")}
    saved.update(change(fields))
    if "packed_seq_params" not in saved:
        saved.update({k: fields[k] for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")})
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        validate_packed_batch(saved)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_unsigned_labels_and_positions_are_read_as_int64(dtype):
    """uint32 labels were torch's RuntimeError ("Promotion for uint16, uint32, uint64 types is not supported")."""
    if not hasattr(torch, dtype):
        pytest.skip(f"torch has no {dtype}")
    fields = text_fields()
    trained = fields["loss_mask"] != 0
    labels = torch.where(trained, fields["labels"], 0).to(getattr(torch, dtype))
    report = validate_packed_batch(**{**fields, "labels": labels, "position_ids": fields["position_ids"].to(labels.dtype)})
    assert report.ok, str(report)


def test_max_seqlen_kv_without_max_seqlen_is_read():
    """A saved key of its own (`max_seqlen_kv`) given without `max_seqlen` was 'unknown inputs
    ['max_seqlen_kv']' (exit 2); it is the kv bound, checked like any other."""
    fields = {k: v for k, v in text_fields().items() if k not in ("source", "max_seqlen")}
    assert validate_packed_batch({**fields, "max_seqlen_kv": 5}).ok
    report = only(validate_packed_batch(fields, max_seqlen_kv=4), "max_seqlen")
    assert "max_seqlen_kv=4 but the longest document has 5 slots" in str(report)


def test_samples_with_the_same_tokens_and_different_labels_match_their_own_rows():
    """Two samples with the same tokens but different labels (one with its prompt masked), packed in another
    order than the source lists them: each document was matched to the first unused row with its tokens, and a
    correct pack was reported labels_vs_source (a false alarm). The row whose targets the document has is chosen."""
    ids = torch.tensor([[11, 12, 13, 14], [11, 12, 13, 14], [5, 6, 0, 0]])
    mask = (torch.arange(4) < torch.tensor([[4], [4], [2]])).long()
    labels = torch.where(mask.bool(), ids, -100)
    labels[1, :2] = -100
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, label_style="hf")
    order = [1, 0, 2]
    source = SourceRows(input_ids=ids[order], attention_mask=mask[order], labels=labels[order], label_style="hf")
    assert validate_packed_batch(packed, source=source).ok
    wrong = packed.labels.clone()
    wrong[0, 1] = 99  # a target neither row has is still named
    report = only(validate_packed_batch(packed, labels=wrong, source=source), "labels_vs_source")
    assert report.violations[0].documents == (0,)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_models_own_index_callable_that_takes_mm_token_type_ids_is_given_them(family):
    """transformers 5's get_rope_index takes `mm_token_type_ids` (0 text, 1 image, 2 video) as a required
    argument: the validator called it without, and the documented use (`mrope=` the model's own index) was a
    TypeError. The types are read from the placeholder ids; a planted wrong position is still named."""
    pytest.importorskip("transformers")
    from megatron_vlm_packing.rope import MRopeConfig
    from tests.rope.conftest import IMAGE, VIDEO, hf_config, hf_get_rope_index, random_rows

    import inspect

    hf = hf_config(family)
    index = hf_get_rope_index(family, hf)
    if "mm_token_type_ids" not in inspect.signature(index).parameters:
        pytest.skip("this transformers' get_rope_index takes no mm_token_type_ids")
    ids, mask, images, videos, seconds = random_rows(family, 4, seed=2)
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, image_grid_thw=images, video_grid_thw=videos)
    if family == "qwen2_5_vl":
        batch["second_per_grid_ts"] = seconds
    packed = pack_batch(batch, label_style="hf", mrope=MRopeConfig.from_hf_config(hf))
    fields = dict(input_ids=packed.input_ids, position_ids=packed.position_ids,
                  packed_seq_params=packed.packed_seq_params, image_token_id=IMAGE, video_token_id=VIDEO,
                  **{k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in batch})
    report = validate_packed_batch(**fields, mrope=index)
    assert report.ok and "mrope_positions" in report.checked, str(report)
    assert not [s for s in report.skipped if s[0] == "mrope_positions"], str(report)
    positions = packed.position_ids.clone()
    slot = int((packed.input_ids[0] == IMAGE).nonzero()[0])
    positions[1, 0, slot] += 1
    only(validate_packed_batch(**{**fields, "position_ids": positions}, mrope=index), "mrope_positions")


def _cp_fields_and_index():
    from megatron_vlm_packing.parallel.cp import cp_partition_index

    fields = text_fields(cp_size=2)
    return fields, [cp_partition_index(fields["cu_seqlens_padded"], 2, r) for r in range(2)]


def test_a_cp_index_shaped_like_the_other_fields_is_read():
    """A [1, T/cp] cp_index (shaped like the rank's labels) was an IndexError inside the check, for a correct
    split and a wrong one alike."""
    fields, index = _cp_fields_and_index()
    total = fields["input_ids"].shape[1]
    right = {r: {"cp_index": index[r][None], "labels": fields["labels"][:, index[r]]} for r in range(2)}
    assert validate_packed_batch(**fields, cp_size=2, cp_ranks=right).ok
    wrong = {r: {"cp_index": index[1 - r][None]} for r in range(2)}
    only(validate_packed_batch(**fields, cp_size=2, cp_ranks=wrong), "cp_partition")
    local = dict(input_ids=fields["input_ids"][:, index[0]], cu_seqlens=fields["cu_seqlens"],
                 cu_seqlens_padded=fields["cu_seqlens_padded"], localized_total=total)
    assert validate_packed_batch(**local, cp_index=index[0][None]).ok


def test_a_float_cp_index_is_named():
    """A float cp_index was compared through .long(): 2.25 read as 2 and the split passed; torch indexes with
    integer tensors only, so a float index is a broken one whatever its values."""
    fields, index = _cp_fields_and_index()
    for cp_index in (index[0].float() + 0.25, index[0].float()):
        report = only(validate_packed_batch(**fields, cp_size=2, cp_ranks={0: {"cp_index": cp_index}}), "cp_partition")
        assert "cp_index has dtype torch.float32" in str(report)


def test_a_ranks_fractional_labels_are_not_truncated_into_a_match():
    """A rank's tensors were cast to the full tensor's dtype before comparing: float labels 0.5 off read as the
    right labels. Now compared as values; the same labels in another integer dtype still match."""
    fields, index = _cp_fields_and_index()
    labels = fields["labels"][:, index[0]]
    assert validate_packed_batch(**fields, cp_size=2, cp_ranks={0: {"cp_index": index[0], "labels": labels.int()}}).ok
    off = labels.double() + (labels >= 0) * 0.5  # targets 0.5 off, -100 kept
    report = only(validate_packed_batch(**fields, cp_size=2, cp_ranks={0: {"cp_index": index[0], "labels": off}}),
                  "cp_partition")
    assert "rank 0's labels" in str(report)


def test_float_grids_are_named_without_an_index():
    """image_grid_thw as floats was read through .long() (2.5 -> 2): with no mrope index to refuse it, grids 0.5 off
    passed vision_placeholders. The model's vision tower and index take integer grids only."""
    from tests.validate.conftest import DATA, pack_fields, vlm_batch

    fields = pack_fields(vlm_batch(), cp_size=2)
    fields.pop("mrope")
    assert validate_packed_batch(**fields).ok
    for grid in (fields["image_grid_thw"].double() + 0.5, fields["image_grid_thw"].float()):
        report = only(validate_packed_batch(**{**fields, "image_grid_thw": grid}), "vision_placeholders")
        assert "image_grid_thw must be [I, 3] integers" in str(report)
    assert DATA.image_token_id == fields["image_token_id"]


@pytest.mark.parametrize("error", [TypeError("index() got an unexpected keyword"), RuntimeError("shape mismatch"),
                                   IndexError("index 7 is out of bounds"), KeyError("video"), ValueError("no grid")])
def test_an_mrope_callable_that_raises_is_one_finding_about_the_index(vlm_pack, error):
    """The user's index callable raising (transformers' get_rope_index raises IndexError / RuntimeError on a sample
    it cannot place) propagated out of validate_packed_batch: no report at all. Then each document it raised on was
    an mrope_positions violation ("mRoPE positions differ"), though no position was compared. It is one mrope_index
    finding naming the callable and its exception; the documents it raised on are listed as not checked."""
    from tests.validate.conftest import clone

    fields = clone(vlm_pack[1])
    calls = []

    def index(input_ids, image_grid_thw=None, video_grid_thw=None):
        calls.append(image_grid_thw is not None)
        if image_grid_thw is not None:  # the documents with images
            raise error
        return torch.arange(input_ids.shape[1]).expand(3, 1, -1)  # text alone: 0, 1, 2, ... in every channel

    report = only(validate_packed_batch(**{**fields, "mrope": index}), "mrope_index")
    documents = [d for d, has_images in enumerate(calls) if has_images]
    assert documents and len(report.violations) == 1 and report.violations[0].documents == (), str(report)
    name = f"{__name__}.test_an_mrope_callable_that_raises_is_one_finding_about_the_index.<locals>.index"
    assert (f"the mrope callable {name} failed on {len(documents)} of the {len(calls)} documents asked: "
            f"raised {type(error).__name__}: {error} (documents {documents})") in str(report), str(report)
    skipped = [why for check, why in report.skipped if check == "mrope_positions"]
    assert skipped == [f"documents {documents}: the mrope callable {name} gave no positions for them "
                       f"(see mrope_index)"], str(report)
    assert {"mrope_index", "mrope_positions"} <= set(report.checked), str(report)


def test_an_mrope_callable_that_fails_on_every_document_is_still_one_finding(vlm_pack):
    """An index that cannot be called at all (a wrong signature: every call a TypeError) made all 5 documents
    mrope_positions violations, each repeating the same exception."""
    from tests.validate.conftest import clone

    fields = clone(vlm_pack[1])
    error = TypeError("get_rope_index() missing 1 required positional argument: 'attention_mask'")

    def broken(input_ids, **kwargs):
        raise error

    report = only(validate_packed_batch(**{**fields, "mrope": broken}), "mrope_index")
    assert len(report.violations) == 1 and str(report).count(str(error)) == 1, str(report)
    assert f"failed on 5 of the 5 documents asked: raised TypeError: {error} (documents [0, 1, 2, 3, 4])" \
        in str(report), str(report)
    assert "[mrope_index] the mrope index" in str(report), str(report)  # no contract item: the pack is not blamed
    assert "mrope_positions" not in report.failed_checks


def megatron_pack(ids, labels, lengths, cp_size: int = 1) -> dict:
    """Validator keywords for Megatron-style rows (token k learns labels[k], the last one its sample's own next
    token) packed by pack_batch, with the source rows under "source"."""
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, cp_size=cp_size)
    fields = dict(input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
                  position_ids=packed.position_ids, padding_mask=packed.padding_mask,
                  packed_seq_params=packed.packed_seq_params, cp_size=cp_size)
    return {**fields, "source": SourceRows(ids, mask, labels, label_style="megatron")}


def crossing_skips(report) -> list[str]:
    return [why for name, why in report.skipped if name == "labels_cross_documents"]


def test_an_eos_target_equal_to_the_next_documents_first_token_is_no_false_alarm():
    """GPT-2 style: one id (50256) ends every text and starts the next. A correct Megatron-style pack trains each
    sample's last token on its own EOS, which is the next document's first token: without source rows that was
    reported as bug class 8. Without source rows a crossing and this pack are the same numbers, so the document
    is listed as not decided (never a violation); with them it is decided, and a real crossing still named."""
    eos = 50256
    ids = torch.tensor([[eos, 11, 12, 13], [eos, 21, 22, 0]])
    labels = torch.tensor([[11, 12, 13, eos], [21, 22, eos, -100]])
    fields = megatron_pack(ids, labels, [4, 3])
    source = fields.pop("source")
    report = validate_packed_batch(**fields)
    assert report.ok and "labels_cross_documents" in report.checked, str(report)
    (why,) = crossing_skips(report)
    assert why.startswith("documents [0]: ") and "source rows" in why, why
    report = validate_packed_batch(**fields, source=source)
    assert report.ok and not crossing_skips(report), str(report)
    crossed = fields["labels"].clone()
    crossed[0, 3] = 21  # a document that starts with 21, and the bug: document 0 learns it
    ids2 = fields["input_ids"].clone()
    ids2[0, 4] = 21
    report = validate_packed_batch(**{**fields, "labels": crossed, "input_ids": ids2})
    assert report.ok and crossing_skips(report), str(report)  # not decided without the rows either way


def test_a_last_token_trained_on_the_pad_slot_after_it():
    """Labels shifted after concatenation over the physical slots teach a padded document's last token the pad
    after it. Pad id 0 is also the EOS id here (a common tokenizer choice), so a correct pack whose last target is
    EOS holds the same numbers: the check compared with the next document's first token only, so it passed the
    document as decided. Without source rows it is now listed as not decided; with them a correct pack is clean
    and the shifted one is named bug class 8 (was labels_vs_source, no class)."""
    ids = torch.tensor([[11, 12, 13, 0], [21, 22, 23, 24]])
    labels = torch.tensor([[12, 13, 0, -100], [22, 23, 24, 0]])  # row 0 ends on EOS = 0 = pad id
    fields = megatron_pack(ids, labels, [3, 4], cp_size=2)
    assert fields["packed_seq_params"].cu_seqlens_q_padded.tolist() == [0, 4, 8]  # slot 3: a pad of document 0
    assert int(fields["input_ids"][0, 3]) == 0 and int(fields["labels"][0, 2]) == 0
    source = fields.pop("source")
    report = validate_packed_batch(**fields)
    assert report.ok and crossing_skips(report) == [crossing_skips(report)[0]], str(report)
    assert crossing_skips(report)[0].startswith("documents [0]: "), str(report)
    assert validate_packed_batch(**fields, source=source).ok
    own = labels.clone()
    own[0, 2] = 99  # the sample's own last target: 0 in the pack is the pad after it
    own = SourceRows(source.input_ids, source.attention_mask, own, label_style="megatron")
    report = only(validate_packed_batch(**fields, source=own), "labels_cross_documents")
    assert report.violations[0].documents == (0,) and "slot 2 learns 0 = the pad slot after it" in str(report)


def test_floating_mrope_positions_are_judged_as_the_rotary_reads_them(vlm_pack):
    """[3, T] positions in float64 / bfloat16 / float16 were a dtypes violation whatever their values, though the
    rotary reads positions as float32 (Megatron's MultimodalRotaryEmbedding and rope.rotary cast them) and
    pack_batch passes an mrope callable's float64 / bf16 output through: a correct pack was reported. A float
    dtype is now named only where it changes a position the model reads; wrong values are the value checks'."""
    from tests.validate.conftest import DATA, clone

    fields = vlm_pack[1]
    positions = fields["position_ids"]
    assert positions.dim() == 3 and int(positions.max()) <= 256
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        report = validate_packed_batch(**clone(fields, position_ids=positions.to(dtype)))
        assert report.ok and "mrope_positions" in report.checked, (dtype, str(report))
    off = positions.double() + 0.5  # float32 holds these: wrong values, named as such (.long() truncated them)
    report = validate_packed_batch(**clone(fields, position_ids=off))
    assert "dtypes" not in report.failed_checks and "positions_restart" in report.failed_checks, str(report)
    blurred = positions.double()
    slot = int((fields["input_ids"][0] == DATA.image_token_id).nonzero()[0])
    blurred[0, 0, slot] += 1e-9  # a float64 position the float32 rotary reads as the one below it
    report = only(validate_packed_batch(**clone(fields, position_ids=blurred)), "dtypes")
    want = (f"position_ids are torch.float64 and the rotary reads positions as float32, which changes 1 of them: "
            f"channel 0 slot {slot}: {float(blurred[0, 0, slot])!r} is read as {float(positions[0, 0, slot])!r}")
    assert want in str(report), str(report)


def test_half_precision_positions_beyond_their_whole_numbers_are_named():
    """bfloat16 holds whole numbers exactly only up to 256 (float16: 2048): a 300-token document's positions
    273, 275, ... cannot be in it. The report said only 'must be an integer tensor (or float32)'; it now names
    the limit, whole numbers that round and the positions beyond it (tests/validate/test_half_positions.py). 1D positions stay integers only (the 1D checks compare them as ints)."""
    n = 300
    base = dict(input_ids=torch.arange(1, n + 1)[None], cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
                max_seqlen=n)
    positions = torch.arange(n).expand(3, 1, n)
    assert validate_packed_batch(**base, position_ids=positions).ok
    report = only(validate_packed_batch(**base, position_ids=positions.bfloat16()), "dtypes")
    beyond = int((positions.bfloat16()[0, 0].float() > 256).sum())  # 258 ... 300 as bf16 stores 257 ... 299
    assert ("position_ids are torch.bfloat16, which holds whole numbers exactly only up to 256 (257 rounds to 256, "
            f"259 to 260), and documents [0] hold {beyond} positions above 256 (up to 300)") in str(report), str(report)
    assert validate_packed_batch(**base, position_ids=positions.half()).ok
    report = only(validate_packed_batch(**base, position_ids=torch.arange(n)[None].double()), "dtypes")
    assert "position_ids has dtype torch.float64; 1D positions must be an integer tensor" in str(report), str(report)
