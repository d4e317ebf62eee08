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

and the micro-batch is refused exactly when the other style's evidence counts `MIN_EVIDENCE` (2) pairs or more
while the declared style's counts none and no pair is a custom target: every pair that can tell the styles
apart says "the other one", and no label is anything else. Why each part:

- Correct labels never trip it: labels that follow the declared style hold its identity at every pair, so no
  pair is evidence for the other style (a tie is `both`). This is what the property test holds.
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

What cannot be told apart (and passes): a micro-batch with fewer than 2 evidence pairs, or with some custom
target. No opt-out: labels of the declared style never trip the rule, so there is nothing to opt out of.

Where it runs: `style_evidence_rows` on the device, its 3 counts read with the real lengths in the one host
sync (`checks.queue_value_checks`); `packed_style_mismatch` in numpy over the packed tokens of a batch on the
host (`pack_batch(host_reads=True)`, `PackingCollator`: no sync); the ValueError (`refuse_mismatched_style`)
is made on the host from the rows on the error path only.

Shape legend: B = rows, S = row length, T = packed slots, N = documents.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100
# Pairs of evidence for the other style (with none for the declared one and no custom target) that refuse a batch.
MIN_EVIDENCE = 2
# Packed slots where `packed_style_mismatch` first looks for the declared style's evidence: found there (the
# common case, labels of the declared style), no pass over all T slots is needed.
HEAD_SLOTS = 4096


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
    own, nxt, neither = evidence
    declared, other = (own, nxt) if label_style == "hf" else (nxt, own)
    return other >= MIN_EVIDENCE and declared == 0 and neither == 0


