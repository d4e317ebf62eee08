"""`pack_batch` against an independent reference written as plain Python loops over rows and documents,
on both paths (`host_reads=True` and the device path), over the whole input space a collated batch can
take: pre-packed rows (`document_lengths` with 1-token documents, trailing zeros, empty rows), every mask
form, `seq_lens` as a list or tensor, int32 / non-contiguous ids and labels, float / int / bool loss
weights, and every cp / tp / sequence-parallel / fp8 alignment with and without `pad_to`."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_vlm_packing.packing import pack_batch

VOCAB = 40
PAD_ID = 3


def reference(ids, labels, weights, lengths, documents, *, style, segment, total, pad_to):
    """Plain loops: every document's tokens in order, labels shifted inside it (hf), pad slots after it."""
    docs = []  # (row, start, length)
    for b, n in enumerate(lengths):
        for start, length in documents[b] if documents is not None else ([(0, n)] if n else []):
            docs.append((b, start, length))
    physical = [-(-n // segment) * segment for _, _, n in docs]
    wanted = pad_to if pad_to is not None else -(-sum(physical) // total) * total
    physical[-1] += wanted - sum(physical)
    out = {k: [] for k in ("ids", "labels", "weights", "positions", "pad")}
    for (b, start, n), phys in zip(docs, physical):
        for i in range(phys):
            real = i < n
            s = start + i
            out["ids"].append(ids[b][s] if real else PAD_ID)
            if not real:
                target = -100
            elif style == "hf":
                target = labels[b][s + 1] if i + 1 < n else -100
            else:
                target = labels[b][s]
            out["labels"].append(target)
            weight = 0.0 if target == -100 else (1.0 if weights is None else float(weights[b][s]))
            out["weights"].append(weight)
            out["positions"].append(i)
            out["pad"].append(not real)
    cu, cu_padded = [0], [0]
    for (_, _, n), phys in zip(docs, physical):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + phys)
    return out, cu, cu_padded


def total_multiple(cp, tp, sp, fp8):
    segment = 2 * cp if cp > 1 else 1
    return segment, math.lcm(segment, cp * (tp if sp else 1) * (16 if fp8 else 1))


@st.composite
def batches(draw):
    rows = draw(st.integers(1, 4))
    row_length = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(0, row_length), min_size=rows, max_size=rows).filter(any))
    with_documents = draw(st.booleans())
    documents = None
    if with_documents:
        documents = []
        for n in lengths:
            cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
            bounds = [0, *cuts, n] if n else [0]
            documents.append([(a, b - a) for a, b in zip(bounds, bounds[1:])])
    seed = draw(st.integers(0, 2 ** 16))
    return rows, row_length, lengths, documents, seed


@settings(max_examples=150, deadline=None)
@given(shape=batches(), style=st.sampled_from(["megatron", "hf"]),
       mask_form=st.sampled_from(["long", "bool", "int32", "float", "4d", "seq_lens", "seq_lens_tensor"]),
       loss_form=st.sampled_from([None, torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool]),
       layout=st.sampled_from(["contiguous", "int32", "transposed"]),
       cp=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2]), sp=st.booleans(), fp8=st.booleans(),
       extra_pad=st.sampled_from([None, 0, 1, 3]), trailing_zeros=st.integers(0, 2))
def test_pack_batch_matches_a_loop_reference_on_both_paths(shape, style, mask_form, loss_form, layout, cp, tp, sp, fp8,
                                                          extra_pad, trailing_zeros):
    rows, row_length, lengths, documents, seed = shape
    sp = sp and tp > 1  # SP needs TP (Megatron-Core refuses it at tp=1)
    if documents is not None and mask_form == "4d":
        mask_form = "long"  # document_lengths go with a 2D mask or seq_lens (a 4D mask is refused)
    g = torch.Generator().manual_seed(seed)
    keep = torch.arange(row_length)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(0, VOCAB, (rows, row_length), generator=g), PAD_ID)
    labels = torch.randint(0, VOCAB, (rows, row_length), generator=g)
    labels = torch.where(torch.rand(rows, row_length, generator=g) < 0.2, -100, labels)
    labels[:, 0] = VOCAB - 1  # Megatron labels that differ from their tokens (never read as HF labels)
    ids[:, 0] = torch.where(keep[:, 0], 0, PAD_ID)
    weights = None
    batch = {}
    if loss_form is not None:
        raw = torch.rand(rows, row_length, generator=g) * 3
        weights = raw.to(loss_form) if loss_form != torch.int64 else (raw * 2).long()
        if loss_form == torch.bool:
            weights = raw > 1
        batch["loss_mask"] = weights
    if mask_form == "4d":
        causal = torch.ones(row_length, row_length, dtype=torch.bool).tril()
        batch["attention_mask"] = ~(causal[None] & keep[:, None, :] & keep[:, :, None])[:, None]
    elif mask_form == "seq_lens":
        batch["seq_lens"] = list(lengths)
    elif mask_form == "seq_lens_tensor":
        batch["seq_lens"] = torch.tensor(lengths, dtype=torch.int32)
    else:
        batch["attention_mask"] = keep.to({"long": torch.long, "bool": torch.bool, "int32": torch.int32,
                                           "float": torch.float32}[mask_form])
    given_ids, given_labels = ids, labels
    if layout == "int32":
        given_ids, given_labels = ids.int(), labels.int()
    elif layout == "transposed":  # same values, non-contiguous storage
        given_ids, given_labels = ids.t().contiguous().t(), labels.t().contiguous().t()
    batch.update(input_ids=given_ids, labels=given_labels)
    if documents is not None:
        batch["document_lengths"] = [[n for _, n in row] + [0] * trailing_zeros for row in documents]
    segment, total = total_multiple(cp, tp, sp, fp8)
    pad_to = None
    if extra_pad is not None:  # exactly right (0) or bigger, always aligned
        physical = sum(-(-n // segment) * segment
                       for row in (documents if documents is not None else [[(0, n)] for n in lengths])
                       for _, n in row if n)
        pad_to = (-(-physical // total) + extra_pad) * total
    expected, cu, cu_padded = reference(
        ids.tolist(), labels.tolist(), None if weights is None else weights.float().tolist(), lengths, documents,
        style=style, segment=segment, total=total, pad_to=pad_to)
    for host_reads in (True, False):
        packed = pack_batch(batch, label_style=style, cp_size=cp, tp_size=tp, sequence_parallel=sp, fp8=fp8,
                            pad_to=pad_to, pad_token_id=PAD_ID, vocab_size=VOCAB, host_reads=host_reads)
        assert packed.input_ids.tolist() == [expected["ids"]], host_reads
        assert packed.labels.tolist() == [expected["labels"]], host_reads
        assert packed.loss_mask.dtype == torch.float32
        assert packed.loss_mask.tolist() == [expected["weights"]], host_reads
        assert packed.position_ids.tolist() == [expected["positions"]], host_reads
        assert packed.padding_mask.tolist() == [expected["pad"]], host_reads
        params = packed.packed_seq_params
        assert params.cu_seqlens_q.tolist() == cu and params.cu_seqlens_q_padded.tolist() == cu_padded
        assert params.max_seqlen_q == max(b - a for a, b in zip(cu_padded, cu_padded[1:]))
        assert cu_padded[-1] % total == 0 and (pad_to is None or cu_padded[-1] == pad_to)
