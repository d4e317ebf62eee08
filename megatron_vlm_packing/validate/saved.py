"""What `megatron-vlm-packing check` reads: a saved packed batch (`torch.save` of a dict with the keys
of `SAVED_KEYS`) and, with `--hf-config`, the model's mRoPE settings from its Hugging Face config."""

from __future__ import annotations

import os
import pickle
import re
from typing import Mapping

import torch

from megatron_vlm_packing.validate.saved_keys import SAVED_KEYS, saved_keys_help  # noqa: F401 (the help's home was here)
from megatron_vlm_packing.validate.validate import POSITIONS_1D


def load_saved_batch(path: str | os.PathLike) -> dict:
    """The dict saved at `path`, loaded with `weights_only=True` (no arbitrary code runs).

    A `PackedSeqParams` value is allowed; so is a dict with its field names.

    Raises:
        ValueError: the file is missing or unreadable, or holds something other than a dict.
    """
    safe = []
    try:
        from megatron.core.packed_seq_params import PackedSeqParams

        safe.append(PackedSeqParams)
    except ImportError:  # megatron-core absent: dict-form packed_seq_params still load
        pass
    try:
        with torch.serialization.safe_globals(safe):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except pickle.UnpicklingError as err:
        refused = _refused_global(str(err))
        if refused is None:
            raise ValueError(f"{path}: not a readable torch.save file (UnpicklingError: {err})") from None
        # torch's own message advises weights_only=False, which would run the file's code: say what to save instead
        raise ValueError(f"{path}: holds a {refused}, which is read only as code (a weights-only load refuses it); "
                         f"save tensors (torch.from_numpy for numpy arrays), Python numbers, strings, lists and "
                         f"dicts, or a PackedSeqParams") from None
    except Exception as err:  # torch raises pickle, zip and runtime errors alike for a bad file
        raise ValueError(f"{path}: not a readable torch.save file ({type(err).__name__}: {err})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: holds a {type(data).__name__}, expected a dict with keys such as "
                         f"{sorted(SAVED_KEYS)[:6]}")
    return dict(data)


def _refused_global(message: str) -> str | None:
    """The class a weights-only load refused (e.g. 'numpy.ndarray'), from torch's UnpicklingError message."""
    found = re.search(r"(?:but got|Unsupported global: GLOBAL) <?(?:class )?'?([\w.]+)", message)
    return found.group(1) if found else None


def load_hf_mrope_config(path: str | os.PathLike, *, text_offset: str = "max_hw"):
    """The `MRopeConfig` of the Hugging Face config at `path`: a config.json, or a model directory holding one.

    Read with transformers' `AutoConfig`, from local files only (a path that does not exist is never
    looked up on the Hub as a model name). `text_offset`: where text resumes after a vision block, as
    `MRopeConfig` takes it ("max_position" for positions made by transformers 4.57).

    Raises:
        ValueError: transformers is not installed; `path` is missing, a directory without config.json, or
            not a config transformers can read; or the model is not an mRoPE model (Qwen2-VL, Qwen2.5-VL,
            Qwen3-VL (MoE), Qwen3-Omni).
    """
    from megatron_vlm_packing.rope import MRopeConfig
    from megatron_vlm_packing.rope.config import _MODEL_TYPES

    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise ValueError(f"--hf-config needs the transformers package, which cannot be imported ({err}); "
                         f"install it: pip install 'megatron-vlm-packing[hf]'") from None
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or directory (--hf-config takes a config.json or a model directory)")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: a directory without config.json")
    try:
        config = AutoConfig.from_pretrained(os.fspath(path), local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError alike for a bad config
        raise ValueError(f"{path}: not a Hugging Face config transformers can read ({type(err).__name__}: {err})") \
            from None
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not an mRoPE model; --hf-config takes the config of "
                         f"one of {sorted(_MODEL_TYPES)} (a model with 1D positions needs no index: leave it out)")
    try:
        return MRopeConfig.from_hf_config(config, text_offset=text_offset)
    except (AttributeError, TypeError, ValueError) as err:  # e.g. a field missing or of the wrong type
        raise ValueError(f"{path}: cannot read the mRoPE settings of this {model_type} config "
                         f"({type(err).__name__}: {err})") from None


def _is_mrope_positions(positions) -> bool:
    """[3, 1, T] / [3, T] positions (not [1, T] / [T])."""
    return isinstance(positions, torch.Tensor) and (positions.dim() == 3 or
                                                    (positions.dim() == 2 and positions.shape[0] != 1))


def index_note(report, batch: Mapping, mrope, source) -> str | None:
    """The CLI's line on whether positions were compared with the model's index, or None when there is
    nothing to say (no --hf-config on a batch with no media and 1D positions: a text model).

    Args:
        report: the `ValidationReport`; batch: the saved dict; mrope: the `MRopeConfig` from `source`
            (the --hf-config path), or None.
    """
    unchecked = [reason for name, reason in report.skipped if name == "mrope_positions"]
    if mrope is None:
        media = any(batch.get(k) is not None for k in ("image_grid_thw", "video_grid_thw", "audio_seqlens"))
        if not (unchecked or media or _is_mrope_positions(batch.get("position_ids"))):
            return None
        return ("  positions: not compared with the model's index (give --hf-config PATH, the model's config.json "
                "or directory, for Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-Omni)")
    index = f"the {mrope.family} index of {source}"
    if mrope.text_offset == "max_position":
        index += " (text resuming after the block's largest position, as transformers 4.57)"
    if POSITIONS_1D in unchecked:  # the report's own word: the batch's shape is not read again here
        return (f"  positions: 1D; {index} needs [3, 1, T] mRoPE positions, so documents with image / video "
                f"placeholders are reported (mrope_channels_identical)")
    if "mrope_positions" in report.checked:
        tail = "; the documents listed as not checked were not" if unchecked else ""
        return f"  positions: compared with {index}, per document{tail}"
    why = ("the file has no position_ids" if batch.get("position_ids") is None else
           "the checks stopped before positions (see the violations / not checked lines above)")
    return f"  positions: NOT compared with {index}: {why}"
