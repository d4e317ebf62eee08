"""Integer bounds the packer checks Python ints against, and the one rule for an integer option, in one
place (no imports from this package: any module may use it).

Token ids, placeholder ids and the pad id are written into int64 tensors: a larger Python int would
overflow there (or wrap), so the modules that take such ids (`media_tokens.MediaTokens`, `rows`, `batch`)
refuse it against `INT64_MAX`.

An integer option (a size, a count, a seed, an id) is a Python int or a numpy integer (`is_int`): not a
bool (True compared equal to 1 and ran as a count of 1), nor a float (int(2.5) is 2), a string or a
tensor. What holds it keeps it as a Python int (`checked_int`): a numpy int64 wraps silently in
arithmetic where a Python int does not. Counts given as a list or tuple (`audio_seqlens`, `document_lengths`,
`num_image_tiles`) follow the same rule entry by entry (`int_entries`): a numpy-based dataset yields np.int64.
"""

import numbers

import torch

INT64_MAX = 2**63 - 1  # torch.iinfo(torch.int64).max


def is_int(value) -> bool:
    """`value` is a Python int or a numpy integer (any `numbers.Integral`), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def tensor_hint(value, name: str) -> str:
    """The end of an integer option's error when `value` is a tensor (refused: its value would be read back from
    the device at every call, hidden in an option): how to pass it; "" for anything else."""
    return f"; pass a Python int (int({name})), not a tensor" if isinstance(value, torch.Tensor) else ""


def checked_int(value, name: str, *, least: int | None = None, optional: bool = False) -> int | None:
    """`value` as a Python int (`is_int`), at least `least`; None when `optional` and `value` is None.

    Example: checked_int(np.int64(4), "img_seq_len", least=1) -> 4; checked_int(True, "img_seq_len", least=1)
    -> ValueError "img_seq_len must be an int >= 1, got True".

    Raises:
        ValueError: "{name} must be [None or ]an int[ >= least], got {value!r}".
    """
    if optional and value is None:
        return None
    if not is_int(value) or (least is not None and value < least):
        bound = "" if least is None else f" >= {least}"
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int{bound}, got {value!r}")
    return int(value)


def int_entries(values, name: str, what: str) -> list[int]:
    """The entries of a list, tuple or range of counts as Python ints, each by `is_int`'s rule.

    Example: int_entries([np.int64(10), 1], "audio_seqlens", "raw audio lengths") -> [10, 1];
    int_entries([10, True], ...) -> ValueError "audio_seqlens entry 1 is True: raw audio lengths must be ints".

    Raises:
        ValueError: "{name} entry {i} is {entry!r}: {what} must be ints" for the first bool (numpy's too), float,
            string or other non-integer entry.
    """
    entries = list(values)
    bad = next((i for i, n in enumerate(entries) if not is_int(n)), None)
    if bad is not None:
        raise ValueError(f"{name} entry {bad} is {entries[bad]!r}: {what} must be ints")
    return [int(n) for n in entries]
