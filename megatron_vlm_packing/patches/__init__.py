"""Megatron-Core patches, in one place. None is applied on import; each is idempotent and reversible.

Undo is stack-safe (last in, first out; `patches.owned`): an attribute is restored only while it
still holds our replacement. Where another plugin wrapped it after us, undo raises RuntimeError
naming the attribute and its holder, and undoes nothing: undo that later patch first. Where a patch
applied before ours was undone after it (its original is back over ours), ours is off: the `is_applied`
checks say so, undo leaves that original, and apply installs ours again.

Order of application (what `apply_all` does), and why:
1. `gpt_model_forward.apply_sp_embedding_scatter` (only where megatron-core lacks the fix),
2. `gpt_model_forward.apply_sp_padding_mask_scatter`,
3. `llava_boundaries.apply_llava_packed_boundaries` (LLaVAModel.forward; only while upstream does
   not remap packed boundaries after image expansion).
4. `thd_rotary.apply_thd_rotary` (rope_utils._apply_rotary_pos_emb_thd; only while upstream's THD
   rope syncs on the host): loop-free, sync-free THD rotary; `use_packed_mrope` also applies it.
The first two wrap `GPTModel.forward` once (a single wrapper consults which fixes are on), so the order
only matters for reading. Apply patches before building models' optimizers/DDP wrappers and
before the first forward; parallelism (initialize_model_parallel) may come before or after.
The packed mRoPE rotary is installed per model, not globally: `rope.use_packed_mrope(model)`.

Megatron-Bridge patches (`apply_bridge_patches`, not part of `apply_all`: they import Bridge's model
modules): `bridge_deepstack_sp` (Qwen3-VL deepstack gradients under TP + SP; Qwen3-Omni dense rows too) and
`bridge_thd_cp_index` (packed CP token selection without TE's kernel), `bridge_qwen25_vl_cp`
(Qwen2.5-VL's missing CP token selection), `bridge_qwen3_vl_moe_pads` (the Qwen3-VL block hands the plan's
padding mask to its MoE routers). Apply them before the first
forward of a Bridge model; the Bridge adapters refuse a layout whose defect is present and unpatched.
Qwen3-Omni's packed THD path is applied on its own: `apply_bridge_qwen3_omni_packed()` (the thinker
refuses `packed_seq_params`; the Omni adapter refuses packed micro-batches until it is applied).

Threads: apply and undo from one thread, the one that builds the models (no lock). torchrun runs one process
per rank, DataLoader workers are processes, and this package applies patches only while models are built
(`use_packed_mrope`) or a job is launched. Two threads applying one patch at once may both install it (the
later wrapping the earlier): a call then runs right or fails loudly (a wrapper leaves tensors another already
CP-selected or scattered, recognised by their length; LLaVA's boundaries expanded twice are a ValueError),
and undo refuses with a RuntimeError (checked by hand for the Qwen3-Omni patch, not tested).
"""

from megatron_vlm_packing.patches.llava_boundaries import (
    apply_llava_packed_boundaries, undo_llava_packed_boundaries, upstream_remaps_packed_boundaries,
)
from megatron_vlm_packing.patches.bridge_deepstack_sp import apply_bridge_deepstack_sp, undo_bridge_deepstack_sp
from megatron_vlm_packing.patches.bridge_qwen25_vl_cp import apply_bridge_qwen25_vl_cp, undo_bridge_qwen25_vl_cp
from megatron_vlm_packing.patches.bridge_thd_cp_index import apply_bridge_thd_cp_index, undo_bridge_thd_cp_index
from megatron_vlm_packing.patches.bridge_qwen3_vl_moe_pads import (
    apply_bridge_qwen3_vl_moe_pads, undo_bridge_qwen3_vl_moe_pads,
)
from megatron_vlm_packing.patches.thd_rotary import apply_thd_rotary, undo_thd_rotary, upstream_thd_rope_syncs
from megatron_vlm_packing.patches.bridge_qwen3_omni_packed import (
    apply_bridge_qwen3_omni_packed, undo_bridge_qwen3_omni_packed,
)
from megatron_vlm_packing.patches.gpt_model_forward import (
    apply_sp_embedding_scatter, apply_sp_padding_mask_scatter, undo_sp_embedding_scatter,
    undo_sp_padding_mask_scatter, upstream_scatters_standalone_embeddings,
)
from megatron_vlm_packing.patches import (
    bridge_deepstack_sp, bridge_qwen25_vl_cp, bridge_qwen3_vl_moe_pads, bridge_thd_cp_index, gpt_model_forward,
    llava_boundaries, thd_rotary,
)
from megatron_vlm_packing.patches.owned import check_restorable
from megatron_vlm_packing.patches.together import Patch, apply_together


