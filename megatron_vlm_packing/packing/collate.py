"""Packing in the DataLoader's worker processes: the step then only moves tensors and runs the model.

`PackingCollator` is a `collate_fn`: it collates the samples (your function), then on the CPU, in
the worker, reads the real lengths, plans, packs tokens / labels / loss weights / positions (mRoPE
per sample included), builds the padding mask, `PackedSeqParams` and every CP rank's partition
index, and returns one typed `MicroBatch` (a `LoaderMicroBatch`, which DataLoader's
`pin_memory=True` pins) whose tensors are views of one buffer (`packing.arena`): the worker sends
one storage, not one per tensor, and pinning and the move to the device copy it once. `pack_batch(host_reads=True)` reads the lengths first and checks ids, labels and loss weights over the
packed tokens (a read costs no sync on the host). `make_forward_step` takes such a micro-batch from the iterator as it is:
`to_device` moves its tensors with `non_blocking=True`, and nothing on the step's path reads a
value back to the host (checked by `testing.sync_counter`: 0 syncs for a packed forward + backward).

    loader = DataLoader(dataset, batch_size=8, num_workers=4, pin_memory=True,
                        collate_fn=PackingCollator(collate=my_collate, cp_size=2, mrope=rope_config))
    forward_step = make_forward_step()  # packs in the step only when the iterator yields dicts

The collator packs for one parallel layout (tp/cp/sp/fp8): the step refuses a micro-batch whose
alignment does not match the model's layout (a ValueError naming both). Likewise for mRoPE: the micro-batch
records the `MRopeConfig` that made its positions (`MicroBatch.mrope_config`), and the step refuses one
made with another config than the model's (`make_forward_step(mrope=)`, else the model's own, e.g.
`PackedVLM(mrope=)`), naming each differing field that makes positions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from megatron_vlm_packing.packing.arena import LARGE_BYTES, arena_of, byte_offset, into_one_storage, nbytes, view_at
from megatron_vlm_packing.packing.bounds import checked_int
from megatron_vlm_packing.packing.micro_batch import BatchStats, IdsMark, MicroBatch, boundaries_mark
from megatron_vlm_packing.packing.indices import PackIndices, apply_once
from megatron_vlm_packing.packing.plan import PackMultiples, PackPlan
from megatron_vlm_packing.packing.row_fields import check_dense_tensors


class LoaderMicroBatch(MicroBatch):
    """A `MicroBatch` packed in a DataLoader worker; `pin_memory()` lets DataLoader pin it."""

    def pin_memory(self) -> "LoaderMicroBatch":
        return map_tensors(self, lambda t: t.pin_memory())


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackingCollator:
    """`collate_fn` that returns a packed `MicroBatch` built on the CPU (see the module docstring).

    Attributes:
        collate: samples -> a collated, right-padded batch dict (what `pack_batch` takes); None when
            the dataset already yields batch dicts (`batch_size=None` in the DataLoader).
        tp_size, cp_size, sequence_parallel, fp8, pad_to: the layout the pack is aligned for.
        label_style, mrope, pad_token_id, extra_keys, pack_options: passed to `pack_batch`
            (`pack_options`: any other keyword of it, e.g. image_token_id).
        mrope: give the model's own `MRopeConfig` (the one `make_forward_step(mrope=)` or the model's
            adapter holds): each micro-batch records it (`MicroBatch.mrope_config`) and the step refuses
            one whose config differs from the model's in a field that makes positions (merge size,
            placeholder ids, tokens_per_second, text_offset, family, ...; not mrope_section /
            mrope_interleaved, which only lay out the model's rotary). Positions from a callable record
            nothing and are not checked (a callable cannot be compared with the model's config).
    """

    collate: Callable[[list], dict] | None = None
    tp_size: int = 1
    cp_size: int = 1
    sequence_parallel: bool = False
    fp8: bool = False
    pad_to: int | None = None
    label_style: str = "hf"
    mrope: object = None
    pad_token_id: int = 0
    extra_keys: tuple[str, ...] = ()
    pack_options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        from megatron_vlm_packing.packing.batch import check_pack_options

        check_collate(self.collate, "PackingCollator")
        _check_pack_fields(self)
        PackMultiples.for_parallel(tp_size=self.tp_size, cp_size=self.cp_size,
                                   sequence_parallel=self.sequence_parallel, fp8=self.fp8)  # checks the sizes
        own = tuple(f.name for f in dataclasses.fields(self) if f.name not in ("collate", "pack_options"))
        check_pack_options(self.pack_options, "PackingCollator", taken=own)

    @property
    def multiples(self) -> PackMultiples:
        return PackMultiples.for_parallel(tp_size=self.tp_size, cp_size=self.cp_size,
                                          sequence_parallel=self.sequence_parallel, fp8=self.fp8)

    def __call__(self, samples) -> LoaderMicroBatch:
        from megatron_vlm_packing.packing.batch import pack_batch

        batch = self.collate(samples) if self.collate is not None else samples
        # Any mapping, as pack_batch takes: a Hugging Face processor's BatchFeature is a UserDict, not a dict.
        if not isinstance(batch, Mapping):
            raise ValueError(f"PackingCollator got {type(batch).__name__}: give collate= (samples -> batch dict), "
                             f"or let the dataset yield batch dicts")
        check_dense_tensors(batch)  # before .cpu(): of a meta tensor a NotImplementedError
        on_host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        packed = pack_batch(on_host, tp_size=self.tp_size, cp_size=self.cp_size,
                            sequence_parallel=self.sequence_parallel, fp8=self.fp8, pad_to=self.pad_to,
                            label_style=self.label_style, mrope=self.mrope, pad_token_id=self.pad_token_id,
                            extra_keys=self.extra_keys, **{"host_reads": True, **self.pack_options})
        return for_the_loader(packed, self.cp_size)


def _check_pack_fields(collator: PackingCollator) -> None:
    """The collator's own pack_batch options, checked when it is built as pack_batch checks them (not in a
    DataLoader worker at the first batch). fp8 is checked with the sizes, by `PackMultiples.for_parallel`."""
    from megatron_vlm_packing.packing.rows import check_pack_arguments, checked_extra_keys

    check_pack_arguments(label_style=collator.label_style, pad_to=collator.pad_to, pad_token_id=collator.pad_token_id,
                         mrope=collator.mrope)
    checked_extra_keys(collator.extra_keys)


def check_collate(collate, owner: str) -> None:
    """A collator's `collate` is a callable or None: anything else was a TypeError in a DataLoader worker
    at the first batch ('int' object is not callable)."""
    if collate is not None and not callable(collate):
        raise ValueError(f"{owner}'s collate must be a callable (samples -> batch dict) or None, got {collate!r}")


def for_the_loader(packed: MicroBatch, cp_size: int) -> LoaderMicroBatch:
    """A micro-batch packed on the host, made ready in the worker: every CP rank's index built
    (`prepare_indices`; cp_size 1 for a model that selects its CP tokens itself), its small tensors in
    one storage (`in_one_storage`), typed `LoaderMicroBatch` so that DataLoader's `pin_memory=True` pins it.
    A dense micro-batch (`pad_batch`) has no pack indices to build.

    Raises:
        ValueError: `cp_size` not an int >= 1, or a `cp_size` > 1 whose 2*cp_size chunks the pack's documents
            do not divide (it was packed for another cp_size), naming both cp sizes and the misfit documents.
    """
    checked_int(cp_size, "cp_size", least=1)
    if isinstance(packed.indices, PackIndices):
        _check_packed_for_cp(packed.plan, cp_size)
        prepare_indices(packed.indices, cp_size)
    return in_one_storage(LoaderMicroBatch(**{f.name: getattr(packed, f.name) for f in dataclasses.fields(MicroBatch)}))


def _check_packed_for_cp(plan: PackPlan, cp_size: int) -> None:
    """ValueError, naming both cp sizes, when `cp_size`'s CP index cannot split the pack's documents: the index
    refused it naming only the misfit lengths, not that the pack was made for another cp. (A pack whose lengths
    happen to divide is split as before.)"""
    misfit = [(i, n) for i, n in enumerate(plan.physical_lengths) if n % (2 * cp_size)] if cp_size > 1 else []
    if misfit:
        segment = plan.multiples.segment
        raise ValueError(f"for_the_loader: cp_size={cp_size} but the micro-batch was packed for "
                         f"cp_size={segment // 2 if segment > 1 else 1} (segment multiple {segment}): a CP rank's "
                         f"index splits each document into 2*cp_size={2 * cp_size} chunks, and (document, length) "
                         f"{misfit[:8]} do not divide; pack with cp_size={cp_size}, or pass the cp_size it was packed "
                         f"for (1 for a model that selects its CP tokens itself)")


def prepare_indices(indices: PackIndices, cp_size: int) -> None:
    """Build, here, what the step would otherwise build: every CP rank's index and the pad-slot mask."""
    indices.is_real  # noqa: B018 (a cached property: built now, carried to the step)
    if cp_size > 1:
        for rank in range(cp_size):
            indices.cp_index(cp_size, rank)


