"""Which placeholder ids a collated batch's media fill, and the token arithmetic that counts them.

`MediaTokens` holds the image / video / audio placeholder ids, the spatial merge size and the audio
window, from explicit `image_token_id=` / `video_token_id=` / `audio_token_id=` keywords of
`pack_batch` / `pad_batch` or from an `MRopeConfig`; `given_or_config` is the one rule for a keyword
given beside the config (the keyword wins, a contradiction is a ValueError). A module of its own
because every media kind (`media.py`, `media_audio.py`), the shared per-row counting
(`media_counts.py`) and the validator's inputs read it, and it reads no tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from megatron_vlm_packing.packing.bounds import INT64_MAX, is_int


@dataclass(frozen=True)
class MediaTokens:
    """Placeholder ids and token arithmetic needed to count media per sample.

    Attributes:
        image_token_id, video_token_id, audio_token_id: placeholder ids (None = not known).
        spatial_merge_size: grid patches per side merged into one placeholder (2 in every Qwen-VL).
        audio_n_window: Qwen3-Omni audio encoder window (sets each clip's token count).
        require_counts: media whose placeholder id is not known are a ValueError (default); False
            leaves their per-sample counts None (for a caller whose model adapter checks media).
    """

    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None
    spatial_merge_size: int = 2
    audio_n_window: int = 50
    require_counts: bool = True

    def __post_init__(self) -> None:
        for name in ("image_token_id", "video_token_id", "audio_token_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= INT64_MAX):
                raise ValueError(f"{name} must be a non-negative int (at most 2**63 - 1: ids are int64) or None, "
                                 f"got {value!r}")
            object.__setattr__(self, name, None if value is None else int(value))  # a numpy int as its int
        for name in ("spatial_merge_size", "audio_n_window"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if not isinstance(self.require_counts, bool):  # "no" read as True
            raise ValueError(f"require_media_counts must be a bool, got {self.require_counts!r}")

    def refuse_pad_placeholder(self, pad_token_id: int) -> None:
        """The id written at pad slots must be no placeholder id: a model places each kind's embeddings at every
        token of its id (`PackedVLM` without a read: packing counted the placeholders of the real tokens only),
        so pad slots before a placeholder (another sample's, a dense row's tail, CP / SP alignment) took its
        embedding and the placeholders after them the next ones, silently.

        Raises:
            ValueError: naming pad_token_id and the kind whose id it is.
        """
        for kind in ("image", "video", "audio"):
            if pad_token_id == getattr(self, f"{kind}_token_id"):
                raise ValueError(f"pad_token_id={pad_token_id} is also the {kind} placeholder id ({kind}_token_id="
                                 f"{pad_token_id}): the model would take every pad slot for a {kind} placeholder and "
                                 f"place the {kind} embeddings there; pad with another id")

    def pad_id_clear_of_placeholders(self) -> int:
        """The smallest id >= 0 that is no placeholder id (the step pads with it: 0 unless a placeholder is 0)."""
        taken = {self.image_token_id, self.video_token_id, self.audio_token_id}
        return next(pad for pad in range(4) if pad not in taken)

    @classmethod
    def resolve(cls, mrope=None, *, image_token_id=None, video_token_id=None, audio_token_id=None,
                spatial_merge_size=None, audio_n_window=None, require_counts: bool = True) -> "MediaTokens":
        """Explicit keywords, else the values of an `MRopeConfig` given as `mrope`.

        Raises:
            ValueError: a keyword that contradicts the `MRopeConfig`.
        """
        explicit = (image_token_id, video_token_id, audio_token_id, spatial_merge_size, audio_n_window)
        if mrope is None and type(require_counts) is bool and all(v is None or type(v) is int for v in explicit):
            return _resolved(*explicit, require_counts)  # the same keywords every micro-batch: built once
        return cls._resolve(mrope, *explicit, require_counts)

    @classmethod
    def _resolve(cls, mrope, image_token_id, video_token_id, audio_token_id, spatial_merge_size, audio_n_window,
                 require_counts) -> "MediaTokens":
        explicit = dict(image_token_id=image_token_id, video_token_id=video_token_id, audio_token_id=audio_token_id,
                        spatial_merge_size=spatial_merge_size, audio_n_window=audio_n_window)
        from_config = {}
        if mrope is not None and not callable(mrope) and hasattr(mrope, "spatial_merge_size"):
            from_config = {name: getattr(mrope, name) for name in explicit}
        values = {}
        for name, chosen in given_or_config(explicit, from_config).items():
            # An integral float (8.0) is read as its int; 3.7, inf and nan are left for __post_init__ to name.
            integral = isinstance(chosen, int) or isinstance(chosen, float) and chosen.is_integer()
            values[name] = int(chosen) if integral and not isinstance(chosen, bool) else chosen
        return cls(**values, require_counts=require_counts)


def given_or_config(given: dict, from_config: dict, *, read: Callable | None = None, show: Callable = format,
                    why: str = "") -> dict:
    """Each name of `given`: its value when not None (the given value wins), else the mRoPE config's
    (`from_config`); names with neither are left out. `read(name, value)`: the given value as compared with the
    config's (e.g. checked to be an int first); `show`: how the error writes both values (`format`: as an
    f-string does); `why`: what a contradiction would break, for the error.

    Raises:
        ValueError: a given value that contradicts the config's (both not None and unequal).
    """
    chosen = {}
    for name, value in given.items():
        known = from_config.get(name)
        if value is not None and known is not None and (value if read is None else read(name, value)) != known:
            raise ValueError(f"{name}={show(value)} contradicts the mrope config's {name}={show(known)}{why}")
        if value is not None or known is not None:
            chosen[name] = value if value is not None else known
    return chosen


@functools.lru_cache(maxsize=64)
def _resolved(*keywords) -> MediaTokens:
    """`MediaTokens.resolve` of plain keywords (ints or None) without an mRoPE config, kept: a loader
    passes the same ones for every micro-batch. A bad value raises here and is not cached."""
    return MediaTokens._resolve(None, *keywords)