def _core_patches() -> tuple[Patch, ...]:
    """`apply_all`'s patches in its order, each with its undo and whether it runs now."""
    return (Patch("sp_embedding_scatter", apply_sp_embedding_scatter, undo_sp_embedding_scatter,
                  gpt_model_forward.embedding_scatter_applied),
            Patch("sp_padding_mask_scatter", apply_sp_padding_mask_scatter, undo_sp_padding_mask_scatter,
                  gpt_model_forward.padding_mask_scatter_applied),
            Patch("llava_packed_boundaries", apply_llava_packed_boundaries, undo_llava_packed_boundaries,
                  llava_boundaries._OWNED.active),
            Patch("thd_rotary", apply_thd_rotary, undo_thd_rotary, thd_rotary.thd_rotary_applied))


def apply_all() -> dict[str, bool]:
    """Apply every patch, in the order above; returns which are active here (False: megatron-core has the
    fix, nothing installed). All or nothing (`together.apply_together`): where one raises, the patches this call
    applied are undone (those applied before the call stay) and the error is raised as it came.

    Raises:
        RuntimeError: a patch's target is gone or its signature hidden by an earlier wrapper, a defect probe
            fails on upstream's function (named, with the exception), another plugin's wrapper holds the THD
            rope (`thd_rotary` replaces it), or a later plugin holds the attribute of a patch to install again.
    """
    return apply_together(_core_patches())


def _bridge_patches() -> tuple[Patch, ...]:
    """`apply_bridge_patches`'s patches in its order, each with its undo and whether it runs now."""
    return (Patch("bridge_deepstack_sp", apply_bridge_deepstack_sp, undo_bridge_deepstack_sp,
                  bridge_deepstack_sp.is_applied),
            Patch("bridge_thd_cp_index", apply_bridge_thd_cp_index, undo_bridge_thd_cp_index,
                  bridge_thd_cp_index.is_applied),
            Patch("bridge_qwen25_vl_cp", apply_bridge_qwen25_vl_cp, undo_bridge_qwen25_vl_cp,
                  bridge_qwen25_vl_cp.is_applied),
            Patch("bridge_qwen3_vl_moe_pads", apply_bridge_qwen3_vl_moe_pads, undo_bridge_qwen3_vl_moe_pads,
                  bridge_qwen3_vl_moe_pads.is_applied))


def apply_bridge_patches() -> dict[str, bool]:
    """Apply every Megatron-Bridge patch whose defect is present; returns which are active. All or nothing, as
    `apply_all`.

    `bridge_qwen25_vl_cp` has no defect check at apply time: it is always installed (True) and checks per
    call (a packed CP call whose `decoder_input` is still full length); dense and CP = 1 calls pass through.

    Raises:
        RuntimeError: as `apply_all`, and where a defect probe fails on Bridge's function (named, with the
            exception) or another plugin's wrapper holds `get_thd_cp_partition_indices` (ours replaces it).
    """
    return apply_together(_bridge_patches())


def undo_bridge_patches() -> None:
    """Undo what `apply_bridge_patches` applied, in reverse order.

    Raises:
        RuntimeError: a later patch wraps one of their attributes; none is undone.
    """
    check_restorable(bridge_qwen3_vl_moe_pads._OWNED, bridge_qwen25_vl_cp._OWNED, bridge_thd_cp_index._OWNED,
                     bridge_deepstack_sp._OWNED)
    undo_bridge_qwen3_vl_moe_pads()
    undo_bridge_qwen25_vl_cp()
    undo_bridge_thd_cp_index()
    undo_bridge_deepstack_sp()


def undo_all() -> None:
    """Undo what `apply_all` applied, in reverse order.

    Raises:
        RuntimeError: a later patch wraps one of their attributes; none is undone.
    """
    check_restorable(thd_rotary._OWNED, llava_boundaries._OWNED, gpt_model_forward._OWNED)
    undo_thd_rotary()
    undo_llava_packed_boundaries()
    undo_sp_padding_mask_scatter()
    undo_sp_embedding_scatter()


__all__ = [
    "apply_bridge_deepstack_sp", "apply_bridge_patches", "apply_bridge_thd_cp_index", "undo_bridge_deepstack_sp",
    "undo_bridge_patches", "undo_bridge_thd_cp_index", "apply_bridge_qwen25_vl_cp", "undo_bridge_qwen25_vl_cp",
    "apply_bridge_qwen3_omni_packed", "undo_bridge_qwen3_omni_packed", "apply_bridge_qwen3_vl_moe_pads",
    "undo_bridge_qwen3_vl_moe_pads",
    "apply_llava_packed_boundaries", "undo_llava_packed_boundaries", "upstream_remaps_packed_boundaries",
    "apply_all", "apply_sp_embedding_scatter", "apply_sp_padding_mask_scatter", "undo_all",
    "undo_sp_embedding_scatter", "undo_sp_padding_mask_scatter", "upstream_scatters_standalone_embeddings",
    "apply_thd_rotary", "undo_thd_rotary", "upstream_thd_rope_syncs",
]
