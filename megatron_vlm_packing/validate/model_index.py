"""mRoPE positions of every document against the model's own index for that sample alone (contract item 3).

Each document is given its own inputs, split by `validate.vision` (which items each document
holds): image and video grids, seconds per video grid step (Qwen2.5-VL, Qwen3-Omni), and audio
lengths (Qwen3-Omni `audio_seqlens`; `use_audio_in_video` is told per document by an audio
placeholder next to a video one, unless given). A document the index cannot be asked about (audio
placeholders with no audio lengths, videos with no seconds for an index that scales time by them, or an
input the index callable takes under no name) is returned as unchecked with the reason, never passed.

Shape legend: T = physical packed slots, L = one document's real tokens.
"""

from __future__ import annotations

import inspect

import torch

from megatron_vlm_packing.packing.positions import HALF_EXACT_WHOLE_NUMBERS, seconds_parameter
from megatron_vlm_packing.validate.documents import Documents
from megatron_vlm_packing.validate.packed_inputs import PackedInputs
from megatron_vlm_packing.validate.report import Violation

_ITEMS = (("image", "image_grid_thw"), ("video", "video_grid_thw"), ("audio", "audio_seqlens"))


def _parameters(mrope) -> dict | None:
    """The index callable's parameters by name, or None when it has no signature to read (a builtin or
    extension callable: inspect raises ValueError or TypeError); it is then given every input."""
    try:
        return inspect.signature(mrope).parameters
    except (TypeError, ValueError):
        return None


def _callable_kwargs(params: dict | None, kwargs: dict) -> tuple[dict, list[str]]:
    """The inputs an index callable with parameters `params` (`_parameters`) takes by name (all of them with
    **kwargs); seconds go as `second_per_grid_ts` or `second_per_grids` (transformers' Qwen3-Omni name); one
    whose signature cannot be read is given them all. Returns (kwargs, the given inputs it takes under no name;
    `use_audio_in_video` is never one: the tokens tell it)."""
    if _takes_any(params):
        return kwargs, []
    out, unread = {}, []
    for name, value in kwargs.items():
        if name == "second_per_grid_ts" and seconds_parameter(params) != name:
            out[seconds_parameter(params)] = value
        elif name in params:
            out[name] = value
        elif name != "use_audio_in_video":
            unread.append(name)
    return out, unread


def _ask_index(inputs: PackedInputs, ids: torch.Tensor, kwargs: dict, params: dict | None):
    """What the model's index (`MRopeConfig` or callable, whose parameters are `params`) returns for one sample
    alone, ids: [L] (every token real), as it returns it: a tensor, a tuple, or anything a callable gives."""
    mrope = inputs.mrope
    if not callable(mrope):
        from megatron_vlm_packing.rope import get_rope_index

        return get_rope_index(ids[None], mrope, **kwargs)
    if "attention_mask" in (params or ()):  # the sample alone: every token real
        kwargs = {**kwargs, "attention_mask": torch.ones_like(ids[None])}
    if "mm_token_type_ids" in (params or ()):  # transformers 5 requires them: it was a TypeError
        from megatron_vlm_packing.rope.index import placeholder_types

        kwargs = {**kwargs, "mm_token_type_ids": placeholder_types(ids, inputs.image_token_id,
                                                                   inputs.video_token_id)[None]}
    return mrope(ids[None], **kwargs)


def _positions_in(result, length: int) -> torch.Tensor | str:
    """The [3, L] positions in what an index returned (its first element when a tuple: transformers returns
    (positions, deltas)), or why there are none: the message naming what it gave instead."""
    result = result[0] if isinstance(result, tuple) and result else result
    if not isinstance(result, torch.Tensor) or result.numel() != 3 * length:  # a [3, 1, 1] broadcast silently
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        return f"gave {got} for {length} tokens, not [3, 1, {length}] positions"
    return result.reshape(3, -1)


