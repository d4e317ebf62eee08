"""One storage for every tensor of a micro-batch packed in a DataLoader worker.

A worker hands its result to the main process one tensor storage at a time: each storage is moved
to shared memory (a file, a mapping, its pages touched) and mapped again on the other side. On our
2-core dev machine that is about 0.8 ms a storage, more than packing itself: a micro-batch of
4 x 2048 tokens packed by `PackingCollator` held 8 storages and reached the main process in 8.3 ms,
Megatron-Bridge's packed dict (6 storages) in 6.0 ms. Laid out in one byte buffer, every tensor a
view at an aligned offset, the micro-batch is one storage; pinning it and moving it to the device
are then one copy each, not one per tensor (`collate.map_tensors` moves the buffer once).

Only tensors under `LARGE_BYTES` are laid out there: copying costs about 1 ms per 5 MB here, more
than sending a storage of its own, and a VLM micro-batch's pixels are tens of MB. Through a worker,
8 samples with 6400 patches of 1176 floats (30 MB of pixels): 29.7 ms per micro-batch with every
tensor in the buffer, 10.6 ms with none, 4.2 ms with tensors of 4 MiB and more left out (1 MiB:
4.6 ms); at 64 x 32768 (ids, labels, positions 5.75 MB each) 33.4, 28.4 and 27.3 ms; at 4 x 2048
(all small) 3.5, 8.8 and 3.4 ms. Large tensors keep their storage and move on their own.

Shape legend: nothing here looks at shapes; every tensor keeps its own shape and dtype.
"""

from __future__ import annotations

import torch

# Each view starts at a multiple of this many bytes (every dtype's alignment, and a cache line).
ALIGN = 64
# Tensors of at least this many bytes keep their own storage (see the module docstring).
LARGE_BYTES = 4 << 20


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (not of its storage)."""
    return tensor.numel() * tensor.element_size()


def into_one_storage(tensors: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Copies of `tensors`, all views of one new uint8 buffer (contiguous, same shapes, dtypes, values).

    The buffer is ordinary process memory, also in a DataLoader worker. Allocating it in shared
    memory up front (`UntypedStorage._new_shared`) saves the worker one copy, but that copy is made
    by the DataLoader's queue feeder thread while the worker collates the next batch; done in the
    collate call it is on the critical path instead. Side by side through a real worker, one
    thread, 3 rounds: private memory 0.96-1.13x the speed of shared (1.13x at 32 x 32768 and
    64 x 32768, 1.00-1.05x at 16 x 8192, 64 x 2048, 64 x 16384, 4 x 2048).

    Args:
        tensors: CPU tensors, each listed once, without autograd.

    Returns:
        id(original) -> its copy.
    """
    offsets, total = [], 0
    for tensor in tensors:
        if not tensor.is_cpu or tensor.requires_grad:
            raise ValueError(f"into_one_storage takes CPU tensors without autograd, got one on {tensor.device} "
                             f"(requires_grad={tensor.requires_grad})")
        offsets.append(total)
        total += _aligned(nbytes(tensor))
    buffer = torch.empty(total, dtype=torch.uint8)
    copies = {}
    for tensor, offset in zip(tensors, offsets):
        copy = view_at(buffer, offset, tensor)
        copy.copy_(tensor)
        copies[id(tensor)] = copy
    return copies


def view_at(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor of `like`'s shape and dtype at byte `offset` of the uint8 `buffer`."""
    # One call, not a slice and two views: a third of the cost, paid per tensor on both sides of a worker.
    start = buffer.storage_offset() + offset
    return torch.empty(0, dtype=like.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), start // like.element_size(), like.shape)


def arena_of(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, frozenset[int]] | None:
    """The buffer `into_one_storage` laid some of `tensors` out in, and the ids of those views; None
    when no storage is exactly tiled by its views.

    A storage holding two or more of `tensors` is the arena when they are contiguous and its size is
    the sum of their 64-byte-aligned sizes: a storage that also holds bytes none of them views (a
    batch tensor sliced, say) is not moved whole. Empty tensors take no room and are left out.
    """
    groups: dict[int, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    shared = [views for views in groups.values() if len(views) > 1]
    if len(shared) != 1:
        return None
    views = shared[0]
    storage = views[0].untyped_storage()
    if any(not v.is_contiguous() for v in views) or storage.nbytes() != sum(_aligned(nbytes(v)) for v in views):
        return None
    return torch.empty(0, dtype=torch.uint8, device=views[0].device).set_(storage), frozenset(map(id, views))


def _aligned(size: int) -> int:
    """`size` bytes rounded up to a multiple of ALIGN."""
    return -(-size // ALIGN) * ALIGN


def byte_offset(tensor: torch.Tensor) -> int:
    """Where a view of a buffer starts in it, in bytes."""
    return tensor.storage_offset() * tensor.element_size()


def all_in_one_storage(tensors: list[torch.Tensor]) -> bool:
    """Every non-empty one of `tensors` is a view of one arena (`arena_of`): what a worker sends as one
    storage."""
    arena = arena_of(tensors)
    return arena is not None and arena[1] == {id(t) for t in tensors if t.numel()}
