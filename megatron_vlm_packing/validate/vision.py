"""Image / video / audio placeholders against their grids and lengths, document by document (contract item 10).

Each image (video) takes `t*h*w / merge**2` placeholder tokens, each audio clip
`rope.omni.audio_tokens_per_clip(audio_seqlens, n_window)`. Items are assigned to documents in
order: by the given per-document counts, else greedily (consecutive items filling each document's
placeholders exactly); a document whose placeholders no run of items fills is named. A Qwen3-VL video
puts each frame in its own block (timestamp text between), so its runs may end at any frame. A Qwen3-Omni
video with its audio track holds both kinds in one block (interleaved by time): video and audio
placeholders bridge each other's runs there.

Shape legend: N = documents, I = images (or videos, or audio clips), A = audio clips.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_vlm_packing.packing.checks import is_integer_tensor
from megatron_vlm_packing.validate.documents import Documents
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation


def _tokens_per_item(grid: torch.Tensor, merge: int, kind: str) -> tuple[list[int], str | None]:
    """Placeholder tokens of each grid row (t*h*w / merge**2), or the problem with the grid."""
    if grid.dim() != 2 or grid.shape[1] != 3:
        return [], f"{kind}_grid_thw must be [{kind[0].upper()}, 3], got {tuple(grid.shape)}"
    if not is_integer_tensor(grid):  # .long() read 2.5 as 2; the vision tower and the index take integer grids
        return [], f"{kind}_grid_thw must be [{kind[0].upper()}, 3] integers, got dtype {grid.dtype}"
    rows = grid.long().tolist()
    bad = [i for i, (t, h, w) in enumerate(rows) if min(t, h, w) < 1 or (h % merge) or (w % merge)]
    if bad:
        return [], f"{kind}_grid_thw rows {[(i, rows[i]) for i in bad[:4]]} are not positive multiples of merge {merge}"
    return [t * h * w // (merge * merge) for t, h, w in rows], None


def _audio_tokens_per_clip(inputs: PackedInputs) -> tuple[list[int], str | None]:
    """Placeholder tokens of each `audio_seqlens` clip (`rope.omni.audio_tokens_per_clip`), or the problem."""
    from megatron_vlm_packing.rope.omni import audio_tokens_per_clip

    lengths = inputs.audio_seqlens
    if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
        return [], f"audio_seqlens must be [A] integer raw lengths, got {tuple(lengths.shape)} {lengths.dtype}"
    raw = lengths.long().tolist()
    clips = audio_tokens_per_clip(raw, inputs.audio_n_window or 50)
    if clips.empty:
        return [], f"audio_seqlens entries {[(i, raw[i]) for i in clips.empty[:4]]} are < 1: such a clip has no " \
                   f"encoder output"
    return clips.tokens, None


def _runs(is_ph: torch.Tensor, docs: Documents, bridge: torch.Tensor | None = None) -> list[list[int]]:
    """Placeholder counts of the contiguous runs of every document, in order; slots in `bridge`
    (the other kind of an audio-in-video block) continue a run without counting."""
    runs: list[list[int]] = [[] for _ in range(docs.num_documents)]
    either = is_ph if bridge is None else is_ph | bridge
    slots = either.nonzero().flatten().tolist()
    prev = None
    for slot in slots:
        d, counted = int(docs.doc_of_slot[slot]), int(is_ph[slot])
        if prev is not None and slot == prev + 1 and int(docs.doc_of_slot[prev]) == d:
            runs[d][-1] += counted
        else:
            runs[d].append(counted)
        prev = slot
    return [[n for n in doc if n] for doc in runs]


def _fits(runs: list[int], sizes: list[int]) -> bool:
    """Every run ends where an item ends (items may share a run when nothing separates them)."""
    ends, total = set(), 0
    for n in sizes:
        total += n
        ends.add(total)
    total = 0
    for n in runs:
        total += n
        if total not in ends:
            return False
    return True


def _assign(counts: list[int], sizes: list[int], per_doc: tuple[int, ...] | None,
            runs: list[list[int]], pieces: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Items per document, and the documents whose placeholder runs the items do not fill exactly
    (pieces[i]: item i's tokens as the blocks it may be laid out in, e.g. one per Qwen3-VL frame)."""
    items, bad, j = [], [], 0
    for d, need in enumerate(counts):
        take, total = [], 0
        if per_doc is not None:
            take = list(range(j, min(j + per_doc[d], len(sizes)))) if d < len(per_doc) else []
            total = sum(sizes[i] for i in take)
        else:
            while j + len(take) < len(sizes) and total < need:
                total += sizes[j + len(take)]
                take.append(j + len(take))
        j += len(take)
        items.append(take)
        if total != need or not _fits(runs[d], [n for i in take for n in pieces[i]]):
            bad.append(d)
    return items, bad