def _expected_positions(inputs: PackedInputs, ids: torch.Tensor, kwargs: dict,
                        params: dict | None) -> torch.Tensor | str:
    """ids: [L] -> [3, L] positions of one sample alone from the model's index, or why it gave none: what a callable
    raised (of any type: transformers' get_rope_index raises IndexError / RuntimeError) or gave instead.

    Raises:
        ValueError: our own index (`MRopeConfig`) refuses the sample; anything else it raises is our bug, left to
            surface.
    """
    try:
        result = _ask_index(inputs, ids, kwargs, params)
    except Exception as err:  # noqa: BLE001 - the user's callable, whatever it raises, is reported, not raised
        if not callable(inputs.mrope):
            raise
        return f"raised {type(err).__name__}: {err}"
    return _positions_in(result, ids.numel())


def _rounding(dtype: torch.dtype, expected: torch.Tensor) -> str:
    """' (torch.bfloat16 holds no 257: it rounds to 256)' when the positions' dtype cannot hold a position of
    `expected` ([3] one token's, from the index), else ''."""
    if dtype not in HALF_EXACT_WHOLE_NUMBERS:  # float32 / float64 hold every position an index gives
        return ""
    wanted = expected.double()
    held = wanted.to(dtype).double()
    if torch.equal(held, wanted):
        return ""
    k = int((held != wanted).nonzero()[0])
    return f" ({dtype} holds no {wanted[k].item():g}: it rounds to {held[k].item():g})"


def index_name(mrope) -> str:
    """How a report names the index: a callable by its module and qualified name (a partial or an object by its
    repr, cut at 80 characters), an `MRopeConfig` by its family's index."""
    if not callable(mrope):
        return f"the mrope index ({mrope.family} get_rope_index)"
    qualname = getattr(mrope, "__qualname__", None)
    name = f"{getattr(mrope, '__module__', None) or '?'}.{qualname}" if qualname else repr(mrope)[:80]
    return f"the mrope callable {name}"


def _index_failure(name: str, failures: dict[int, str], asked: int) -> Violation:
    """One finding about the index (named `name`) that gave no positions for the documents of `failures`
    ({document: what it raised or gave}) among the `asked` ones: up to 3 distinct failures, each with its documents."""
    by_failure: dict[str, list[int]] = {}
    for d, failure in failures.items():
        by_failure.setdefault(failure, []).append(d)
    detail = [f"{failure} (documents {ds[:16]}{' ...' if len(ds) > 16 else ''})"
              for failure, ds in list(by_failure.items())[:3]]
    more = f"; and {len(by_failure) - 3} other failure(s)" if len(by_failure) > 3 else ""
    return Violation("mrope_index", f"{name} failed on {len(failures)} of the {asked} documents asked: "
                                    f"{'; '.join(detail)}{more}")


# Why a document with videos is not compared when no seconds were given (`_reads_seconds` index).
NO_SECONDS = ("video placeholders but no second_per_grid_ts: the index steps a video's t positions by its seconds "
              "per grid step (transformers' Qwen2.5-VL assumes 1 s without them, though its processor always gives "
              "them; Qwen3-Omni's needs them), so positions made with the real seconds cannot be compared")


def _reads_seconds(mrope, params: dict | None) -> bool:
    """The index scales a video's t positions by its seconds: an `MRopeConfig` whose family's positions depend on
    a per-second scale (`rope.config.POSITION_FIELDS`: Qwen2.5-VL, Qwen3-Omni), or a callable taking them by name
    (`params`: `_parameters`; one with **kwargs or no signature is not known to, and is asked as given)."""
    if not callable(mrope):
        from megatron_vlm_packing.rope.config import POSITION_FIELDS

        return bool({"tokens_per_second", "position_id_per_seconds"} & set(POSITION_FIELDS[mrope.family]))
    return params is not None and ("second_per_grid_ts" in params or "second_per_grids" in params)


def _takes_any(params: dict | None) -> bool:
    """A callable with these parameters (`_parameters`) takes any keyword: **kwargs, or no signature known."""
    return params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _audio_in_video(inputs: PackedInputs, ids: torch.Tensor) -> bool:
    """`use_audio_in_video` for one document (ids: [L]): as given, else whether a video placeholder
    sits next to an audio placeholder (a video with its audio track in one block)."""
    if inputs.use_audio_in_video is not None or inputs.audio_token_id is None or inputs.video_token_id is None:
        return bool(inputs.use_audio_in_video)
    kinds = (ids == inputs.video_token_id).long() - (ids == inputs.audio_token_id).long()  # 1 video, -1 audio
    return bool((kinds[1:] * kinds[:-1] < 0).any())