# Values that hold no tensor (the micro-batch's flags, sizes and names).
_LEAVES = frozenset({type(None), bool, int, float, str, tuple, frozenset, torch.device, torch.dtype})


def tensors_of(micro_batch: MicroBatch) -> list[torch.Tensor]:
    """Every tensor `micro_batch` holds, each once (fields, boundaries, media, extras, cached indices)."""
    found: dict[int, torch.Tensor] = {}

    def walk(value) -> None:
        if type(value) in _LEAVES:
            return
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, PackIndices):
            walk(value.__getstate__())
        elif dataclasses.is_dataclass(value) and not isinstance(value, (PackPlan, BatchStats)):  # no tensors
            for name in value.__dataclass_fields__:
                walk(getattr(value, name))

    walk(micro_batch)  # reads, rebuilds nothing: a third of `_map_each`'s cost
    return list(found.values())


def in_one_storage(micro_batch: MicroBatch) -> MicroBatch:
    """`micro_batch` with every CPU tensor under `arena.LARGE_BYTES` copied into one buffer
    (`arena.into_one_storage`: one storage to send from a worker, pin and move); larger ones (a VLM's
    pixels), and any carrying autograd (the copy would cut it off), are kept as they are.

    Raises:
        ValueError: in a DataLoader worker, a tensor carries a graph (naming its fields).
    """
    tensors = tensors_of(micro_batch)
    # In a DataLoader worker, no tensor may carry a graph: torch's queue refuses to pickle a non-leaf
    # tensor with requires_grad in its feeder thread, drops the micro-batch, and the loader waits forever.
    # In process the graph reaches the batch (kept as is).
    if any(t.grad_fn is not None for t in tensors) and torch.utils.data.get_worker_info() is not None:
        _refuse_graphs(micro_batch)
    copies = into_one_storage([t for t in tensors if nbytes(t) < LARGE_BYTES and t.is_cpu and not t.requires_grad])
    return _map_each(micro_batch, lambda t: copies.get(id(t), t))


