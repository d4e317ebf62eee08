"""The step's checks of what no packer made or checked: loss weights, labels, positions, packed boundaries (every
field of `packed_seq_params`, and `rope_cu_seqlens`: `train.plan_boundaries`) that a `transform=`, a
`dataclasses.replace` or a hand-built `MicroBatch` gave the micro-batch. Each runs only when the
packer's mark (`MicroBatch.checked_*`) does not vouch for the field: the packers' own micro-batches, moved or not,
cost nothing here. The step queues every check that runs and reads their results back together
(`check_unpacked_fields`: one host sync for a micro-batch with any such field); each `check_*` below reads alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from megatron_vlm_packing.packing.checks import DeferredChecks
from megatron_vlm_packing.packing.micro_batch import IdsMark, MicroBatch
from megatron_vlm_packing.train.plan_boundaries import (
    queue_own_boundary_fields, queue_plan_boundaries, queue_rope_boundaries, with_the_plans_tensors)


class OneRead(DeferredChecks):
    """`DeferredChecks` whose values are moved to the first queued value's device: a hand-built micro-batch's fields
    may lie on several (`localize` names that after these checks), and the read is one `cat`."""

    def add(self, values, fails: Callable[[list], bool], raiser: Callable | None, *, screen: bool = False) -> int:
        device = self.entries[0][0][0].device if self.entries else values.device
        return super().add(values.to(device), fails, raiser, screen=screen)

    def add_fault(self, fault: torch.Tensor, raiser: Callable[[], None]) -> None:
        """Queue `fault` ([..] bool, True where a value is bad) as one flag; `raiser` names the first fault."""
        self.add(fault.any().long().reshape(1), lambda v: v[0] != 0, raiser)


def check_unpacked_fields(micro_batch: MicroBatch, vocab_size: int | None, *, ids: bool = False,
                          unembedded_token_id: int | None = None) -> MicroBatch:
    """The step's checks of fields no packer checked, in this order, read back together: loss weights
    (`check_unpacked_loss_weights`), labels (`check_unpacked_labels`), sequence fields that are no tensors
    (`localize.check_field_types`, metadata), dense positions (`check_unpacked_dense_positions`), packed boundaries
    and positions (`check_packed_documents`), `rope_cu_seqlens` (`plan_boundaries.queue_rope_boundaries`), and with
    `ids` (the adapter `checks_unpacked_ids`) the ids in [0, vocab_size), `unembedded_token_id` (the adapter's: LLaVA's
    image token) excepted (`queue_ids_screen`).

    Returns:
        `micro_batch`, with the plan's own boundary tensors in place of those the read found equal to them
        (`plan_boundaries.with_the_plans_tensors`: `localize` then reads none), and clean ids marked
        (`checked_ids`: the adapter's `check_unpacked_ids` then reads none; bad ones it reads and names, in its order).

    Raises:
        ValueError: the first fault, as the check that finds it names it. One host sync when any check runs.
    """
    from megatron_vlm_packing.packing.localize import check_field_types

    checks = OneRead()
    queue_loss_weights(micro_batch, checks)
    queue_labels(micro_batch, vocab_size, checks)
    check_field_types(micro_batch)  # metadata only: a list or None is named here, not an AttributeError below
    queue_dense_positions(micro_batch, checks)
    queue_packed_documents(micro_batch, checks)
    queue_rope_boundaries(micro_batch, checks)
    screened = queue_ids_screen(micro_batch, vocab_size, checks, unembedded_token_id) if ids else None
    host = checks.read()  # the one host sync (none queued: none)
    if screened is not None and host[screened][0] == 0:
        micro_batch = replace(micro_batch, checked_ids=IdsMark(micro_batch.input_ids, vocab_size, unembedded_token_id))
    return with_the_plans_tensors(micro_batch)


def queue_ids_screen(micro_batch: MicroBatch, vocab_size: int | None, checks: OneRead,
                     unembedded_token_id: int | None = None) -> int | None:
    """Queue whether ids no packer checked (not `MicroBatch.ids_checked`) hold a value outside [0, vocab_size) (< 0
    when None) at a slot that does not hold `unembedded_token_id`, as `models.adapter.check_unpacked_ids` checks
    them, without raising: the adapter names a bad id in its own `check`, after its other refusals, as before.
    Returns the entry's index in `checks`' read (its one value is 0 when the ids are clean), or None when nothing
    was queued (checked ids; ids that are no integer tensor, which `check_unpacked_ids` names). LLaVA's ids are
    its collapsed ones, one slot per image token: the ids its embedding reads, the image tokens replaced."""
    from megatron_vlm_packing.packing.checks import as_rows, is_integer_tensor

    ids = micro_batch.input_ids
    if micro_batch.ids_checked(vocab_size, unembedded_token_id) or not isinstance(ids, torch.Tensor) \
            or not is_integer_tensor(ids):
        return None
    rows = as_rows(ids)
    bad = rows < 0
    if vocab_size is not None:
        bad = bad | (rows >= vocab_size)
    if unembedded_token_id is not None:
        bad = bad & (rows != unembedded_token_id)
    return checks.add(bad.any().long().reshape(1), lambda values: False, None)  # never raises: the adapter names it


def _read_alone(queue: Callable[[OneRead], None]) -> None:
    checks = OneRead()
    queue(checks)
    checks.read()


def check_unpacked_loss_weights(micro_batch: MicroBatch) -> None:
    """`queue_loss_weights`, read alone."""
    _read_alone(lambda checks: queue_loss_weights(micro_batch, checks))


def queue_loss_weights(micro_batch: MicroBatch, checks: OneRead) -> None:
    """Loss weights no packer checked (a MicroBatch built by hand, or whose `loss_mask` a transform
    replaced: it is not the packer's `checked_loss_mask`) must be finite and >= 0 at every slot, as
    `pack_batch` requires of real tokens: a NaN, inf or negative weight would reach the loss. Micro-
    batches packed by `pack_batch` / `pad_batch` / the collators were checked when packed: no sync here.

    Raises:
        ValueError: a loss_mask that is not a real tensor; at the read, naming the loss_mask slot (row, position)
            and its value.
    """
    if micro_batch.loss_weights_checked:
        return
    from megatron_vlm_packing.packing.checks import as_rows, check_loss_weights

    weights = micro_batch.loss_mask
    if not isinstance(weights, torch.Tensor) or weights.is_complex():
        raise ValueError(f"loss_mask must be a real tensor of per-token weights, got "
                         f"{weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__}")
    rows = as_rows(weights)
    as_float32 = rows.float()  # what the loss reads: a float64 weight above float32's range is inf there
    checks.add_fault(~(torch.isfinite(as_float32) & (as_float32 >= 0)),
                     lambda: check_loss_weights(rows, torch.ones_like(rows, dtype=torch.bool)))


def check_unpacked_labels(micro_batch: MicroBatch, vocab_size: int | None) -> None:
    """`queue_labels`, read alone."""
    _read_alone(lambda checks: queue_labels(micro_batch, vocab_size, checks))


def queue_labels(micro_batch: MicroBatch, vocab_size: int | None, checks: OneRead) -> None:
    """Labels no packer checked (a transform's, a `replace`: not the packer's `checked_labels`), or checked
    below no vocabulary or a larger one (`MicroBatch.vocab_checked`), must be an integer tensor of -100 or
    token ids in [0, vocab_size) at every slot (>= 0 when the vocabulary is unknown): a label >= the
    vocabulary reached Megatron's vocab-parallel cross entropy, which masks it (the token's loss silently
    the log-sum-exp of its logits). Labels packed below this vocabulary were checked: no sync here.

    Raises:
        ValueError: labels that are no integer tensor; at the read, naming the first bad slot (row, position), its
            value and the count (micro-batches with labels of their own only).
    """
    if micro_batch.labels_checked and micro_batch.vocab_checked(vocab_size):
        return
    from megatron_vlm_packing.packing.batch import IGNORE_INDEX
    from megatron_vlm_packing.packing.checks import check_label_values, integer_token_rows

    rows = integer_token_rows(micro_batch.labels, "labels")
    bad = (rows != IGNORE_INDEX) & (rows < 0)
    if vocab_size is not None:
        bad = bad | (rows >= vocab_size)
    checks.add_fault(bad, lambda: check_label_values(rows, torch.ones_like(rows, dtype=torch.bool), vocab_size))


def check_unpacked_dense_positions(micro_batch: MicroBatch) -> None:
    """`queue_dense_positions`, read alone."""
    _read_alone(lambda checks: queue_dense_positions(micro_batch, checks))


def queue_dense_positions(micro_batch: MicroBatch, checks: OneRead) -> None:
    """Dense positions no packer made (a micro-batch built by hand, or whose `position_ids` a transform replaced:
    not the packer's `checked_positions`) must hold one document per row: a real token at position 0 (on every
    channel, for mRoPE) after the row's first real token starts another document, which a dense causal row lets
    attend to every document before it (Megatron-Core's dense rotary does not even read the positions: the row
    trained as one document, silently). `pad_batch` refuses such 1D positions; packing with `document_lengths`
    gives each document its own segment. Packed micro-batches and the packers' dense ones: no sync here.

    Raises:
        ValueError: positions that do not lay out the rows, a pack without its boundaries; at the read, naming the
            row, the slot where it restarts and the real tokens before it (dense micro-batches with positions of their
            own only).
    """
    if micro_batch.is_packed or micro_batch.positions_checked or not _positions_readable(micro_batch):
        return
    from megatron_vlm_packing.packing.localize import check_not_a_stripped_pack

    check_not_a_stripped_pack(micro_batch)  # a pack that lost its boundaries is named as one (no read)
    from megatron_vlm_packing.packing.positions import position_restarts

    positions, real = micro_batch.position_ids, micro_batch.padding_mask.logical_not()
    try:  # [1, L] positions stand for every row, as the model broadcasts them
        real = real.expand(torch.broadcast_shapes(positions.shape[-2:], real.shape))
    except RuntimeError:
        raise ValueError(f"position_ids of shape {tuple(positions.shape)} do not lay out the dense rows of the "
                         f"padding_mask {tuple(real.shape)}: [B, L] or mRoPE [3, B, L]") from None
    restarts = position_restarts(positions, real)  # [B, L]
    checks.add_fault(restarts, lambda: _refuse_dense_restart(restarts, real))


def _refuse_dense_restart(restarts: torch.Tensor, real: torch.Tensor) -> None:
    """ValueError naming the first restart of `restarts` ([B, L] bool, one at least). Reads back (error path)."""
    row, slot = (int(i) for i in torch.nonzero(restarts)[0])
    raise ValueError(f"position_ids row {row} restarts at 0 at slot {slot} (after {int(real[row, :slot].sum())} "
                     f"real tokens): the dense row holds several documents, and a dense causal row lets each "
                     f"attend to the ones before it; give the collated batch to make_forward_step(pack=True) "
                     f"(with document_lengths= for rows of several documents), or one document per row")


def _positions_readable(micro_batch: MicroBatch) -> bool:
    """Positions and padding mask are real tensors the restart checks can read; others are named by `localize`'s
    `check_field_types` (a complex or non-tensor field was an AttributeError or a TypeError here)."""
    return all(isinstance(t, torch.Tensor) and not t.is_complex() and not t.is_meta
               for t in (micro_batch.position_ids, micro_batch.padding_mask))


def check_unpacked_packed_positions(micro_batch: MicroBatch) -> None:
    """`queue_packed_positions`, read alone."""
    _read_alone(lambda checks: queue_packed_positions(micro_batch, checks))


def queue_packed_positions(micro_batch: MicroBatch, checks: OneRead) -> None:
    """Packed positions no packer made (a micro-batch built by hand, or whose positions a transform replaced: not
    the packer's `checked_positions`), or the packer's beside boundaries it did not make (not `boundaries_checked`:
    they restart where the plan's documents do), must restart only where a document of `packed_seq_params` starts:
    a real token at position 0 (every channel, for mRoPE) after a real token of its own segment opens another document
    inside it, and attention runs over whole segments, so it attended to the documents before it (bug class 11;
    the step trained it silently). The packers' micro-batches, moved or not: no sync here. Fields that are no
    tensors or positions of another length are left to `localize`'s checks, which name them.

    Raises:
        ValueError: malformed boundaries (`packed_params_checks.check_packed_seq_params`); at the read, naming the
            document, its slots, the slot where positions restart and the real tokens before it.
    """
    if not _packed_positions_to_read(micro_batch):
        return
    from megatron_vlm_packing.packing.packed_params_checks import check_packed_seq_params
    from megatron_vlm_packing.packing.positions import position_restarts, real_before_in_segment

    check_packed_seq_params(micro_batch)  # metadata only: well-formed boundary tensors before they are used
    if not _positions_lay_out_pack(micro_batch):
        return  # localize names positions that do not lay out the pack
    params = micro_batch.packed_seq_params
    bounds = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    real = micro_batch.padding_mask.logical_not().reshape(1, -1)  # [1, T]
    restarts = position_restarts(micro_batch.position_ids, real, real_before=real_before_in_segment(real, bounds))
    checks.add_fault(restarts, lambda: _refuse_packed_restart(restarts, real, bounds))


def reads_packed_positions(micro_batch: MicroBatch) -> bool:
    """Whether `queue_packed_positions` queues a read: a pack whose positions and boundaries are not both the
    packer's, with positions and padding mask that lay it out (others are named by `localize`'s checks)."""
    return _packed_positions_to_read(micro_batch) and _positions_lay_out_pack(micro_batch)


def _packed_positions_to_read(micro_batch: MicroBatch) -> bool:
    packers = micro_batch.positions_checked and micro_batch.boundaries_checked  # the plan's documents, both
    return micro_batch.is_packed and not packers and _positions_readable(micro_batch)


def _positions_lay_out_pack(micro_batch: MicroBatch) -> bool:
    positions = micro_batch.position_ids
    return positions.shape[-1] == micro_batch.padding_mask.numel() and positions.dim() in (2, 3)


def _refuse_packed_restart(restarts: torch.Tensor, real: torch.Tensor, bounds: torch.Tensor) -> None:
    """ValueError naming the first restart of `restarts` ([1, T] bool, one at least) and its document of `bounds`
    ([N+1] physical boundaries). Reads back (error path)."""
    slot = int(torch.nonzero(restarts)[0, 1])
    starts = bounds.long().cpu()
    document = int(torch.searchsorted(starts[1:], torch.tensor(slot), right=True))
    end = int(starts[document + 1]) - 1 if document + 1 < starts.numel() else real.shape[1] - 1
    first = int(starts[document])
    raise ValueError(f"position_ids restart at 0 at slot {slot} inside document {document} (slots "
                     f"{first}..{end}), after {int(real[0, first:slot].sum())} real tokens: the document holds "
                     f"several, and attention runs over each document of packed_seq_params whole, so each attends "
                     f"to the ones before it; give every document its own boundaries (pack_batch does, with "
                     f"document_lengths= for rows of several documents)")


def check_packed_documents(micro_batch: MicroBatch) -> None:
    """`queue_packed_documents`, read alone."""
    _read_alone(lambda checks: queue_packed_documents(micro_batch, checks))


def queue_packed_documents(micro_batch: MicroBatch, checks: OneRead) -> None:
    """A packed micro-batch's boundaries against its plan (`queue_plan_boundaries`), then its positions against its
    boundaries (`queue_packed_positions`) unless the positions are the packer's and the boundaries the plan's (a
    fault in the boundaries is raised first). Without a plan, its `max_seqlen_*` and `pad_between_seqs` against its
    own boundaries, in the read of its positions (`plan_boundaries.queue_own_boundary_fields`), then the positions.
    The packers' own micro-batches, moved or not (the loader's too): nothing queued.

    Raises:
        ValueError: at the read, boundaries that are not the plan's, a `max_seqlen_*` or `pad_between_seqs` its
            boundaries refuse, or positions that restart inside a document of them.
    """
    if not micro_batch.is_packed:
        return
    if queue_plan_boundaries(micro_batch, checks):
        if not micro_batch.positions_checked:
            queue_packed_positions(micro_batch, checks)
        return
    if reads_packed_positions(micro_batch):  # no plan: the positions are read against these boundaries, and
        queue_own_boundary_fields(micro_batch, checks)  # max_seqlen_* / pad_between_seqs against them, in that read
    queue_packed_positions(micro_batch, checks)
