"""Per-sample metadata the planner works from: known without loading any tensor.

A sample is described by its text tokens, its image and video patch grids and its audio lengths.
`SampleTable` holds many samples column-wise (numpy arrays, ragged lists flattened with an owner
index) so that lengths and costs of 100k samples are computed with a handful of vectorised calls.

`TokenCounter` turns metadata into the number of tokens the language model attends over (the
"expanded" length, bug class 2: boundaries live in the space attention sees). The default follows
the Qwen-VL / Qwen-Omni layout: every image or video contributes t*h*w / merge^2 tokens and every
audio clip frames // audio_pool tokens (whole pooling windows); a Qwen3-VL video adds its per-frame
timestamp text and blocks (`TokenCounter.for_family("qwen3_vl")`, or `from_hf_config`); LLaVA-style models plug in
their own `expanded_tokens`.

Shape legend: N = samples, I = images (all samples), V = videos, A = audio clips.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron_vlm_packing.packing.bounds import checked_int, is_int


@dataclass(frozen=True)
class SampleMetadata:
    """One sample, as far as planning needs it.

    Attributes:
        text_tokens: tokens of the sequence outside its media blocks (>= 0): neither vision/audio placeholders
            nor the wrapper tokens `TokenCounter` adds per item (vision_start / vision_end, audio_start /
            audio_end: `vision_wrappers`, `audio_wrappers`; Qwen3-VL's per-frame timestamps and blocks:
            `video_frame_tokens`), which would otherwise be counted twice.
        image_grids: (t, h, w) patch grid of every image (t = 1 for a still image).
        video_grids: (t, h, w) patch grid of every video (t = temporal patches).
        audio_frames: encoder frames of every audio clip (after the encoder's input convolution).
    """

    text_tokens: int
    image_grids: tuple[tuple[int, int, int], ...] = ()
    video_grids: tuple[tuple[int, int, int], ...] = ()
    audio_frames: tuple[int, ...] = ()


def count_array(values, name: str) -> np.ndarray:
    """`values` as int64; ValueError naming `name` for counts that are not whole numbers (a cast
    would truncate 10.7 tokens to 10 and the bin would be laid out for the wrong length) or not below 2**63."""
    array = np.asarray(values)
    if array.dtype.kind in "iu" and isinstance(values, (list, tuple)):  # [True, 5] is an int64 array
        flat = list(_flatten(values))
        bad = next((i for i, v in enumerate(flat) if _is_bool(v)), None)
        if bad is not None:
            raise ValueError(f"{name} must hold integers, not bools; entry {bad} is {flat[bad]!r}")
    if array.size == 0 or array.dtype.kind == "i" or (array.dtype.kind == "u" and array.dtype.itemsize < 8):
        return array.astype(np.int64)
    whole_floats = array.dtype.kind == "f" and np.isfinite(array).all() and (array == np.round(array)).all()
    if array.dtype.kind == "u" or whole_floats:  # uint64, or whole numbers stored as floats (a pandas column)
        # from 2**63 up, the cast wrapped them to negative int64s (errors then named numbers never given)
        big = np.flatnonzero(~(np.abs(array.reshape(-1)) < 2**63))
        if len(big):
            raise ValueError(f"{name} must hold counts below 2**63; entry {int(big[0])} is "
                             f"{array.reshape(-1)[big[0]].item()!r}")
        return array.astype(np.int64)
    flat = array.reshape(-1)
    if array.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(flat) | (flat != np.round(flat)))
        raise ValueError(f"{name} must hold whole numbers; entry {int(bad[0])} is {flat[bad[0]].item()!r}")
    first = flat[0].item() if hasattr(flat[0], "item") else flat[0]  # an object array holds Python values
    raise ValueError(f"{name} must hold integers, got dtype {array.dtype} (e.g. {first!r})")


def _is_bool(value) -> bool:
    """A bool scalar: True, np.True_, or a 0-d bool array or tensor (a mask's `.any()`), which numpy reads as 1."""
    if type(value) is int or isinstance(value, np.integer):  # the common cases, without building an array
        return False
    return isinstance(value, (bool, np.bool_)) or np.asarray(value).dtype == np.bool_


def _flatten(values):
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flatten(value)
        else:
            yield value


def _grid_array(grids: list, name: str) -> np.ndarray:
    array = count_array(grids, name)
    if array.size % 3 or (array.ndim > 1 and array.shape[-1] != 3):
        raise ValueError(f"{name} must hold (t, h, w) triples; got shape {array.shape}")
    array = array.reshape(-1, 3)
    if (array < 1).any():
        raise ValueError(f"{name} must hold positive (t, h, w) grids; got {array[(array < 1).any(1)][:4].tolist()}")
    return array


@dataclass(frozen=True)
class SampleTable:
    """N samples column-wise. The columns are the table's own read-only copies: changed lengths are a new table.

    Attributes:
        text_tokens: [N] int64.
        image_grids: [I, 3] int64 (t, h, w); image_owner: [I] int64, sample of each image.
        video_grids: [V, 3] int64; video_owner: [V] int64.
        audio_frames: [A] int64; audio_owner: [A] int64.
    """

    text_tokens: np.ndarray
    image_grids: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    image_owner: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    video_grids: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    video_owner: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    audio_frames: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    audio_owner: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self) -> None:
        for name in ("text_tokens", "image_owner", "video_owner", "audio_frames", "audio_owner"):
            column = count_array(getattr(self, name), name)
            if column.ndim > 1:  # [2, 2] was flattened into 4 samples
                raise ValueError(f"{name} must be one count per sample ([N]), got shape {column.shape}")
            object.__setattr__(self, name, column.reshape(-1))
        for name in ("image_grids", "video_grids"):
            object.__setattr__(self, name, _grid_array(getattr(self, name), name))
        n = len(self.text_tokens)
        if (self.text_tokens < 0).any():
            raise ValueError(f"text_tokens must be >= 0; sample {int(np.argmin(self.text_tokens))} has "
                             f"{int(np.min(self.text_tokens))}")
        for name in ("image", "video", "audio"):
            owner = getattr(self, f"{name}_owner")
            values = getattr(self, "audio_frames" if name == "audio" else f"{name}_grids")
            if len(owner) != len(values):
                raise ValueError(f"{name}_owner has {len(owner)} entries but there are {len(values)} {name}s")
            if len(owner) and (owner.min() < 0 or owner.max() >= n):
                raise ValueError(f"{name}_owner must index the {n} samples; got range [{owner.min()}, {owner.max()}]")
        if len(self.audio_frames) and self.audio_frames.min() < 1:
            raise ValueError(f"audio_frames must be >= 1; got {int(self.audio_frames.min())}")
        # Read-only (each is the table's own copy): a column written in place changed the plans of epochs not yet
        # planned under a sampler whose state still recorded the old fingerprint (a resume then replanned them).
        for f in dataclasses.fields(self):
            getattr(self, f.name).setflags(write=False)

    def __len__(self) -> int:
        return len(self.text_tokens)

    @classmethod
    def from_samples(cls, samples: Sequence[SampleMetadata]) -> "SampleTable":
        """Column-wise table of `samples` (in order)."""
        images, image_owner, videos, video_owner, audio, audio_owner = [], [], [], [], [], []
        for i, s in enumerate(samples):
            if not isinstance(s, SampleMetadata):
                raise ValueError(f"sample {i} is {type(s).__name__}, not a SampleMetadata")
            if np.ndim(s.audio_frames) != 1:  # an int was a TypeError below
                raise ValueError(f"sample {i}: audio_frames must be a tuple of frame counts; got {s.audio_frames!r}")
            for name in ("image_grids", "video_grids"):  # a flat (t, h, w) would become 3 images
                if any(np.ndim(g) != 1 or len(g) != 3 for g in getattr(s, name)):
                    raise ValueError(f"sample {i}: {name} must be a tuple of (t, h, w) triples; got "
                                     f"{getattr(s, name)!r}")
            images.extend(s.image_grids); image_owner.extend([i] * len(s.image_grids))
            videos.extend(s.video_grids); video_owner.extend([i] * len(s.video_grids))
            audio.extend(s.audio_frames); audio_owner.extend([i] * len(s.audio_frames))
        return cls(
            text_tokens=count_array([s.text_tokens for s in samples], "text_tokens"),
            image_grids=_grid_array(images, "image_grids"), image_owner=np.asarray(image_owner, np.int64),
            video_grids=_grid_array(videos, "video_grids"), video_owner=np.asarray(video_owner, np.int64),
            audio_frames=count_array(audio, "audio_frames"), audio_owner=np.asarray(audio_owner, np.int64),
        )

    def sample(self, index: int) -> SampleMetadata:
        """Row `index` back as a `SampleMetadata`. ValueError for an index outside [0, N): -1 read the last row's
        text tokens and no media (media rows are matched by owner)."""
        if not is_int(index) or not 0 <= index < len(self):
            raise ValueError(f"index={index!r} must be an int in [0, {len(self)})")

        def grids(array, owner):
            return tuple(tuple(int(x) for x in row) for row in array[owner == index])

        return SampleMetadata(
            text_tokens=int(self.text_tokens[index]),
            image_grids=grids(self.image_grids, self.image_owner),
            video_grids=grids(self.video_grids, self.video_owner),
            audio_frames=tuple(int(x) for x in self.audio_frames[self.audio_owner == index]),
        )

    def per_sample_sum(self, values: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """[N] float64: sum of `values` ([I] etc.) over each sample's items (0 where none)."""
        return np.bincount(owner, weights=values.astype(np.float64), minlength=len(self))


@dataclass(frozen=True, kw_only=True)
class TokenCounter:
    """Tokens a sample occupies in the language model's sequence (the space attention sees).

    Attributes:
        spatial_merge: vision patches merged per side into one LM token (Qwen-VL: 2, so 4 patches).
        audio_pool: audio encoder frames per LM token (Qwen2.5-Omni: 2).
        vision_wrappers: extra tokens per image/video (vision_start + vision_end = 2).
        audio_wrappers: extra tokens per audio clip (audio_start + audio_end = 2).
        audio_n_window: Qwen3-Omni's audio encoder window (its `n_window`: the mRoPE config's `audio_n_window`
            `pack_batch` counts with, else 50): `audio_frames` are then each clip's mel frames and a clip takes
            `rope.omni.audio_output_length(frames, audio_n_window)` tokens, the rule `pack_batch` counts its
            placeholders by (`audio_pool` unused). None: frames after the input convolution, pooled by `audio_pool`.
        video_frame_tokens: tokens each temporal grid step of a video takes besides its h*w/merge^2 placeholders
            and its timestamp (`video_timestamp_seconds`). 0 (Qwen2-VL, Qwen2.5-VL, Qwen3-Omni): a video is one
            block. Qwen3-VL's processor writes each step as `<{t:.1f} seconds>`, vision_start, its placeholders,
            vision_end (inside the video's own wrappers): `for_family("qwen3_vl")` counts the pair (2) and the
            timestamps exactly. Set by hand, without timestamps, it counts 2 + a fixed timestamp per step
            (6 tokens below 10 s, 7 below 100 s; pass the longest video's last step's: earlier steps are then
            counted a token or two long). Left at 0 with no timestamps, a Qwen3-VL video of t steps was planned
            t * (2 + timestamp) tokens short, and its bin overflowed the capacity. Metadata counted from
            tokenized samples (`text_tokens` = tokens less placeholders and wrappers) already holds them: leave
            it 0.
        video_timestamp_seconds: Qwen3-VL's per-step timestamps, counted exactly (`planner.presets`): seconds
            between temporal grid steps (1.0 at its processor's default 2 frames a second; 2.0 at fps=1);
            step k's timestamp `<{(k + 0.25) * seconds:.1f} seconds>` takes 5 tokens + one per whole-second
            digit. None (the default): no timestamps.

    The default `TokenCounter()` is the Qwen2-VL / Qwen2.5-VL layout (merge 2, no timestamps, audio pooled by 2);
    `TokenCounter.for_family(family)` and `TokenCounter.from_hf_config(hf_config)` give a family's processor.
    """

    spatial_merge: int = 2
    audio_pool: int = 2
    vision_wrappers: int = 2
    audio_wrappers: int = 2
    audio_n_window: int | None = None
    video_frame_tokens: int = 0
    video_timestamp_seconds: float | None = None

    def __post_init__(self) -> None:
        for name, least in (("spatial_merge", 1), ("audio_pool", 1), ("vision_wrappers", 0), ("audio_wrappers", 0),
                            ("video_frame_tokens", 0)):
            object.__setattr__(self, name, checked_int(getattr(self, name), f"TokenCounter.{name}", least=least))
        object.__setattr__(self, "audio_n_window",
                           checked_int(self.audio_n_window, "TokenCounter.audio_n_window", least=1, optional=True))
        seconds = self.video_timestamp_seconds
        if seconds is not None and (isinstance(seconds, (bool, np.bool_)) or not isinstance(seconds, numbers.Real)
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"TokenCounter.video_timestamp_seconds must be None or a finite number > 0, got "
                             f"{seconds!r}")
        if seconds is not None:  # a numpy float32 as the Python float it rounds the timestamps with
            object.__setattr__(self, "video_timestamp_seconds", float(seconds))

    @classmethod
    def for_family(cls, family: str, *, spatial_merge: int = 2, audio_n_window: int = 50) -> "TokenCounter":
        """The counter of `family`'s processor (an `MRopeConfig.family`: "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
        "qwen3_omni"): Qwen3-VL's per-step vision_start / vision_end and timestamps, Qwen3-Omni's audio rule
        (`audio_n_window`, its audio encoder's window); the others are the default layout. `spatial_merge`: the
        vision config's `spatial_merge_size`.

        Raises:
            ValueError: an unknown family (naming the known ones), or a field out of range.
        """
        from megatron_vlm_packing.planner.presets import family_fields

        return cls(spatial_merge=spatial_merge, **family_fields(family, audio_n_window=audio_n_window))

    @classmethod
    def from_hf_config(cls, hf_config) -> "TokenCounter":
        """`for_family` of a transformers config, read as `rope.MRopeConfig.from_hf_config` reads it (its family,
        `vision_config.spatial_merge_size`, Qwen3-Omni's `audio_config.n_window`).

        Raises:
            ValueError: a model type of no supported family, or a field `MRopeConfig.from_hf_config` refuses.
        """
        from megatron_vlm_packing.rope.config import MRopeConfig

        mrope = MRopeConfig.from_hf_config(hf_config)
        return cls.for_family(mrope.family, spatial_merge=mrope.spatial_merge_size,
                              audio_n_window=mrope.audio_n_window)

    def __call__(self, table: SampleTable) -> np.ndarray:
        """[N] int64 expanded token counts. ValueError for a grid whose h or w the merge does not
        divide: the model's merger cannot take it, and t*h*w // merge^2 would undercount its tokens."""
        for name in ("image_grids", "video_grids"):
            grids = getattr(table, name)
            bad = np.flatnonzero((grids[:, 1:] % self.spatial_merge).any(axis=1))
            if len(bad):
                owner = getattr(table, name.replace("grids", "owner"))
                raise ValueError(f"{name} of sample {int(owner[bad[0]])} is {grids[bad[0]].tolist()}: h and w must be "
                                 f"multiples of spatial_merge={self.spatial_merge} ({len(bad)} such grid(s))")
        # t * (h / merge) * (w / merge) = t*h*w // merge**2 (h and w divide), and each clip's tokens plus its
        # wrappers, in float64: exact below 2**53, where int64 wrapped (a (2**40)^3 grid counted 0 tokens, a clip of
        # 2**63 - 1 frames about -2**63); larger totals are refused.
        def vision(grids: np.ndarray) -> np.ndarray:
            merged = np.concatenate([grids[:, :1], grids[:, 1:] // self.spatial_merge], axis=1)
            return np.prod(merged.astype(np.float64), axis=1) + self.vision_wrappers

        audio = self._clip_tokens(table.audio_frames) + self.audio_wrappers
        total = table.text_tokens.astype(np.float64)
        total += table.per_sample_sum(vision(table.image_grids), table.image_owner)
        video_steps = table.video_grids[:, 0].astype(np.float64) * self.video_frame_tokens  # Qwen3-VL's blocks
        if self.video_timestamp_seconds is not None:
            from megatron_vlm_packing.planner.presets import timestamp_tokens

            video_steps += timestamp_tokens(table.video_grids[:, 0], self.video_timestamp_seconds)
        total += table.per_sample_sum(vision(table.video_grids) + video_steps, table.video_owner)
        total += table.per_sample_sum(audio, table.audio_owner)
        refuse_uncountable(total)
        return total.astype(np.int64)

    def _clip_tokens(self, frames: np.ndarray) -> np.ndarray:
        """[A] float64 tokens of each audio clip of `frames` ([A] int64, each >= 1)."""
        if self.audio_n_window is None:
            # AvgPool1d(audio_pool, audio_pool) keeps whole windows: Qwen2.5-Omni's (F - 2) // 2 + 1 = F // 2 tokens
            return (frames // self.audio_pool).astype(np.float64)
        from megatron_vlm_packing.rope.omni import audio_tokens_per_clip  # the packer's rule, on host ints

        return np.asarray(audio_tokens_per_clip(frames.tolist(), self.audio_n_window).tokens, dtype=np.float64)


ExpandedTokens = Callable[[SampleTable], np.ndarray]
"""A hook: table -> [N] int64 tokens per sample in the space attention sees (e.g. LLaVA's
`text_tokens + images * tokens_per_image`). `TokenCounter()` is the Qwen-VL default."""


def refuse_uncountable(tokens: np.ndarray) -> None:
    """[N] float64 token counts must stay below 2**53, where float64 (and the planner's sums) are exact.

    Raises:
        ValueError: naming the first sample at or above it and its count.
    """
    big = np.flatnonzero(~(tokens < 2**53))
    if len(big):
        raise ValueError(f"sample {int(big[0])} takes about {float(tokens[big[0]]):.2g} tokens: more than 2**53, which "
                         f"the planner cannot count exactly")


def llava_tokens(tokens_per_image: int, *, segment_multiple: int = 1) -> ExpandedTokens:
    """LLaVA-style expansion: each image placeholder becomes `tokens_per_image` embeddings, and a sample with
    an image takes `segment_multiple` slots more.

    `text_tokens` must then count the text only (the placeholders are replaced). The extra slots: LLaVA zeroes
    the loss of the slot before each image (bug class 13), so its packer (`models.llava_plan.llava_pack_plan`)
    gives the document before one that opens with an image a pad slot, which rounds that document up by at
    most one segment. Counted on the sample that may open with an image, a bin within the capacity stays
    within it in any order; uncounted, a full bin expanded past it and LLaVA's collator refused it mid-epoch.
    `segment_multiple`: the layout's `multiples.segment` (LLaVA's 2*cp under CP, else 1). For a model, plan with
    `space = LlavaSpace.of(model)`: `BinLayout(multiples=space.multiples)` and
    `llava_tokens(space.img_seq_len, segment_multiple=space.segment_multiple)`.
    """
    checked_int(tokens_per_image, "tokens_per_image", least=1)
    checked_int(segment_multiple, "segment_multiple", least=1)

    def expanded_tokens(table: SampleTable) -> np.ndarray:
        images = np.bincount(table.image_owner, minlength=len(table)).astype(np.int64)
        reserved = np.where(images > 0, int(segment_multiple), 0)  # the slot LLaVA zeroes before an image
        refuse_uncountable(table.text_tokens + images * float(tokens_per_image) + reserved)  # int64 wrapped
        return table.text_tokens + images * tokens_per_image + reserved

    return expanded_tokens