def document_inputs(inputs: PackedInputs, ids: torch.Tensor, items: dict, d: int) -> dict:
    """The index's keywords for document `d` alone (ids: [L]): its grids, seconds and audio lengths."""
    kwargs = {}
    for kind, name in _ITEMS:
        given = getattr(inputs, name)
        if items.get(kind) is not None and given is not None and items[kind][d]:
            kwargs[name] = given[items[kind][d]]
            if kind == "video" and inputs.second_per_grid_ts is not None:
                kwargs["second_per_grid_ts"] = inputs.second_per_grid_ts.reshape(-1)[items[kind][d]]
    if "audio_seqlens" in kwargs:
        kwargs["use_audio_in_video"] = _audio_in_video(inputs, ids)
    return kwargs


def against_model_index(inputs: PackedInputs, docs: Documents, items: dict, skip: set[int],
                        audio_unchecked: dict[int, str]) -> tuple[list[Violation], dict[int, str]]:
    """Each document's real positions ([3, L] of `inputs.position_ids`) equal to the index's for it alone.

    Returns the violations: mrope_positions naming the first differing token of up to 4 documents (or our
    index's refusal of them: a ValueError), and one mrope_index finding for the documents the index gave no
    positions for (a callable's exception of any type, or a result that is not [3, 1, L] positions: the index
    is broken, not the pack, so those documents are not checked rather than each blamed); and {document: why it
    could not be checked}. Documents in `skip` (already reported) are not asked about, nor those of
    `audio_unchecked` (`vision.audio_coverage`: audio the index would need lengths for), returned with the rest.
    """
    bad, unchecked, failures, asked = [], dict(audio_unchecked), {}, 0
    params = _parameters(inputs.mrope) if callable(inputs.mrope) else None  # read once, not per document
    reads_seconds = _reads_seconds(inputs.mrope, params)
    seconds_missing = inputs.second_per_grid_ts is None and reads_seconds
    # Seconds an index is known to read nothing of (Qwen2-VL's, Qwen3-VL's; a callable naming none) are not
    # given to it: the model makes its positions without them (a dumper may have saved every key).
    drops_seconds = not reads_seconds and (not callable(inputs.mrope) or not _takes_any(params))
    for d in range(docs.num_documents):
        if d in skip or d in unchecked or docs.real[d] == 0:
            continue
        slots = docs.real_slots(d)
        ids = inputs.input_ids[slots]
        kwargs = document_inputs(inputs, ids, items, d)
        if drops_seconds:
            kwargs.pop("second_per_grid_ts", None)
        if seconds_missing and "video_grid_thw" in kwargs:  # a default would judge the pack by seconds it never had
            unchecked[d] = NO_SECONDS
            continue
        if callable(inputs.mrope):
            kwargs, unread = _callable_kwargs(params, kwargs)
            if unread:
                unchecked[d] = f"the mrope callable takes none of {unread} by name"
                continue
        asked += 1
        try:
            expected = _expected_positions(inputs, ids, kwargs, params)
        except ValueError as err:  # our own index refuses this document (a callable's errors come back as text)
            bad.append((d, f"document {d}: the model's index refuses it: {err}"))
            continue
        if isinstance(expected, str):
            failures[d] = expected
            continue
        got = inputs.position_ids[:, slots]
        differs = got.double() != expected.double()  # float32 positions (Qwen3-Omni) compared untruncated
        if bool(differs.any()):
            k = int(differs.any(0).nonzero()[0])
            bad.append((d, f"document {d} token {k}: {got[:, k].tolist()} where the model's index gives "
                           f"{expected[:, k].tolist()}{_rounding(got.dtype, expected[:, k])}"))
    found = []
    if bad:
        detail = "; ".join(detail for _, detail in bad[:4])
        found.append(Violation("mrope_positions", detail, tuple(d for d, _ in bad)))
    if failures:
        name = index_name(inputs.mrope)
        found.append(_index_failure(name, failures, asked))
        unchecked.update({d: f"{name} gave no positions for them (see mrope_index)" for d in failures})
    return found, unchecked
