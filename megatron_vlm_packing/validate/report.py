"""The validator's report: one `Violation` per broken rule, each tied to the contract / bug class.

Contract items and bug classes are numbered as in docs/architecture.md (the packing contract and
the bug classes this package exists to end).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One rule the validator checks.

    Attributes:
        name: short stable id (what tests and the CLI print).
        contract_item: the packing-contract item it enforces (1-10), or None (a finding about what the
            validator was given, e.g. a broken mrope index, not about the pack).
        bug_class: the bug class its failure is (1-14), or None when it is a contract break only.
        title: one line saying what went wrong.
    """

    name: str
    contract_item: int | None
    bug_class: int | None
    title: str


CHECKS: dict[str, Check] = {c.name: c for c in (
    Check("malformed_boundaries", 10, None, "cu_seqlens not [N+1] ints from 0, or negative / non-monotonic"),
    Check("zero_length_segment", 2, None, "a document with no tokens (pad slots must not make segments)"),
    Check("real_vs_padded", 2, None, "real and physical boundary sets inconsistent"),
    Check("max_seqlen", 2, None, "max_seqlen missing, not an int, or shorter than a document"),
    Check("alignment", 2, None, "lengths not aligned for the given TP / CP / SP / FP8 layout"),
    Check("uniform_boundaries", 2, 4, "real boundaries include pad slots: attention pays for every pad"),
    Check("padding_mask", 4, None, "padding mask differs from the pad slots the boundaries imply"),
    Check("padding_from_token_values", 4, 7, "real tokens masked as padding where they hold the pad id"),
    Check("positions_restart", 3, None, "positions do not restart at 0 in every document"),
    Check("mrope_channels_identical", 3, 1, "1D positions copied to 3 mRoPE channels on a document with vision tokens"),
    Check("mrope_positions", 3, None, "mRoPE positions differ from the model's get_rope_index for the sample alone"),
    Check("mrope_index", None, None, "the mrope index given raised, or gave other than [3, 1, L] positions: the "
                                     "documents it failed on are not checked"),
    Check("labels_cross_documents", 1, 8, "a document's last token is trained on the token after it in the pack "
                                           "(the next document's first, or a pad), not its sample's own target"),
    Check("loss_on_pad", 1, None, "loss weight on pad slots"),
    Check("loss_weights", 9, None, "loss weights not finite or negative: the loss sum is NaN / inf or trains away"),
    Check("loss_without_target", 1, None, "a real slot trained whose label is the ignore index or negative"),
    Check("labels_vs_source", 1, None, "labels / loss mask differ from the source sample's, shifted inside it"),
    Check("tokens_vs_source", 1, 9, "a source sample dropped, truncated or altered in the pack"),
    Check("vision_placeholders", 10, None, "image / video placeholders do not match the grids per document"),
    Check("audio_placeholders", 10, None, "audio placeholders do not match audio_seqlens per document"),
    Check("cp_partition", 5, None, "a CP rank's tokens are not TransformerEngine's per-document zigzag"),
    Check("shapes", 10, None, "tensor shapes do not agree with each other"),
    Check("dtypes", 10, None, "token ids, labels or 1D positions are not integers, the padding mask is not bool, or "
                              "mRoPE positions are in a float dtype that changes them (the rotary reads float32)"),
)}


@dataclass(frozen=True)
class Violation:
    """One broken rule.

    Attributes:
        check: a key of `CHECKS`.
        message: what was found, with the numbers.
        documents: indices of the offending documents (packed order), empty when not per document.
    """

    check: str
    message: str
    documents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"unknown check {self.check!r}; known: {sorted(CHECKS)}")

    @property
    def contract_item(self) -> int | None:
        return CHECKS[self.check].contract_item

    @property
    def bug_class(self) -> int | None:
        return CHECKS[self.check].bug_class

    def __str__(self) -> str:
        tags = [f"contract {self.contract_item}"] if self.contract_item else []
        if self.bug_class:
            tags.append(f"bug class {self.bug_class}")
        docs = f" documents {list(self.documents)[:16]}{' ...' if len(self.documents) > 16 else ''}:" \
            if self.documents else ""
        tagged = f" ({', '.join(tags)})" if tags else ""
        return f"[{self.check}]{tagged} {CHECKS[self.check].title}.{docs} {self.message}"


@dataclass(frozen=True)
class ValidationReport:
    """What `validate_packed_batch` found.

    Attributes:
        violations: every broken rule, in check order.
        num_documents: documents the boundaries define (0 when they could not be read).
        num_tokens: T, physical slots.
        num_real_tokens: real tokens the boundaries count.
        checked: names of the checks that had the inputs they need and ran.
        skipped: (check, reason) for checks that could not run on the given inputs.
    """

    violations: tuple[Violation, ...]
    num_documents: int
    num_tokens: int
    num_real_tokens: int
    checked: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def bug_classes(self) -> frozenset[int]:
        return frozenset(v.bug_class for v in self.violations if v.bug_class)

    @property
    def failed_checks(self) -> frozenset[str]:
        return frozenset(v.check for v in self.violations)

    def __str__(self) -> str:
        head = (f"packed batch: {self.num_documents} documents, {self.num_real_tokens} real tokens in "
                f"{self.num_tokens} slots")
        if self.ok:
            lines = [f"{head}: OK ({len(self.checked)} checks passed)"]
        else:
            lines = [f"{head}: {len(self.violations)} violation(s)"] + [f"  {v}" for v in self.violations]
        lines += [f"  not checked: {name} ({reason})" for name, reason in self.skipped]
        return "\n".join(lines)
