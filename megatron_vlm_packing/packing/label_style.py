"""Labels given in the other style: Megatron (already shifted) labels declared "hf", or HF labels declared "megatron".

`label_style="hf"` shifts each sample's labels (its targets are labels[t+1]); `"megatron"` takes labels[t] as
the target of token t. Given the other style, training is silently wrong: Megatron labels shifted again train
token t on token t+2, HF labels taken as targets train the model to copy its input. Both styles are identities
between a sample's labels and its own ids, so the labels say which one they follow:

- HF (unshifted): labels[t] == input_ids[t]     (the token itself)
- Megatron:       labels[t] == input_ids[t+1]   (the next token of the same sample)

The rule (`mismatched_style`). Compared are the *pairs*: a label position t with labels[t] != -100 whose token
and the next one, t+1, are both real tokens of the same sample (document). A sample's last token is no pair
(its Megatron label is the next token of the text, which the batch does not hold, or -100), nor is a pad slot
or a -100 label (prompts, vision placeholders, masked spans). Each pair is one of

- own:     labels[t] == input_ids[t] != input_ids[t+1]     evidence for HF
- next:    labels[t] == input_ids[t+1] != input_ids[t]     evidence for Megatron
- both:    input_ids[t] == input_ids[t+1] == labels[t]     a repeated token: no evidence, not counted
- neither: labels[t] is neither token                      a custom target

and a set of pairs is refused exactly when the other style's evidence counts `MIN_EVIDENCE` (2) pairs or more
while the declared style's counts none and no pair is a custom target: every pair that can tell the styles
apart says "the other one", and no label is anything else. The micro-batch is refused when its pairs are, or
when the pairs of any one sample (a row, or a document of a pre-packed row with `document_lengths`) are on
their own: blended datasets whose sources collate differently put samples of both styles in one micro-batch,
where the declared samples' evidence hid the others (3 Megatron rows of 20/30/10 tokens beside an HF one of
15, declared "hf": 52 of 71 trained targets the token two ahead). Why each part:

- Correct labels never trip it: labels that follow the declared style hold its identity at every pair, so no
  pair is evidence for the other style (a tie is `both`). This is what the property test holds. It holds pair
  by pair, so it holds for every subset of the pairs, a sample's included: judging each sample on its own
  counts too adds no refusal of correctly-styled labels, and keeps every refusal of the whole micro-batch.
- Repeated tokens (a row that is all one id, placeholder runs) are `both`: they decide nothing either way.
- A single custom target anywhere (distillation targets, hand-edited labels: copies of neither) blocks the
  refusal: a label of neither style means the labels follow a convention of their own, which we leave alone.
- One pair of evidence is not enough: one hand-set target equal to the next token would look the same.
- One-token documents, documents whose labels are all -100, pad slots: no pairs, no evidence. (A one-token
  document's Megatron label is the next token of its text, which may repeat it: labels equal to such documents'
  ids prove nothing, and pass.)
- Megatron-Bridge's VLM collate functions give Megatron labels (`input_ids[1:]`, -100 at media tokens and where
  the loss mask is 0): under `label_style="hf"` they are refused.
- LLaVA's batches are read in collapsed space (one image token per image, its label the token after the
  image, or -100), where the rule reads them as any text; its expanded space never reaches the labels.

What cannot be told apart (and passes): a micro-batch none of whose samples, nor the whole, holds 2 evidence
pairs of the other style, none of the declared style and no custom target (a sample of the other style with a
custom target, or with a single telling pair, passes beside declared ones). No opt-out: labels of the declared
style never trip the rule, so there is nothing to opt out of.

Where it runs: `style_evidence_rows` on the device (rows are samples there: pre-packed rows are split into
their documents first), its 3 counts, the count of samples refused on their own and the first one's row read
with the real lengths in the one host sync (`checks.queue_value_checks`); `packed_style_mismatch` in numpy over
the packed tokens of a batch on the host (`pack_batch(host_reads=True)`, `PackingCollator`: no sync), settled
on clean batches by one pass finding the declared style's evidence in each document; the ValueError
(`refuse_mismatched_style`) is made on the host from the rows on the error path only, naming the sample (row,
or document of its row), its counts and the style to pass.

Shape legend: B = rows, S = row length, T = packed slots, N = documents.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100
# Pairs of evidence for the other style (with none for the declared one and no custom target) that refuse a batch.
MIN_EVIDENCE = 2


class StyleEvidence(NamedTuple):
    """Counts of a micro-batch's pairs (see the module docstring). `both` (repeated tokens) is not counted.

    Attributes:
        own: pairs whose label is its own token only (Hugging Face's identity).
        next: pairs whose label is the next token only (Megatron's identity).
        neither: pairs whose label is neither token (custom targets).
    """

    own: int
    next: int
    neither: int


def mismatched_style(evidence, label_style: str) -> bool:
    """True when `evidence` (a `StyleEvidence` or its 3 ints) refuses labels declared `label_style`: the other
    style's evidence is >= `MIN_EVIDENCE`, the declared one's is 0 and no pair is a custom target."""
    return bool(_mismatched_samples(*evidence, label_style))


def _mismatched_samples(own, nxt, neither, label_style: str):
    """The rule of `mismatched_style` over counts: ints -> bool, or each sample at once: [N] counts (torch or
    numpy) -> [N] bool."""
    declared, other = (own, nxt) if label_style == "hf" else (nxt, own)
    return (other >= MIN_EVIDENCE) & (declared == 0) & (neither == 0)


def style_evidence_rows(labels: torch.Tensor, input_ids: torch.Tensor, real: torch.Tensor,
                        label_style: str) -> torch.Tensor:
    """[5] long of right-padded rows, each row one sample (document): the micro-batch's (neither, own, next)
    (note the order: `evidence_of` makes a `StyleEvidence` of it), then how many rows `mismatched_style` refuses
    on their own counts and the first one's index (0 when none). No host read: 7 elementwise ops over [B, S-1],
    4 row sums, a few [B] ops (no `bincount`, which reads its input's range back on an accelerator; no
    `nonzero`: the first row is an `argmax`).

    Args:
        labels: [B, S] integer labels as given. input_ids: [B, S] integer ids.
        real: [B, S] bool, or a 0/1 integer mask: 1 at real tokens, right-padded (checked by the caller: a token
            followed by a real one is real itself, so a pair needs only the second).
        label_style: the declared style, "hf" or "megatron".
    """
    real = real if real.dtype == torch.bool else real != 0
    label = labels[:, :-1]
    pair = real[:, 1:] & (label != IGNORE_INDEX)
    own = (label == input_ids[:, :-1]) & pair
    nxt = label == input_ids[:, 1:]
    both = own & nxt
    nxt &= pair
    own_count, next_count, both_count, pairs = torch.stack([own.sum(1), nxt.sum(1), both.sum(1), pair.sum(1)])
    per_row = torch.stack([pairs - own_count - next_count + both_count, own_count - both_count,
                           next_count - both_count])  # [3, B]
    refused = _mismatched_samples(per_row[1], per_row[2], per_row[0], label_style)
    first = refused.long().argmax() if refused.numel() else refused.sum()
    return torch.cat([per_row.sum(1), torch.stack([refused.sum(), first])])


def evidence_of(counts) -> StyleEvidence:
    """`StyleEvidence` of `style_evidence_rows`' first 3 values (read on the host: a list, or the tensor)."""
    neither, own, nxt = (counts.tolist() if isinstance(counts, torch.Tensor) else counts)[:3]
    return StyleEvidence(own, nxt, neither)


def refused_by_counts(counts, label_style: str) -> bool:
    """The host test of `style_evidence_rows`' 5 values (read back): the micro-batch, or some sample on its own,
    is refused."""
    return mismatched_style(evidence_of(counts), label_style) or counts[3] > 0


def refuse_mismatched_style(labels: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor, label_style: str,
                            where: Callable[[int, int], str]) -> None:
    """The ValueError for rows whose labels follow the other style (`mismatched_style` of the micro-batch, or of
    one row on its own), naming the field, the style given, the counts and the first pair of evidence
    (`where(row, position)`); else returns. Reads the rows back: error paths only (the device path's read,
    `packed_style_mismatch`, decided to look).

    Args:
        labels, input_ids: [B, S] as given (each row one document). keep: [B, S] bool, True at real tokens.
    """
    label, pair = labels[:, :-1], keep[:, :-1] & keep[:, 1:] & (labels[:, :-1] != IGNORE_INDEX)
    own, nxt = (label == input_ids[:, :-1]) & pair, (label == input_ids[:, 1:]) & pair
    per_row = torch.stack([(own & ~nxt).sum(1), (nxt & ~own).sum(1), (pair & ~own & ~nxt).sum(1)])  # [3, B]
    evidence = StyleEvidence(*per_row.sum(1).tolist())
    refused_rows = torch.nonzero(_mismatched_samples(*per_row, label_style)).flatten().tolist()
    if not (mismatched_style(evidence, label_style) or refused_rows):
        return
    telling = own ^ nxt
    if not mismatched_style(evidence, label_style):  # one sample on its own: name it and its counts
        telling[torch.arange(len(telling)) != refused_rows[0]] = False
    row, t = torch.nonzero(telling)[0].tolist()
    example = (f"{where(row, t)}: label {int(labels[row, t])}, input_ids {int(input_ids[row, t])} there and "
               f"{int(input_ids[row, t + 1])} next")
    raise ValueError(_style_message(label_style, evidence, StyleEvidence(*per_row[:, row].tolist()), example,
                                    len(refused_rows), mismatched_style(evidence, label_style)))


def _style_message(label_style: str, evidence: StyleEvidence, sample: StyleEvidence, example: str,
                   samples: int, whole: bool) -> str:
    """`refuse_mismatched_style`'s message: the whole micro-batch's counts when it is refused as a whole, else
    the first refused sample's (`example` starts with its place), its counts and the micro-batch's."""
    hf = label_style == "hf"
    other, what, learns, fix = (
        ("already shifted (Megatron style)", "the next token input_ids[t+1], never its own input_ids[t]",
         "each token would learn the token two ahead", "megatron") if hf else
        ("like Hugging Face (unshifted) labels", "its own token input_ids[t], never the next one input_ids[t+1]",
         "the model would learn to copy the current token", "hf"))
    verb = "shifts them again" if hf else "takes them as next-token targets"
    if whole:
        count = evidence.next if hf else evidence.own
        return (f"labels look {other} but label_style=\"{label_style}\" {verb}: at all {count} real labels that "
                f"tell the styles apart (a token and the next one of its sample differ), the label is {what}, and no "
                f"label is a custom target (e.g. {example}); trained as given, {learns}. Pass label_style=\"{fix}\"")
    count = sample.next if hf else sample.own
    return (f"labels of one sample look {other} but label_style=\"{label_style}\" {verb}: {example}: {count} of its "
            f"real labels that tell the styles apart (a token and the next one differ) are {what}, and none is a "
            f"custom target (its counts: own {sample.own}, next {sample.next}, custom {sample.neither}; the "
            f"micro-batch's: own {evidence.own}, next {evidence.next}, custom {evidence.neither}; {samples} such "
            f"sample(s)); trained as given, {learns}. The samples of a micro-batch share one label_style: "
            f"Pass label_style=\"{fix}\" when every sample is in that style, else collate every source alike")


def document_starts_host(plan) -> tuple[np.ndarray, np.ndarray]:
    """([N] first slot, [N] real length) of each document of a pack plan, as int64 numpy."""
    physical = np.asarray(plan.physical_lengths, dtype=np.int64)
    starts = np.zeros(len(physical), dtype=np.int64)
    np.cumsum(physical[:-1], out=starts[1:])
    return starts, np.asarray(plan.real_lengths, dtype=np.int64)


def packed_style_mismatch(label_style: str, *, ids: np.ndarray, targets: np.ndarray, is_target: np.ndarray,
                          first_labels: np.ndarray | None, plan) -> bool:
    """`mismatched_style` of a pack's pairs, of the whole micro-batch or of any one document, counted in numpy
    over the packed tokens (a batch on the host).

    Labels of the declared style settle it in one pass over the T slots, as a DataLoader worker needs: a document
    holding one pair of the declared style's evidence cannot be refused on its own, nor then the micro-batch; a
    document of fewer than 3 tokens (under 2 pairs) neither. Only when some document is left are all its pairs
    counted (`packed_document_evidence`).

    Args:
        ids: [T] packed ids. targets: [T] packed next-token targets: the Megatron labels as given, or the
            Hugging Face labels shifted inside each document (-100 at pad slots and documents' last tokens).
        is_target: [T] bool, targets != -100.
        first_labels: Hugging Face only: [N] the label of every document's first token (no target holds it).
        plan: the `PackPlan` the tokens were packed by.
    """
    documents = document_starts_host(plan)
    hf = label_style == "hf"
    declared = _per_document(_declared_pairs(hf, ids, targets, is_target, *documents), documents[0], np.logical_or)
    if hf:
        declared |= _first_pair_kinds(first_labels, ids, *documents)[0] > 0
    if declared.any() and declared[documents[1] >= 3].all():
        return False
    per_document = packed_document_evidence(label_style, ids=ids, targets=targets, first_labels=first_labels,
                                            documents=documents)
    return (mismatched_style(per_document.sum(1).tolist(), label_style)
            or bool(_mismatched_samples(*per_document, label_style).any()))


def packed_style_evidence(label_style: str, *, ids: np.ndarray, targets: np.ndarray,
                          first_labels: np.ndarray | None, documents: tuple[np.ndarray, np.ndarray]) -> StyleEvidence:
    """`StyleEvidence` of a pack's pairs (arguments as `packed_style_mismatch`; `documents`:
    `document_starts_host(plan)`): the counts `style_evidence_rows` gives over the rows it was packed from."""
    return StyleEvidence(*packed_document_evidence(label_style, ids=ids, targets=targets, first_labels=first_labels,
                                                   documents=documents).sum(1).tolist())


def packed_document_evidence(label_style: str, *, ids: np.ndarray, targets: np.ndarray,
                             first_labels: np.ndarray | None, documents: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """[3, N] int64 (own, next, neither) of each document of a pack (arguments as `packed_style_evidence`)."""
    starts, lengths = documents
    kinds = _pair_kinds(label_style, ids, targets, targets != IGNORE_INDEX, starts, lengths)
    counts = np.stack([_per_document(kind, starts, np.add) for kind in kinds]).astype(np.int64)
    if label_style == "hf":  # each document's first pair: its first label, which no shifted target holds
        counts += np.stack(_first_pair_kinds(first_labels, ids, starts, lengths))
    return counts


def _declared_pairs(hf: bool, ids: np.ndarray, targets: np.ndarray, is_target: np.ndarray, starts: np.ndarray,
                    lengths: np.ndarray) -> np.ndarray:
    """`_pair_kinds`' mask of the declared style's evidence alone (own only for HF, next only for Megatron): 3
    passes over the T slots, not the 3 kinds' 7."""
    shift = int(hf)
    size = max(targets.size - 1 - shift, 0)
    labels = targets[:size]
    holds, other = (ids[shift:shift + size], ids[shift + 1:shift + 1 + size])[::1 if hf else -1]
    declared = np.equal(labels, holds)
    declared &= is_target[:size]
    declared &= np.not_equal(labels, other)
    declared[_crossing_slots(shift, size, starts, lengths)] = False
    return declared


def _crossing_slots(shift: int, size: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The slots (< size) whose target is the label of a document's last token: its pair would cross."""
    last = starts + lengths - 1 - shift
    return last[(lengths > shift) & (last < size) & (last >= 0)]


def _pair_kinds(label_style: str, ids: np.ndarray, targets: np.ndarray, is_target: np.ndarray, starts: np.ndarray,
                lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[size] bool masks (own only, next only, neither) of the pairs the packed targets hold, slot by slot.

    Megatron: target u is the label of token u; its pair is (ids[u], ids[u+1]), unless u is its document's last
    real token. HF: target u is the label of token u+1 (shifted); its pair is (ids[u+1], ids[u+2]), unless u+1 is
    its document's last real token. Pad slots and the last target of a document hold -100 (not a pair); the
    slots whose pair crosses into the next document are cleared (N values written). Each mask lies inside its
    document's slots [start, next start), so `_per_document` adds it up by document."""
    shift = 1 if label_style == "hf" else 0
    size = max(targets.size - 1 - shift, 0)
    labels, real = targets[:size], is_target[:size]
    own_holds, next_holds = np.equal(labels, ids[shift:shift + size]), np.equal(labels, ids[shift + 1:shift + 1 + size])
    own = own_holds & ~next_holds
    own &= real
    nxt = next_holds & ~own_holds
    nxt &= real
    neither = real & ~(own_holds | next_holds)
    last = _crossing_slots(shift, size, starts, lengths)
    for kind in (own, nxt, neither):
        kind[last] = False
    return own, nxt, neither


def _per_document(mask: np.ndarray, starts: np.ndarray, reduce) -> np.ndarray:
    """[N] `reduce` (np.add: counts, np.logical_or: any) of `mask` over each document's slots [start, next start)."""
    out = np.zeros(len(starts), dtype=np.int64 if reduce is np.add else bool)
    inside = starts < mask.size
    if inside.any():
        out[inside] = reduce.reduceat(mask, starts[inside])
        empty = np.diff(starts, append=max(mask.size, int(starts[-1]))) <= 0  # reduceat gives such a one a slot
        out[empty] = 0
    return out


def _first_pair_kinds(first_labels: np.ndarray, ids: np.ndarray, starts: np.ndarray,
                      lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N] int64 (own only, next only, neither) of each document's first pair under HF: its first label (which no
    shifted target holds) with its first two ids; 0 for a document of one token."""
    opened = lengths >= 2
    label = np.where(opened, first_labels, IGNORE_INDEX)
    first, second = ids[np.where(opened, starts, 0)], ids[np.where(opened, starts + 1, 0)]
    real = label != IGNORE_INDEX
    own_holds, next_holds = label == first, label == second
    return ((own_holds & ~next_holds & real).astype(np.int64), (next_holds & ~own_holds & real).astype(np.int64),
            (real & ~(own_holds | next_holds)).astype(np.int64))
