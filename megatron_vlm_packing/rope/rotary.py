"""Multimodal rotary embedding that stays exact under packing and context parallelism, with no host sync.

Megatron-Core's `MultimodalRotaryEmbedding` CP-slices its output with the whole-sequence zigzag.
For a packed THD batch that is wrong for every document after the first (bug class 6): each
document must be cut into its own zigzag chunks. And Megatron-Core's THD rope
(`rope_utils._apply_rotary_pos_emb_thd`), given per-token frequencies, reads `cu_seqlens` on the
host and loops over documents in every layer, for queries and keys (bug class 14).

So in THD mode this module takes FULL `[3, 1, T]` positions, selects this CP rank's tokens once per
micro-batch (the zigzag of the call's `cu_seqlens_q_padded`: the same index the tokens were
selected with, built on the device with no host sync) and returns their frequencies
`[T/cp, 1, 1, D]` marked as `CpLocalFreqs`; `patches.thd_rotary` applies such a table in every
layer as one elementwise rotation. Where that patch is not needed (an installed THD rope with no
host sync) it returns the full `[T, 1, 1, D]` table instead and Megatron-Core takes each
document's chunks (checked by `megatron_thd.thd_rope_takes_document_chunks`). In dense mode it
slices like Megatron-Core.

The mode is per call (bug class 5): `use_packed_mrope(model)` installs hooks that set the call's
THD boundaries (and `is_thd_format`) from its `packed_seq_params` on entry and restore them on
exit, exceptions included. Hooks run only through `model(...)`: a caller of `model.forward(...)` skips
them, so an installed rotary refuses (RuntimeError) to run at CP > 1 outside a hooked call.

Shape legend: B = batch, S = sequence (T when packed), Tl = T / cp, D = rotary dim, F = D / 2 frequencies.
"""

from __future__ import annotations

import inspect
import numbers

import torch
from torch import nn

from megatron_vlm_packing.parallel.cp import dense_cp_partition_index, zigzag_index
from megatron_vlm_packing.patches.owned import OwnedAttributes
from megatron_vlm_packing.rope.megatron_thd import CpLocalFreqs, thd_boundaries


def check_mrope_section(mrope_section, frequencies: int) -> None:
    """ValueError unless `mrope_section` is 3 non-negative ints (t, h, w) summing to `frequencies` (F)."""
    section = list(mrope_section)
    well_formed = len(section) == 3 and all(isinstance(n, numbers.Integral) and n >= 0 for n in section)
    if not well_formed or sum(section) != frequencies:
        raise ValueError(f"mrope_section {section} must be 3 non-negative ints (t, h, w) that sum to "
                         f"{frequencies} rotary frequencies (kv_channels * rotary_percent / 2)")


def check_position_ids(position_ids: torch.Tensor) -> None:
    """ValueError unless `position_ids` is a real-valued [3, B, S] tensor. Metadata only (no host sync).

    Integer (`get_rope_index`'s int64) or floating point: Qwen3-Omni's temporal positions are
    fractional. Their values (finite) are checked where they are read anyway, by `pack_batch`, not here,
    where a check would be a read in every layer."""
    if position_ids.dim() != 3 or position_ids.shape[0] != 3:
        raise ValueError(f"mRoPE position_ids must be [3, B, S] (t, h, w), got {tuple(position_ids.shape)}"
                         + (": packed positions are [3, 1, T]" if position_ids.dim() == 2 else ""))
    if position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
        raise ValueError(f"mRoPE position_ids must be integers or real numbers (get_rope_index gives int64, or "
                         f"float for Qwen3-Omni), got {position_ids.dtype}")


def mrope_frequencies(position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section, *,
                      interleaved: bool = False, seq_len_interpolation_factor: float | None = None) -> torch.Tensor:
    """Rotary angles of 3D positions.

    Args:
        position_ids: [3, B, S] (t, h, w) positions.
        inv_freq: [F] float32 inverse frequencies.
        mrope_section: 3 ints summing to F: frequencies taken from t, h, w.
        interleaved: Qwen3 layout (frequency i from axis i % 3 while that axis has sections left)
            instead of contiguous blocks (Qwen2/2.5, Megatron-Core).
        seq_len_interpolation_factor: positions are divided by it first (Megatron-Core's option).

    Returns:
        [S, B, 1, D] float32, D = 2F (the halves repeated, Megatron-Core's non-interleaved rotary).

    Raises:
        ValueError: `mrope_section` is not 3 non-negative ints summing to F, or `position_ids` is not a
            real-valued (integer or float) [3, B, S] tensor (checked on metadata only: no host sync).
    """
    check_mrope_section(mrope_section, inv_freq.numel())
    check_position_ids(position_ids)
    return _mrope_table(position_ids, inv_freq, mrope_section, interleaved=interleaved,
                        seq_len_interpolation_factor=seq_len_interpolation_factor)