def _refuse_graphs(micro_batch: MicroBatch) -> None:
    """ValueError naming the fields of `micro_batch` whose tensors carry a graph (error path only)."""
    named = [(f.name, getattr(micro_batch, f.name)) for f in dataclasses.fields(micro_batch)
             if f.name not in ("checked_loss_mask", "checked_labels", "checked_positions")]  # named once, as themselves
    for holder in ("vision", "audio"):
        value = getattr(micro_batch, holder)
        named += [(f"{holder}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)] if value else []
    named += [(f"extras[{key!r}]", value) for key, value in micro_batch.extras.items()]
    graph = [name for name, value in named if isinstance(value, torch.Tensor) and value.grad_fn is not None]
    if graph:
        raise ValueError(f"{graph} carry autograd (requires_grad, built from other tensors): a DataLoader worker "
                         f"cannot send them (the loader would wait forever); detach them in collate")


def map_tensors(micro_batch: MicroBatch, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
    """A copy of `micro_batch` with `fn` (a move: pin, copy to a device; same shape and dtype) applied
    to every tensor it holds, once per tensor object (the boundaries shared by `packed_seq_params`,
    `rope_cu_seqlens` and `indices` stay shared). A micro-batch whose tensors are views of one buffer
    (`in_one_storage`) has `fn` applied to the buffer, once, and its views rebuilt there; tensors
    outside the buffer are moved one by one.

    Raises:
        ValueError: `fn` did not return a uint8 tensor of the buffer's shape (a cast, a slice), or
            `micro_batch` is not a MicroBatch.
    """
    _check_micro_batch(micro_batch, "map_tensors")
    arena = arena_of(tensors_of(micro_batch))
    if arena is None:
        return _map_each(micro_batch, fn)
    buffer, inside = arena
    moved = fn(buffer)
    # The views are rebuilt by byte offset on what `fn` returned: a cast (`t.float()`) or a reshape of
    # the uint8 buffer would silently give every view other bytes, so anything but a move is refused.
    if not isinstance(moved, torch.Tensor) or moved.dtype != torch.uint8 or moved.shape != buffer.shape:
        got = f"{moved.dtype} {tuple(moved.shape)}" if isinstance(moved, torch.Tensor) else type(moved).__name__
        raise ValueError(f"map_tensors' fn must keep each tensor's dtype and shape (a move: pin, copy to a device); "
                         f"it turned the micro-batch's buffer (torch.uint8 {tuple(buffer.shape)}) into {got}")
    return _map_each(micro_batch, lambda t: view_at(moved, byte_offset(t), t) if id(t) in inside else fn(t))


def own_storages(micro_batch: MicroBatch) -> MicroBatch:
    """A copy of `micro_batch` whose tensors each own their storage, for `torch.save`.

    The collators lay a micro-batch's small tensors out as views of one byte buffer (`in_one_storage`),
    and `torch.save` refuses tensors of different dtypes that view one storage ("Cannot save multiple
    tensors or storages that view the same data as different types"). The views are copied out (tensors
    shared between fields stay shared); a micro-batch without a buffer is returned as it is. Anything but a
    `MicroBatch` is a ValueError (a dict of its fields came back as it was, its views still refused).
    """
    _check_micro_batch(micro_batch, "own_storages")
    arena = arena_of(tensors_of(micro_batch))
    if arena is None:
        return micro_batch
    _, inside = arena
    return _map_each(micro_batch, lambda t: t.clone() if id(t) in inside else t)


def _check_micro_batch(value, owner: str) -> None:
    if not isinstance(value, MicroBatch):
        raise ValueError(f"{owner} takes a MicroBatch (what the collators return), got {type(value).__name__}")


def _map_each(micro_batch: MicroBatch, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
    """`map_tensors` tensor by tensor."""
    memo: dict[int, torch.Tensor] = {}
    once = apply_once(fn, memo)

    def fields(obj):
        if obj is None:
            return None
        return dataclasses.replace(obj, **{f.name: once(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                            if isinstance(getattr(obj, f.name), torch.Tensor)})

    indices = micro_batch.indices
    if isinstance(indices, PackIndices):
        indices = indices.map_tensors(fn, memo)
    input_ids, vision, audio = once(micro_batch.input_ids), fields(micro_batch.vision), fields(micro_batch.audio)
    params = fields(micro_batch.packed_seq_params)
    return dataclasses.replace(
        micro_batch, input_ids=input_ids, labels=once(micro_batch.labels),
        loss_mask=once(micro_batch.loss_mask), position_ids=once(micro_batch.position_ids),
        padding_mask=once(micro_batch.padding_mask), packed_seq_params=params,
        rope_cu_seqlens=once(micro_batch.rope_cu_seqlens), vision=vision,
        audio=audio, extras={k: once(v) for k, v in micro_batch.extras.items()},
        indices=indices, cp_index=once(micro_batch.cp_index),
        checked_loss_mask=once(micro_batch.checked_loss_mask),  # the same tensor as loss_mask stays the same
        checked_labels=once(micro_batch.checked_labels),  # likewise the same tensor as labels
        checked_positions=once(micro_batch.checked_positions),  # and as position_ids
        checked_boundaries=boundaries_mark(params) if micro_batch.boundaries_checked else None,  # the moved copy
        # the packer's media marks follow the moved objects only if they held before the move
        checked_media=(input_ids, vision, audio) if micro_batch.media_checked_by_packer else None,
        checked_ids=_moved_ids_mark(micro_batch, input_ids))


def _moved_ids_mark(micro_batch: MicroBatch, input_ids: torch.Tensor) -> IdsMark | None:
    """`checked_ids` for the moved `input_ids`: the same bounds, if the mark held for the ids before the move."""
    mark = micro_batch.checked_ids
    return mark._replace(input_ids=input_ids) if mark is not None and mark.input_ids is micro_batch.input_ids else None


def micro_batch_to(micro_batch: MicroBatch, device: torch.device) -> MicroBatch:
    """Every tensor of the micro-batch on `device`, copied with `non_blocking=True` (asynchronous
    from pinned memory); nothing is read back to the host.

    Args:
        device: a torch.device, a device string ('cpu', 'cuda:0'), or an int: an index of the machine's
            accelerator, as `torch.device(3)` reads it ('cuda:3' on an NVIDIA machine). A negative int or a bool
            is no device.

    Raises:
        ValueError: `device` is no device (torch.device() refuses it, with torch's reason; `Tensor.to(None)` moved
            nothing), or the micro-batch holds meta tensors (`micro_batch_to(mb, "meta")`: no values) and `device`
            is not meta.
    """
    if not isinstance(device, torch.device):
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            reason = str(error).splitlines()[0]  # torch's TypeError lists every signature after its first line
            raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                             f"got {device!r} (an int is an accelerator device index >= 0, as torch.device(3) "
                             f"reads it; a bool is none): {reason}") from None

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta and device.type != "meta":  # else torch's NotImplementedError ('Cannot copy out of meta')
            names = meta_fields(micro_batch)
            shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            raise ValueError(f"the micro-batch holds meta tensors (no values): {shown}; it cannot move to {device}; "
                             f"move the micro-batch the collator returned, not its meta copy")
        return tensor.to(device, non_blocking=True)

    return map_tensors(micro_batch, move)


def meta_fields(holder, prefix: str = "") -> list[str]:
    """Dotted names of the meta tensors (no values) among `holder`'s fields, its dataclass fields' fields and its
    dicts' entries (`packed_seq_params.max_seqlen_q`, `vision.pixel_values`, `extras['name']`): the error path of
    `micro_batch_to`, which names what cannot move."""
    found = []
    items = holder.items() if isinstance(holder, dict) else \
        ((f.name, getattr(holder, f.name)) for f in dataclasses.fields(holder))
    for name, value in items:
        path = f"{prefix}[{name!r}]" if isinstance(holder, dict) else f"{prefix}{'.' if prefix else ''}{name}"
        if isinstance(value, torch.Tensor) and value.is_meta:
            found.append(path)
        elif isinstance(value, dict) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            found.extend(meta_fields(value, path))
    return found


def check_layout(micro_batch: MicroBatch, multiples: PackMultiples) -> None:
    """A loader-packed micro-batch must be aligned for the model's layout.

    Raises:
        ValueError: its plan's multiples differ from `multiples` (naming both).
    """
    plan = micro_batch.plan
    if micro_batch.is_packed and plan is not None and plan.multiples != multiples:
        raise ValueError(f"the micro-batch was packed for {plan.multiples} but the model's layout needs {multiples}: "
                         f"build the PackingCollator with the model's tp_size, cp_size, sequence_parallel and fp8")


def micro_batch_from_loader(micro_batch: MicroBatch, *, multiples: PackMultiples, device: torch.device) -> MicroBatch:
    """The step's stage for an already-packed micro-batch: check its alignment, move it (non-blocking)."""
    check_layout(micro_batch, multiples)
    return micro_batch_to(micro_batch, device)
