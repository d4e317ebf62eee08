"""Read a saved packed batch (`torch.save` of a dict with the keys of `SAVED_KEYS`) for the CLI."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from megatron_vlm_packing.validate.inputs import SAVED_KEYS


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
    except Exception as err:  # torch raises pickle, zip and runtime errors alike for a bad file
        raise ValueError(f"{path}: not a readable torch.save file ({type(err).__name__}: {err})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: holds a {type(data).__name__}, expected a dict with keys such as "
                         f"{sorted(SAVED_KEYS)[:6]}")
    return dict(data)


def saved_keys_help() -> str:
    """One line per key, for `check --help`."""
    return "\n".join(f"  {key}: {meaning}" for key, meaning in SAVED_KEYS.items())