def _frames_apart(inputs: PackedInputs, kind: str) -> bool:
    """Whether a video's frames may be separate blocks: Qwen3-VL's layout, told by the `MRopeConfig`'s
    family; without one (or with the model's index callable) allowed, as either layout is some model's."""
    from megatron_vlm_packing.rope import MRopeConfig

    return kind == "video" and (not isinstance(inputs.mrope, MRopeConfig) or inputs.mrope.family == "qwen3_vl")


_OTHER = {"video": "audio", "audio": "video"}  # the kinds an audio-in-video block interleaves


def _item_sizes(inputs: PackedInputs, kind: str) -> tuple[list[int] | None, str | None, str]:
    """(placeholder tokens per item, or None when the kind's input is absent; a problem; the input's name)."""
    if kind == "audio":
        if inputs.audio_seqlens is None:
            return None, None, "audio_seqlens"
        return (*_audio_tokens_per_clip(inputs), "audio_seqlens")  # [] for no clips: placeholders then fail
    grid = getattr(inputs, f"{kind}_grid_thw")
    if grid is None or grid.numel() == 0:
        return None, None, f"{kind}_grid_thw"
    return (*_tokens_per_item(grid, inputs.spatial_merge_size, kind), f"{kind}_grid_thw")


class Placeholders(NamedTuple):
    """One kind's placeholder slots, counted once (`count_placeholders`) for its check and the audio decision.

    Attributes:
        is_placeholder: [T] bool, the slots holding the kind's placeholder id.
        counts: N ints, placeholders at each document's real slots.
        on_pads: [P] long, the pad slots holding one.
    """

    is_placeholder: torch.Tensor
    counts: list[int]
    on_pads: torch.Tensor


def count_placeholders(inputs: PackedInputs, docs: Documents, token_id: int) -> Placeholders:
    """The placeholders of `token_id` in `inputs`, per document of `docs`."""
    is_ph = inputs.input_ids == token_id
    real = docs.is_real
    counts = torch.bincount(docs.doc_of_slot[is_ph & real], minlength=docs.num_documents).tolist()
    return Placeholders(is_ph, counts, (is_ph & ~real).nonzero().flatten())


class AudioCoverage(NamedTuple):
    """Whether audio placeholders were checked against `audio_seqlens`, decided once (`audio_coverage`) for
    the report and for the comparison with the model's index.

    Attributes:
        checked: the placeholders were compared with `audio_seqlens` (audio_placeholders ran).
        skip: why audio_placeholders did not run, or None (it ran, or nothing about audio was given).
        unchecked: {document: why the model's index cannot be asked about its audio}.
    """

    checked: bool
    skip: str | None
    unchecked: dict[int, str]


def audio_coverage(inputs: PackedInputs, docs: Documents, audio: Placeholders | None) -> AudioCoverage:
    """`AudioCoverage` of `inputs`: `audio` holds the audio placeholders counted (None without an audio_token_id).
    Placeholders with no `audio_seqlens` fail no check (the lengths are what they are checked with): they are
    reported as not checked, here and by the index, never passed."""
    if audio is None:
        if inputs.audio_seqlens is None:
            return AudioCoverage(False, None, {})
        why = "audio_seqlens given but no audio_token_id"
        if not inputs.audio_seqlens.numel():
            return AudioCoverage(False, why, {})
        split = f"{why}: the clips cannot be split per document"
        return AudioCoverage(False, why, {d: split for d in range(docs.num_documents) if docs.real[d]})
    if inputs.audio_seqlens is not None:  # split per document (or, not fitting, named by audio_placeholders)
        return AudioCoverage(True, None, {})
    if not sum(audio.counts) and not audio.on_pads.numel():
        return AudioCoverage(False, None, {})
    why = "audio placeholders but no audio_seqlens given"
    return AudioCoverage(False, "no audio_seqlens given", {d: why for d, n in enumerate(audio.counts) if n})