def style_evidence_rows(labels: torch.Tensor, input_ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[3] long (neither, own, next) of right-padded rows, each row one document (note the order: `evidence_of`
    makes a `StyleEvidence` of it). No host read: 7 elementwise ops over [B, S-1] and 4 sums (no `bincount`,
    which reads its input's range back on an accelerator; one [B, S-1] kind compared 3 times, or a one-hot,
    took 1.7x to 2.5x as long on the CPU at 16 x 8192).

    Args:
        labels: [B, S] integer labels as given. input_ids: [B, S] integer ids.
        real: [B, S] bool, or a 0/1 integer mask: 1 at real tokens, right-padded (checked by the caller: a token
            followed by a real one is real itself, so a pair needs only the second).
    """
    real = real if real.dtype == torch.bool else real != 0
    label = labels[:, :-1]
    pair = real[:, 1:] & (label != IGNORE_INDEX)
    own = (label == input_ids[:, :-1]) & pair
    nxt = label == input_ids[:, 1:]
    both = own & nxt
    nxt &= pair
    own_count, next_count, both_count, pairs = torch.stack([own.sum(), nxt.sum(), both.sum(), pair.sum()]).unbind()
    return torch.stack([pairs - own_count - next_count + both_count, own_count - both_count, next_count - both_count])


def evidence_of(counts) -> StyleEvidence:
    """`StyleEvidence` of `style_evidence_rows`' 3 values (read on the host: a list, or the tensor itself)."""
    neither, own, nxt = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    return StyleEvidence(own, nxt, neither)


def refuse_mismatched_style(labels: torch.Tensor, input_ids: torch.Tensor, keep: torch.Tensor, label_style: str,
                            where: Callable[[int, int], str]) -> None:
    """The ValueError for rows whose labels follow the other style (`mismatched_style`), naming the field, the
    style given, the counts and the first pair of evidence (`where(row, position)`); else returns. Reads the
    rows back: error paths only (the device path's read, `packed_style_mismatch`, decided to look).

    Args:
        labels, input_ids: [B, S] as given (each row one document). keep: [B, S] bool, True at real tokens.
    """
    evidence = evidence_of(style_evidence_rows(labels, input_ids, keep))
    if not mismatched_style(evidence, label_style):
        return
    label, pair = labels[:, :-1], keep[:, :-1] & keep[:, 1:] & (labels[:, :-1] != IGNORE_INDEX)
    own, nxt = label == input_ids[:, :-1], label == input_ids[:, 1:]
    row, t = torch.nonzero(pair & (own ^ nxt))[0].tolist()
    example = (f"{where(row, t)}: label {int(labels[row, t])}, input_ids {int(input_ids[row, t])} there and "
               f"{int(input_ids[row, t + 1])} next")
    if label_style == "hf":
        raise ValueError(
            f"labels look already shifted (Megatron style) but label_style=\"hf\" shifts them again: at all "
            f"{evidence.next} real labels that tell the styles apart (a token and the next one of its sample "
            f"differ), the label is the next token input_ids[t+1], never its own input_ids[t], and no label is a "
            f"custom target (e.g. {example}); trained as given, each token would learn the token two ahead. "
            f"Pass label_style=\"megatron\"")
    raise ValueError(
        f"labels look like Hugging Face (unshifted) labels but label_style=\"megatron\" takes them as next-token "
        f"targets: at all {evidence.own} real labels that tell the styles apart (a token and the next one of its "
        f"sample differ), the label is its own token input_ids[t], never the next one input_ids[t+1], and no label "
        f"is a custom target (e.g. {example}); trained as given, the model would learn to copy the current token. "
        f"Pass label_style=\"hf\"")


def document_starts_host(plan) -> tuple[np.ndarray, np.ndarray]:
    """([N] first slot, [N] real length) of each document of a pack plan, as int64 numpy."""
    physical = np.asarray(plan.physical_lengths, dtype=np.int64)
    starts = np.zeros(len(physical), dtype=np.int64)
    np.cumsum(physical[:-1], out=starts[1:])
    return starts, np.asarray(plan.real_lengths, dtype=np.int64)


def packed_style_mismatch(label_style: str, *, ids: np.ndarray, targets: np.ndarray, is_target: np.ndarray,
                          first_labels: np.ndarray | None, plan) -> bool:
    """`mismatched_style` of a pack's pairs, counted in numpy over the packed tokens (a batch on the host).

    Labels of the declared style settle it at once, as a DataLoader worker needs (each numpy call costs
    microseconds there, cold): the first target of the first document, when it is the declared style's evidence
    (a few scalar reads); else that evidence anywhere in the first `HEAD_SLOTS` slots; else every pair is counted
    (`packed_style_evidence`).

    Args:
        ids: [T] packed ids. targets: [T] packed next-token targets: the Megatron labels as given, or the
            Hugging Face labels shifted inside each document (-100 at pad slots and documents' last tokens).
        is_target: [T] bool, targets != -100.
        first_labels: Hugging Face only: [N] the label of every document's first token (no target holds it).
        plan: the `PackPlan` the tokens were packed by.
    """
    hf = label_style == "hf"
    shift = int(hf)  # HF: target u is the label of token u + 1
    first_pairs = min(plan.real_lengths[0] - 1 - shift, HEAD_SLOTS)  # targets of document 0 whose token has a next
    if first_pairs > 0:
        u = int(is_target[:first_pairs].argmax())
        label = targets[u]
        if is_target[u] and (label == ids[u + shift]) == hf and (label == ids[u + shift + 1]) != hf:
            return False
    documents = document_starts_host(plan)
    head = _pair_evidence(label_style, ids[:HEAD_SLOTS + 2], targets[:HEAD_SLOTS + 2], *documents)
    if head[0 if hf else 1]:
        return False
    return mismatched_style(packed_style_evidence(label_style, ids=ids, targets=targets, first_labels=first_labels,
                                                  documents=documents), label_style)


def packed_style_evidence(label_style: str, *, ids: np.ndarray, targets: np.ndarray,
                          first_labels: np.ndarray | None, documents: tuple[np.ndarray, np.ndarray]) -> StyleEvidence:
    """`StyleEvidence` of a pack's pairs (arguments as `packed_style_mismatch`; `documents`:
    `document_starts_host(plan)`): the counts `style_evidence_rows` gives over the rows it was packed from."""
    starts, lengths = documents
    own, nxt, neither = _pair_evidence(label_style, ids, targets, starts, lengths)
    if label_style == "hf":  # each document's first pair: its first label, which no shifted target holds
        opened = lengths >= 2
        first = _evidence(first_labels[opened], ids[starts[opened]], ids[starts[opened] + 1])
        own, nxt, neither = own + first[0], nxt + first[1], neither + first[2]
    return StyleEvidence(own, nxt, neither)


def _pair_evidence(label_style: str, ids: np.ndarray, targets: np.ndarray, starts: np.ndarray,
                   lengths: np.ndarray) -> tuple[int, int, int]:
    """Evidence of the pairs a packed target holds, over `ids` / `targets` (the pack, or a prefix of it).

    Megatron: target u is the label of token u; its pair is (ids[u], ids[u+1]), unless u is its document's last
    real token. HF: target u is the label of token u+1 (shifted); its pair is (ids[u+1], ids[u+2]), unless u+1 is
    its document's last real token. Pad slots and the last target of a document hold -100. The pairs at those
    excluded slots are counted over all slots, then taken off (N values gathered, no [T] copy)."""
    shift = 1 if label_style == "hf" else 0
    size = targets.size - 1 - shift
    if size <= 0:
        return 0, 0, 0
    labels = targets[:size]
    counts = _evidence(labels, ids[shift:shift + size], ids[shift + 1:shift + 1 + size])
    last = starts + lengths - 1 - shift  # the slot whose target is the label of a document's last token
    last = last[(lengths > shift) & (last < size)]
    excluded = _evidence(labels[last], ids[last + shift], ids[last + shift + 1])
    return counts[0] - excluded[0], counts[1] - excluded[1], counts[2] - excluded[2]


def _evidence(labels: np.ndarray, own_ids: np.ndarray, next_ids: np.ndarray) -> tuple[int, int, int]:
    """(own, next, neither) of aligned labels and the two tokens each is compared with; -100 labels skipped."""
    real = labels != IGNORE_INDEX
    own = np.equal(labels, own_ids)
    own &= real
    nxt = np.equal(labels, next_ids)
    nxt &= real
    own_count, next_count = int(np.count_nonzero(own)), int(np.count_nonzero(nxt))
    both = int(np.count_nonzero(own & nxt))
    pairs = int(np.count_nonzero(real))
    return own_count - both, next_count - both, pairs - own_count - next_count + both
