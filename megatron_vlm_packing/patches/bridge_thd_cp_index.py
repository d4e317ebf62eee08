"""Patch of Megatron-Bridge's `training.utils.packed_seq_utils.get_thd_cp_partition_indices`: the
packed context-parallel token selection without Transformer Engine's kernel.

Bridge's Qwen3-VL (and every Bridge model that selects its own CP tokens from full packed
`input_ids`) asks Megatron-Core's `get_batch_on_this_cp_rank` for the partition, which calls TE's
`thd_get_partitioned_indices`; where TE is absent (CPU, or a TE build without it) every packed CP
forward fails. The rule is TE's (each physical document split in 2*cp chunks, rank r keeps chunks r
and 2*cp-1-r), which `parallel.cp.cp_partition_index` implements; the patch routes the call there.

Defect check: Megatron-Core's TE binding (`megatron.core.utils.tex`) lacks
`thd_get_partitioned_indices`. Where it has it, the patch does nothing: TE's own kernel runs.
Only `packed_seq_utils`' own name is replaced: the copies `training.gpt_step` and Wan's utils import by
name keep Bridge's function (our adapters' models reach it through `packed_seq_utils`). A replacement:
applied over another plugin's wrapper it would drop it, so apply refuses (RuntimeError naming it) unless
Bridge's own function is there; a wrapper put on after ours wraps ours and keeps running.
Delete once Bridge / Megatron-Core carry a TE-free THD partition.
"""

from __future__ import annotations

import torch

from megatron_vlm_packing.bridge.imports import import_bridge_module
from megatron_vlm_packing.patches.owned import OwnedAttributes, upstream_own

PACKED_SEQ_UTILS = "megatron.bridge.training.utils.packed_seq_utils"
_OWNED = OwnedAttributes(__name__)  # Bridge's get_thd_cp_partition_indices while the patch is applied


def te_thd_partition_available() -> bool:
    import megatron.core.utils as mcore_utils

    return hasattr(getattr(mcore_utils, "tex", None), "thd_get_partitioned_indices")


def thd_cp_partition_indices(cu_seqlens: torch.Tensor, *, total_tokens: int, cp_group, device) -> torch.Tensor:
    """Bridge's signature, our rule: this CP rank's indices into the full packed stream.

    Raises:
        ValueError: the physical boundaries do not end at `total_tokens`.
    """
    from megatron_vlm_packing.parallel.cp import cp_partition_index

    cu = cu_seqlens.reshape(-1).to(device=device)
    if int(cu[-1]) != total_tokens:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])} but the packed stream has {total_tokens} tokens")
    return cp_partition_index(cu, cp_group.size(), cp_group.rank()).to(device=device, dtype=torch.long)


def is_applied() -> bool:
    return _OWNED.active()


def apply_bridge_thd_cp_index() -> bool:
    """Route Bridge's THD CP partition to ours where TE's kernel is absent. Idempotent; returns
    whether the patch is active.

    Raises:
        RuntimeError: Bridge's function is gone, or another plugin's code holds the name (replacing it would
            drop that code: ours never calls what it replaces); nothing is applied.
    """
    if _OWNED.active():
        return True
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    if te_thd_partition_available():
        return False
    module = import_bridge_module(PACKED_SEQ_UTILS)
    # Gone: a new name nobody calls would fix nothing; another plugin's: replacing it would drop their code.
    upstream_own(module, "get_thd_cp_partition_indices", "megatron.bridge", __name__)
    _OWNED.set(module, "get_thd_cp_partition_indices", thd_cp_partition_indices)
    return True


def undo_bridge_thd_cp_index() -> None:
    """Restore Bridge's get_thd_cp_partition_indices. A no-op when not applied.

    Raises:
        RuntimeError: a later patch replaced it; nothing is restored.
    """
    _OWNED.restore()