def check_kind(inputs: PackedInputs, docs: Documents, kind: str,
               placeholders: Placeholders | None) -> tuple[list[Violation], list[list[int]] | None, set[int]]:
    """Returns violations, items per document (None when unchecked) and the documents that failed;
    `placeholders`: the kind's (`count_placeholders`), None without its id. Audio placeholders with no
    audio_seqlens given fail nothing (`audio_coverage` says they were not checked)."""
    token_id = getattr(inputs, f"{kind}_token_id")
    per_doc = getattr(inputs, f"{kind}s_per_document")
    check = "audio_placeholders" if kind == "audio" else "vision_placeholders"
    if placeholders is None:
        return [], None, set()
    is_ph, counts, on_pads = placeholders
    real = docs.is_real
    out = []
    if on_pads.numel():
        out.append(Violation(check, f"{on_pads.numel()} {kind} placeholders (id {token_id}) on pad "
                             f"slots, e.g. {on_pads[:8].tolist()}", tuple(docs.doc_of_slot[on_pads].unique().tolist())))
    sizes, problem, source = _item_sizes(inputs, kind)
    if sizes is None and problem is None:
        docs_with = tuple(d for d, c in enumerate(counts) if c)
        if kind == "audio":  # `audio_coverage` reports them as not checked
            return out, [[] for _ in counts], set()
        if docs_with:
            out.append(Violation(check, f"{sum(counts)} {kind} placeholders but no {source}", docs_with))
        return out, [[] for _ in counts], set(docs_with)
    if problem:
        return out + [Violation(check, problem)], None, set(range(docs.num_documents))
    if per_doc is not None and (len(per_doc) != docs.num_documents or sum(per_doc) != len(sizes)):
        out.append(Violation(check, f"{kind}s_per_document {list(per_doc)[:8]} does not fit "
                             f"{docs.num_documents} documents and {len(sizes)} {kind}s"))
        return out, None, set(range(docs.num_documents))
    if sum(counts) != sum(sizes):
        out.append(Violation(check, f"{sum(counts)} {kind} placeholders (id {token_id}) in real "
                             f"tokens but the {len(sizes)} {source} entries need {sum(sizes)} ({sizes[:8]})"))
    other = getattr(inputs, f"{_OTHER[kind]}_token_id", None) if kind in _OTHER else None
    runs = _runs(is_ph & real, docs, None if other is None else (inputs.input_ids == other) & real)
    pieces = [[n] for n in sizes]
    if _frames_apart(inputs, kind):  # t frames of h*w / merge**2 tokens each
        pieces = [[n // t] * t for n, t in zip(sizes, inputs.video_grid_thw[:, 0].long().tolist())]
    items, bad = _assign(counts, sizes, per_doc, runs, pieces)
    if bad and sum(counts) == sum(sizes):
        detail = [(d, runs[d], [sizes[i] for i in items[d]]) for d in bad[:6]]
        out.append(Violation(check, f"placeholder runs per document do not match consecutive {source} "
                             f"entries: (document, placeholder runs, tokens assigned) {detail}", tuple(bad)))
    return out, items, set(bad) if bad else set()


class MediaFindings(NamedTuple):
    """What `check_vision` found: `violations`; `items`, {kind: items per document, or None when unchecked};
    the `failed` documents; and the `audio` coverage."""

    violations: list[Violation]
    items: dict
    failed: set[int]
    audio: AudioCoverage


def check_vision(inputs: PackedInputs, docs: Documents) -> MediaFindings:
    """Every kind: image, video and audio placeholders against their grids and lengths."""
    out, items, failed, counted = [], {}, set(), {}
    for kind in ("image", "video", "audio"):
        token_id = getattr(inputs, f"{kind}_token_id")
        counted[kind] = None if token_id is None else count_placeholders(inputs, docs, token_id)
        v, per_doc, bad = check_kind(inputs, docs, kind, counted[kind])
        out += v
        failed |= bad
        if v and not bad:  # a total mismatch: no document can be trusted
            failed |= set(range(docs.num_documents))
        items[kind] = per_doc
    seconds, grid = inputs.second_per_grid_ts, inputs.video_grid_thw
    videos = 0 if grid is None or grid.dim() != 2 else grid.shape[0]
    if seconds is not None and seconds.numel() != videos:  # each video's index call takes its own entry
        with_videos = {d for d, taken in enumerate(items["video"] or []) if taken} if videos else set()
        out.append(Violation("vision_placeholders", f"second_per_grid_ts has {seconds.numel()} entries for "
                             f"{videos} videos in video_grid_thw: one per video", tuple(sorted(with_videos))))
        failed |= with_videos if items["video"] is not None else set(range(docs.num_documents))
    return MediaFindings(out, items, failed, audio_coverage(inputs, docs, counted["audio"]))