def _mrope_table(position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section, *, interleaved: bool,
                 seq_len_interpolation_factor: float | None) -> torch.Tensor:
    """`mrope_frequencies` with its arguments already checked: [3, B, S] -> [S, B, 1, D]."""
    positions = position_ids.to(inv_freq.device).float()
    if seq_len_interpolation_factor is not None:
        positions = positions * (1 / seq_len_interpolation_factor)
    freqs = positions[..., None] * inv_freq  # [3, B, S, F]
    if interleaved:
        chosen = freqs[0].clone()
        for axis in (1, 2):
            chosen[..., axis:mrope_section[axis] * 3:3] = freqs[axis, ..., axis:mrope_section[axis] * 3:3]
    else:
        chosen = torch.cat([part[i] for i, part in enumerate(freqs.split(list(mrope_section), dim=-1))], dim=-1)
    emb = torch.cat([chosen, chosen], dim=-1)  # [B, S, D]
    return emb.transpose(0, 1)[:, :, None, :].contiguous()


def _thd_rotary_on() -> bool:
    """Asked per call, so undoing the patch can never leave CP-local tables to a rope that expects full ones."""
    from megatron_vlm_packing.patches.thd_rotary import thd_rotary_applied

    return thd_rotary_applied()


class PackedMultimodalRotaryEmbedding(nn.Module):
    """Drop-in for `GPTModel.rotary_pos_emb` with position_embedding_type="mrope"; any device."""

    def __init__(self, inv_freq: torch.Tensor, *, interleaved: bool = False, cp_group=None,
                 seq_len_interpolation_factor: float | None = None):
        super().__init__()
        _check_interleaved(interleaved)
        self.register_buffer("inv_freq", inv_freq.detach().float().clone(), persistent=False)
        self.interleaved = interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.cp_group = cp_group
        self.is_thd_format = False  # set per call by use_packed_mrope's hooks
        self.thd_params = None  # the call's PackedSeqParams in THD mode (set per call by the hooks)
        self.hooked = False  # installed by use_packed_mrope: its hooks tell THD calls apart
        self.hooked_calls = 0  # model calls in flight whose hooks ran (0: model.forward(...) called directly)

    def _apply(self, fn, recurse=True):
        """Module casts (Megatron's Float16Module calls `module.bfloat16()`) move inv_freq but keep it
        float32, as Megatron-Core's rotary (a plain attribute) does: bf16 frequencies shift the angles."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def _frequencies(self, position_ids: torch.Tensor, mrope_section) -> torch.Tensor:
        """`mrope_frequencies` of positions `forward` has checked (`check_position_ids`, once per call)."""
        check_mrope_section(mrope_section, self.inv_freq.numel())
        return _mrope_table(position_ids, self.inv_freq, mrope_section, interleaved=self.interleaved,
                            seq_len_interpolation_factor=self.seq_len_interpolation_factor)

    def _check_packed_positions(self, position_ids: torch.Tensor, cp_size: int) -> None:
        """ValueError for THD positions that are not the whole pack's [3, 1, T]; shapes and Python ints only."""
        _, rows, tokens = position_ids.shape
        if rows != 1:
            raise ValueError(f"packed (qkv_format='thd') mRoPE position_ids must be [3, 1, T], got "
                             f"{tuple(position_ids.shape)}")
        if cp_size > 1 and tokens % (2 * cp_size):
            raise ValueError(f"packed mRoPE position_ids hold T={tokens} tokens, not a multiple of 2 * "
                             f"context-parallel size {cp_size}: the rotary needs the full pack's positions")

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None, **unused) -> torch.Tensor:
        """[3, B, S] full positions -> [S, B, 1, D] (dense: this CP rank's part), or in THD mode
        [Tl, 1, 1, D] `CpLocalFreqs` of this rank's tokens (the full [T, 1, 1, D] where patches.thd_rotary is off)."""
        group = cp_group if cp_group is not None else self.cp_group
        cp_size = 1 if group is None else group.size()
        check_position_ids(position_ids)
        if self.hooked and not self.hooked_calls and cp_size > 1:
            raise RuntimeError(f"the packed mRoPE rotary ran at context-parallel size {cp_size} outside its model's "
                               f"__call__ (model.forward(...) called directly skips use_packed_mrope's hooks), so it "
                               f"cannot tell a packed THD call from a dense one and would CP-slice a packed table "
                               f"as one sequence (bug class 6): call the model itself, model(...)")
        if self.is_thd_format:
            self._check_packed_positions(position_ids, cp_size)
        if self.is_thd_format and _thd_rotary_on():
            if cp_size > 1:  # once per micro-batch: this rank's tokens, by the zigzag the tokens were selected with
                local = zigzag_index(thd_boundaries(self.thd_params), cp_size, group.rank(),
                                     local_total=position_ids.shape[-1] // cp_size)
                position_ids = position_ids.index_select(-1, local.index)
            return CpLocalFreqs.mark(self._frequencies(position_ids, mrope_section))
        emb = self._frequencies(position_ids, mrope_section)
        if self.is_thd_format or cp_size == 1:
            return emb
        index = dense_cp_partition_index(emb.shape[0], group.size(), group.rank(), device=emb.device)
        return emb.index_select(0, index)


class PackedMropeHandle:
    """What `use_packed_mrope` changed; `undo()` restores the original rotary and removes the hooks.

    Undo is stack-safe like every patch's (`patches.owned`): while something installed after us holds
    `model.rotary_pos_emb` (a wrapper around ours), it raises RuntimeError naming it and changes nothing.
    """

    def __init__(self, model, original, rotary, hooks, owned: OwnedAttributes, *, interleaved: bool):
        self.model, self.original, self.rotary, self.hooks, self.owned = model, original, rotary, hooks, owned
        self.interleaved = interleaved
        self.saved_modes: list[tuple[bool, object]] = []  # the rotary's mode before each hooked call, innermost last

    @property
    def active(self) -> bool:
        return bool(self.hooks)

    def undo(self) -> None:
        """Restore the model's own rotary, remove the hooks. A no-op once undone.

        Raises:
            RuntimeError: `model.rotary_pos_emb` (or the handle attribute) now holds something installed
                after us; undo that first. Nothing is changed.
        """
        self.owned.check()  # before anything is touched: all or nothing
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.owned.restore()


def _packed_seq_params_of(forward_signature: inspect.Signature, args, kwargs):
    """The call's `packed_seq_params`, passed by keyword or by position (GPTModel.forward's 7th)."""
    if "packed_seq_params" in kwargs:
        return kwargs["packed_seq_params"]
    try:
        bound = forward_signature.bind_partial(*args, **kwargs)
    except TypeError:  # let the forward itself report the bad call
        return None
    return bound.arguments.get("packed_seq_params")


def _check_interleaved(interleaved) -> None:
    """'no' or 1 chose the Qwen3 interleaved layout (truthy), None the contiguous one."""
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be True or False, got {interleaved!r}")


def _refuse_unservable(model) -> None:
    """ValueError/RuntimeError for a model whose rotary this module cannot replace exactly."""
    if getattr(model, "position_embedding_type", None) != "mrope":
        raise ValueError(f"use_packed_mrope needs position_embedding_type='mrope', got "
                         f"{getattr(model, 'position_embedding_type', None)!r}")
    if getattr(model.config, "apply_rope_fusion", False):
        raise ValueError("fused rope cannot take 3D mRoPE positions: build the model with apply_rope_fusion=False")
    if getattr(model.config, "rotary_interleaved", False):
        raise ValueError("rotary_interleaved=True is not supported with mRoPE (Qwen-VL rotates halves): "
                         "build the model with rotary_interleaved=False")
    if "packed_seq_params" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes no packed_seq_params: cannot tell THD calls apart")


def _patch_thd_rope_or_refuse() -> None:
    """Apply `patches.thd_rotary` (CP-local tables applied as one op) where the installed THD rope
    syncs; otherwise that rope must take each document's chunks from a full table, or RuntimeError."""
    from megatron_vlm_packing.patches.thd_rotary import apply_thd_rotary
    from megatron_vlm_packing.rope.megatron_thd import thd_rope_takes_document_chunks

    if apply_thd_rotary():
        return
    if not thd_rope_takes_document_chunks():
        raise RuntimeError("the installed megatron-core's _apply_rotary_pos_emb_thd does not take each document's "
                           "CP chunks from a full packed frequency table; packed mRoPE would be silently wrong here "
                           "(megatron-core 0.16.1 and 0.19.2 do this right)")


def use_packed_mrope(model, *, interleaved: bool = False) -> PackedMropeHandle:
    """Replace an mrope GPTModel's rotary with `PackedMultimodalRotaryEmbedding`; per-call THD mode.

    Applies `patches.thd_rotary` (process-wide, idempotent; `undo()` leaves it on, other models may
    use it) where the installed THD rope reads boundaries on the host; the rotary then returns
    CP-local tables. Idempotent: a second call returns the existing handle (ValueError if it asks for
    another `interleaved`); `handle.undo()` is stack-safe (`PackedMropeHandle`). Raises ValueError for a model that is
    not mrope, uses fused rope (Megatron-Core's fused kernels take no 3D positions) or interleaved
    rotary halves, and RuntimeError where Megatron-Core's THD rope would not take each document's
    CP chunks from the full table (`megatron_thd.thd_rope_takes_document_chunks`), or where
    `patches.thd_rotary` cannot apply (another plugin's wrapper holds the THD rope it would replace). The model must be
    called as `model(...)` (the hooks run in `__call__`); at CP > 1 the rotary refuses a direct `model.forward`.
    """
    _check_interleaved(interleaved)
    existing = _existing_handle(model, interleaved)
    if existing is not None:
        return existing
    _refuse_unservable(model)
    _patch_thd_rope_or_refuse()
    original = model.rotary_pos_emb
    rotary = PackedMultimodalRotaryEmbedding(
        original.inv_freq, interleaved=interleaved, cp_group=getattr(original, "cp_group", None),
        seq_len_interpolation_factor=getattr(original, "seq_len_interpolation_factor", None))
    enter = _mode_hook(inspect.signature(model.forward))
    rotary.hooked = True
    owned = OwnedAttributes(f"{__name__}.use_packed_mrope")
    owned.set(model, "rotary_pos_emb", rotary)
    hooks = [model.register_forward_pre_hook(enter, with_kwargs=True),
             model.register_forward_hook(_restore_mode, with_kwargs=True, always_call=True)]
    handle = PackedMropeHandle(model, original, rotary, hooks, owned, interleaved=interleaved)
    owned.set(model, "_packed_mrope_handle", handle)
    return handle


def _existing_handle(model, interleaved: bool) -> PackedMropeHandle | None:
    """The active handle of an earlier `use_packed_mrope` on `model` (None: none), or ValueError when it
    was applied with another `interleaved`."""
    existing = getattr(model, "_packed_mrope_handle", None)
    if existing is not None and existing.active:
        if existing.interleaved != interleaved:
            raise ValueError(f"use_packed_mrope was already applied to this {type(model).__name__} with "
                             f"interleaved={existing.interleaved}, now asked for interleaved={interleaved}: "
                             f"call handle.undo() first to change the mRoPE layout")
        return existing
    return None


# The hooks reach the rotary through the model they run on (its handle), never a closure: a deep copy
# of the model (an EMA or teacher copy) shares these hook functions, and must set its own rotary's mode.
def _mode_hook(forward_signature: inspect.Signature):
    """The forward pre-hook: save the rotary's mode, then set it from the call's `packed_seq_params`."""
    def enter(module, args, kwargs):
        params = _packed_seq_params_of(forward_signature, args, kwargs)
        handle = module._packed_mrope_handle
        rotary = handle.rotary
        handle.saved_modes.append((rotary.is_thd_format, rotary.thd_params))
        rotary.hooked_calls += 1
        rotary.is_thd_format = params is not None and params.qkv_format == "thd"
        rotary.thd_params = params if rotary.is_thd_format else None

    return enter


def _restore_mode(module, args, kwargs, output=None):
    """The forward hook (always called, exceptions included): restore the mode the pre-hook saved."""
    handle = module._packed_mrope_handle
    if handle.saved_modes:  # empty only if an earlier pre-hook raised before ours ran
        handle.rotary.is_thd_format, handle.rotary.thd_params = handle.saved_modes.pop()
        handle.rotary.hooked_calls -= 1
