"""Patch of Megatron-Bridge's Qwen3-VL `split_deepstack_embs` (as `modelling_qwen3_vl.model` and the
Qwen3-Omni thinker's dense path call it): deepstack embeddings cut per sequence-parallel rank with a
backward that gathers.

Under TP + SP every TP rank runs the (replicated) vision tower on all images, then keeps only the
deepstack embeddings of its own SP chunk of the sequence by plain indexing. The backward of that
indexing gives each TP rank's tower the gradient of its own chunk only, so the replicated vision
parameters get partial, rank-dependent gradients (found on CPU with megatron-bridge 0.6.2: 21
vision parameters off by up to 1.2 relative, TP ranks' copies disagreeing). The main embedding path
does it right: `scatter_to_sequence_parallel_region`, whose backward all-gathers.

The patch keeps Bridge's split (which rows each rank keeps, including its CP x SP order for dense
rows) and replaces the cut by `_ScatterRows`: forward keeps this rank's rows, backward puts this
rank's gradient rows in place and all-reduces over the TP group, so every TP rank's tower sees the
gradient of every row. (CP parts stay partial: Megatron sums replicated grads over DP x CP.)

Defect check (`upstream_deepstack_split_is_plain_slice`): split a probe with tp_size=2, tp_rank=0
and backpropagate: a plain cut leaves zero gradient on the other rank's rows without any
collective. A split that raises (an upstream whose backward gathers needs a process group) and a
module without `split_deepstack_embs` are RuntimeErrors, never read as fixed: the adapters would then
accept TP + SP with rank-partial vision gradients.
Delete once Bridge scatters deepstack embeddings with a gathering backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_vlm_packing.bridge.imports import import_bridge_module
from megatron_vlm_packing.patches.owned import OwnedAttributes, patch_target, probe_failure

QWEN3_VL_MODEL = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
# Every module that imports the split by name and calls it: Qwen3-VL's model, and the Qwen3-Omni thinker
# (its dense path under SP; the packed path, patches.bridge_qwen3_omni_packed, never calls it).
_HOLDERS = (QWEN3_VL_MODEL, "megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model")
_OWNED = OwnedAttributes(__name__)  # the holders' split_deepstack_embs while the patch is applied


class _ScatterRows(torch.autograd.Function):
    """rows [N, H] -> rows[keep] [n, H]; backward: zeros [N, H], this rank's rows filled, summed over TP.

    An autograd.Function because the backward needs a collective over the TP group (the rows the
    other TP ranks keep get their gradient there).
    """

    @staticmethod
    def forward(ctx, rows, keep, group):
        ctx.save_for_backward(keep)
        ctx.num_rows, ctx.group = rows.shape[0], group
        return rows.index_select(0, keep)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        full = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        full.index_copy_(0, keep, grad)
        dist.all_reduce(full, group=ctx.group)
        return full, None, None


def upstream_deepstack_split_is_plain_slice() -> bool:
    """True when Bridge's split gives the other SP rank's rows no gradient (the defect).

    Judged on Bridge's own split even while the patch is applied: the module's function is then ours,
    which reported the defect gone (and, with parallel state up, ran its TP all-reduce in the probe).

    Raises:
        RuntimeError: the split is gone, or it raised on the probe (forward or backward; named, with the
            exception): neither answer can be told.
    """
    split = _OWNED.original("split_deepstack_embs") or patch_target(import_bridge_module(QWEN3_VL_MODEL),
                                                                     "split_deepstack_embs", __name__)
    try:
        # Its own graph whatever the caller's mode: an adapter built under torch.no_grad() asks here too.
        with torch.inference_mode(False), torch.enable_grad():
            probe = torch.ones(4, 1, requires_grad=True)
            _, (cut,) = split(torch.ones(1, 4, dtype=torch.bool), [probe], tp_size=2, tp_rank=0,
                              cp_size=1, cp_rank=0, sequence_parallel=True)
            cut.sum().backward()
    except Exception as err:  # a changed upstream (a gathering backward needs a group): not one we know
        raise probe_failure(split, err, __name__) from err
    return probe.grad is not None and float(probe.grad.sum()) < probe.shape[0]


def _gathering_split(original, tp_group_of):
    def split_deepstack_embs(visual_pos_masks, deepstack_visual_embeds, tp_size=1, tp_rank=0, cp_size=1,
                             cp_rank=0, sequence_parallel=False):
        kwargs = dict(tp_size=tp_size, tp_rank=tp_rank, cp_size=cp_size, cp_rank=cp_rank,
                      sequence_parallel=sequence_parallel)
        if visual_pos_masks is None or not deepstack_visual_embeds or not (sequence_parallel and tp_size > 1):
            return original(visual_pos_masks, deepstack_visual_embeds, **kwargs)
        rows = deepstack_visual_embeds[0].shape[0]
        # Bridge's own split of the row numbers says which rows this rank keeps.
        masks, (keep,) = original(visual_pos_masks, [torch.arange(rows, device=visual_pos_masks.device)], **kwargs)
        group = tp_group_of()
        return masks, [_ScatterRows.apply(embeds, keep, group) for embeds in deepstack_visual_embeds]

    return split_deepstack_embs


def is_applied() -> bool:
    return _OWNED.active()


def apply_bridge_deepstack_sp() -> bool:
    """Give Qwen3-VL's deepstack SP cut a gathering backward. Idempotent; returns whether active.

    Raises:
        RuntimeError: the defect probe cannot tell (`upstream_deepstack_split_is_plain_slice`); nothing is applied.
    """
    if _OWNED.active():
        return True
    if not upstream_deepstack_split_is_plain_slice():
        return False
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    from megatron.core import parallel_state

    original = import_bridge_module(QWEN3_VL_MODEL).split_deepstack_embs
    replacement = _gathering_split(original, parallel_state.get_tensor_model_parallel_group)
    for module in _holder_modules():
        if getattr(module, "split_deepstack_embs", None) is original:
            _OWNED.set(module, "split_deepstack_embs", replacement)
    return True


def _holder_modules() -> list:
    """Qwen3-VL's model module, and each other holder that imports here (one that cannot is never used)."""
    modules = [import_bridge_module(QWEN3_VL_MODEL)]
    for name in _HOLDERS[1:]:
        try:
            modules.append(import_bridge_module(name))
        except ImportError:
            continue
    return modules


def undo_bridge_deepstack_sp() -> None:
    """Restore Bridge's split_deepstack_embs. A no-op when not applied.

    Raises:
        RuntimeError: a later patch replaced it; nothing is restored.
    """
    _OWNED.restore()
