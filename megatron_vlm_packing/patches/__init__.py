"""Megatron-Core patches, in one place. None is applied on import; each is idempotent and reversible.

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
"""

from megatron_vlm_packing.patches.llava_boundaries import (
    apply_llava_packed_boundaries, undo_llava_packed_boundaries, upstream_remaps_packed_boundaries,
)
from megatron_vlm_packing.patches.thd_rotary import apply_thd_rotary, undo_thd_rotary, upstream_thd_rope_syncs
from megatron_vlm_packing.patches.gpt_model_forward import (
    apply_sp_embedding_scatter, apply_sp_padding_mask_scatter, undo_sp_embedding_scatter,
    undo_sp_padding_mask_scatter, upstream_scatters_standalone_embeddings,
)


def apply_all() -> dict[str, bool]:
    """Apply every patch; returns which are active here."""
    return {"sp_embedding_scatter": apply_sp_embedding_scatter(),
            "sp_padding_mask_scatter": apply_sp_padding_mask_scatter(),
            "llava_packed_boundaries": apply_llava_packed_boundaries(),
            "thd_rotary": apply_thd_rotary()}


def undo_all() -> None:
    undo_thd_rotary()
    undo_llava_packed_boundaries()
    undo_sp_padding_mask_scatter()
    undo_sp_embedding_scatter()


__all__ = [
    "apply_llava_packed_boundaries", "undo_llava_packed_boundaries", "upstream_remaps_packed_boundaries",
    "apply_all", "apply_sp_embedding_scatter", "apply_sp_padding_mask_scatter", "undo_all",
    "undo_sp_embedding_scatter", "undo_sp_padding_mask_scatter", "upstream_scatters_standalone_embeddings",
    "apply_thd_rotary", "undo_thd_rotary", "upstream_thd_rope_syncs",
]
