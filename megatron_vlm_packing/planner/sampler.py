"""`PackedBatchSampler`: the epoch plan as a PyTorch batch sampler, one per data-parallel rank.

Each item is the list of dataset indices of one bin (one packed micro-batch) of this rank, in plan
order, so a `DataLoader(dataset, batch_sampler=sampler, collate_fn=...)` whose collate right-pads
the samples and calls `pack_batch(..., pad_to=capacity)` yields exactly the packs the planner
laid out. Every rank builds the same plan (same metadata, config and seed) and takes its share;
`check_same_plan_across_ranks(group)` checks that they do (a collective: every rank of the group calls it).

Where it plugs in:
- Megatron-LM (`--dataloader-type external`): build the DataLoader per rank with
  `dp_rank=parallel_state.get_data_parallel_rank()` and return its iterator from your
  `train_valid_test_datasets_provider`; Megatron then calls `forward_step` once per micro-batch.
- Megatron-Bridge: pass the DataLoader (or its iterator) where a custom dataset provider returns
  loaders; the step is the same.
Run `micro_batches_per_step()` micro-batches per optimizer step (it lists the steps the next
iteration yields: after a resume, the rest of the epoch's steps). Megatron's fixed global batch
(`--micro-batch-size 1 --global-batch-size M*DP`, one bin per micro-batch) matches
`micro_batches_per_rank=M` with `tail="carry"`: every step then has exactly M micro-batches per
rank. `tail="short_step"` and `samples_per_step` give steps of varying length, for loops that pass
`num_microbatches` per step to `get_forward_backward_func`.

Resume: `state_dict()` records the epoch, how many micro-batches this rank has taken, the samples
carried in from the previous epoch, and the layout the plan was made under (`layout_record`: the
dataset's size and fingerprints, every planner setting that moves samples between bins); the plan is
rebuilt from the seed and iteration resumes at the next micro-batch. `load_state_dict` refuses a
state saved under another layout (a ValueError naming the field and both values): its position
would point at other samples; and one holding a key no format saves (a typo, or another object's
state). The state is plain Python values (`torch.save` / `torch.load` with
`weights_only=True` read it), and every rank saves the same state at the same count. A state of
the earlier format (no layout) still loads, with a warning that only its seed, dataset size and DP
size were checked.

With prefetching loaders the sampler runs ahead of training: pass the count of the epoch's
micro-batches actually trained, from the epoch's start (after a resume at p: p + those trained
since), to `state_dict(consumed=...)`; one below p is refused (it would train micro-batches again).
A count above the micro-batches this epoch has yielded so far means the sampler has already moved
on while training finishes the previous epoch (a DataLoader prefetches across the boundary), and
the state is that of the previous epoch. An epoch that gives no rank a micro-batch (a dataset too
small for one step: everything carried into the next epoch) is a ValueError when it is planned.
`set_epoch` on the epoch a `load_state_dict` resumed keeps its place (the usual
`for epoch in ...: sampler.set_epoch(epoch)` loop after a resume would otherwise repeat it).
`len(sampler)` (a DataLoader's len) counts what the next iteration yields: after a resume, the rest
of the epoch; once the epoch is done or `set_epoch` starts another, all of the next one.
"Done" counts from the last micro-batch taken: a new iteration started after `next()` took it (the
old iterator not yet exhausted) yields the next epoch, and the old iterator then ends without moving
the sampler on again (an iterator whose epoch the sampler has left yields nothing more).
"""

from __future__ import annotations

import warnings
from typing import Iterator

import torch.distributed as dist
import torch.utils.data

from megatron_vlm_packing.packing.bounds import checked_int, is_int
from megatron_vlm_packing.packing.row_fields import check_flags
from megatron_vlm_packing.planner.epoch_plan import EpochPlan, PlannerConfig
from megatron_vlm_packing.planner.fixed_samples import check_steps_split
from megatron_vlm_packing.planner.metadata import SampleTable
from megatron_vlm_packing.planner.sampler_state import (  # noqa: F401 (layout_record: its home was here)
    STATE_FORMAT, STATE_KEYS, layout_record, plan_disagreement, planning_fields, rank_record, shown_field,
    state_fields,
)
from megatron_vlm_packing.planner.schedule import plan_epoch


def _no_step_error(plan: EpochPlan, num_samples: int, carried: tuple[int, ...], config: PlannerConfig) -> ValueError:
    """The error for an epoch whose plan gives no rank a micro-batch (everything carried into the next epoch)."""
    step = (f"samples_per_step={config.samples_per_step}" if config.samples_per_step is not None
            else f"dp_size={config.dp_size} x micro_batches_per_rank={config.micro_batches_per_rank}")
    fewer = "a smaller samples_per_step" if config.samples_per_step is not None else "fewer micro_batches_per_rank"
    return ValueError(
        f"epoch {plan.epoch} gives no rank a micro-batch: its {num_samples + len(carried)} sample(s) "
        f"({len(carried)} carried in) fill less than one step ({step}), so all of them would be carried into the "
        f"next epoch untrained, and a loop over epochs would train nothing while they pile up (until one step holds "
        f"many copies of each); use more samples, fewer ranks, {fewer}"
        + (", or tail='short_step'" if config.tail == "carry" else ""))


def _check_not_before_resume(consumed: int, epoch: int, resumed_at: int) -> None:
    """ValueError when `consumed` lies below the position load_state_dict resumed `epoch` at."""
    if consumed < resumed_at:
        raise ValueError(f"consumed={consumed} is below {resumed_at}, the micro-batches of epoch {epoch} trained "
                         f"before this sampler resumed it (load_state_dict): consumed counts the epoch's micro-batches "
                         f"trained in all, so count them from the epoch's start ({resumed_at} + those trained since); "
                         f"a state at {consumed} would train micro-batches {consumed} to {resumed_at - 1} again")


class PackedBatchSampler(torch.utils.data.Sampler):
    """Yields `list[int]` sample indices per micro-batch of rank `dp_rank`, epoch after epoch.

    Args:
        table: metadata of every sample of the dataset (index i = dataset index i).
        config: the planner configuration (its `dp_size` is the number of ranks).
        dp_rank: this rank, 0 <= dp_rank < config.dp_size.
        progress: draw a progress line on stderr while planning.
    """

    def __init__(self, table: SampleTable, config: PlannerConfig, *, dp_rank: int, progress: bool = False) -> None:
        if not isinstance(table, SampleTable):  # else an AttributeError when the first plan is built
            raise ValueError(f"table must be a SampleTable, got {type(table).__name__}")
        if not isinstance(config, PlannerConfig):
            raise ValueError(f"config must be a PlannerConfig, got {type(config).__name__}")
        check_flags(progress=progress)  # checked here, not when the first epoch is planned
        if not is_int(dp_rank) or not 0 <= dp_rank < config.dp_size:
            raise ValueError(f"dp_rank={dp_rank!r} must lie in [0, {config.dp_size})")
        # A step of samples_per_step that some epoch's shuffle could make unsplittable: refused now, not
        # in whatever epoch first draws it.
        check_steps_split(table, config)
        self.table, self.config, self.dp_rank, self.progress = table, config, dp_rank, progress
        self._epoch, self._position, self._carried = 0, 0, ()
        self._plans: dict[tuple[int, tuple[int, ...]], EpochPlan] = {}  # (epoch, carried in) -> plan
        # Bumped whenever the sampler moves to another epoch (or restarts one): an iterator started
        # under another serial stops yielding and does not move the sampler on when it finishes.
        self._serial = 0
        # (epoch, carried into it, micro-batches of this rank, resumed at) of the epoch iteration last
        # finished: a prefetching loader ends an epoch before training does, and state_dict(consumed=)
        # may still count micro-batches of it.
        self._previous: tuple[int, tuple[int, ...], int, int] | None = None
        self._resumed = False  # the position came from load_state_dict (set_epoch keeps it)
        # Micro-batches of the current epoch trained before load_state_dict resumed it: a `consumed`
        # below them goes back to micro-batches already trained.
        self._resumed_at = 0
        self._layout: dict | None = None  # layout_record(table, config), built on first use

    def layout(self) -> dict:
        """`layout_record(self.table, self.config)`, built once (it hashes the table)."""
        if self._layout is None:
            self._layout = layout_record(self.table, self.config)
        return self._layout

    def check_same_plan_across_ranks(self, group=None) -> None:
        """ValueError on every rank of `group` unless each of its ranks takes its own share of one plan.

        A collective (one all_gather of a small dict per rank): every rank of `group` must call it, at the
        same place, e.g. once after building the sampler (and after `load_state_dict`), before iterating.
        `group` is the data-parallel group, None for the world; in Megatron pass
        `parallel_state.get_data_parallel_group()` (with TP, PP or CP the world holds other ranks). Under
        NCCL the current CUDA device must be this rank's (Megatron sets it). Compared: every field of
        `layout_record` (the table's fingerprints: one table in another order differs, the planner
        settings), the epoch, the position in it and the samples carried into it, as `state_dict()` has
        them; and the group must have `config.dp_size` ranks, each a different `dp_rank`. The error names
        each field that differs, its values and the ranks (in the group) holding each. Never called
        implicitly (`__iter__` does not): Megatron-LM builds loaders on some ranks only, and a collective
        there would hang.

        Without torch.distributed initialised there is no other rank to compare with: a sampler with
        dp_size=1 passes, one with a larger dp_size is a ValueError (its ranks cannot be checked).
        """
        if not (dist.is_available() and dist.is_initialized()):
            if self.config.dp_size == 1:
                return
            raise ValueError(f"check_same_plan_across_ranks compares dp_size={self.config.dp_size} ranks but "
                             f"torch.distributed is not initialised: call it after init_process_group, on every rank")
        caught = None
        try:
            record = rank_record(self.state_dict(), self.dp_rank)
        except Exception as error:  # gathered: the other ranks raise too, not wait in the collective forever
            record, caught = None, error
        gathered = [None] * dist.get_world_size(group)
        failure = None if caught is None else f"{type(caught).__name__}: {caught}"
        dist.all_gather_object(gathered, {"record": record, "failure": failure}, group=group)
        if caught is not None:
            raise caught
        failed = [(rank, item["failure"]) for rank, item in enumerate(gathered) if item["failure"] is not None]
        if failed:
            raise ValueError(f"check_same_plan_across_ranks: rank {failed[0][0]} of the group could not record its "
                             f"plan ({failed[0][1]}); {len(failed)} rank(s) failed")
        problem = plan_disagreement([item["record"] for item in gathered])
        if problem is not None:
            raise ValueError(problem)

    def plan(self) -> EpochPlan:
        """The plan of the current epoch and the samples carried into it (built once for them)."""
        return self._plan_of(self._epoch, self._carried)

    def _plan_of(self, epoch: int, carried: tuple[int, ...]) -> EpochPlan:
        """The plan of `epoch` with `carried` in, built once (plans of the epochs next to it are kept)."""
        key = (epoch, carried)
        if key not in self._plans:
            plan = plan_epoch(self.table, self.config, epoch=epoch, carried_in=carried, progress=self.progress)
            if not plan.steps:  # a DataLoader of length 0, epoch after epoch, while the carried samples pile up
                raise _no_step_error(plan, len(self.table), carried, self.config)
            self._plans = {k: v for k, v in self._plans.items() if k[0] in (epoch - 1, epoch + 1)}
            self._plans[key] = plan
        return self._plans[key]

    def _taken_all(self) -> bool:
        """This epoch's last micro-batch was taken by an iterator that has not finished yet: the next
        iteration (and `len`, `micro_batches_per_step`, `state_dict`) starts the next epoch."""
        return bool(self._position) and self._position == self._epoch_length()

    def _upcoming(self) -> tuple[EpochPlan, int]:
        """The plan the next iteration yields from, and its position there."""
        if self._taken_all():
            return self._plan_of(self._epoch + 1, self.plan().carried), 0
        return self.plan(), self._position

    def carried_over(self) -> tuple[int, ...]:
        """Sample indices the epoch the next iteration yields starts with, carried over from the epoch before
        it (its last samples, fewer than a step: tail="carry", or too few for a last step). They are trained
        first in that epoch, so after the loop over the last epoch a run trains, these were never trained:
        `len(sampler.carried_over())` says how many (at most a step's worth). Empty before the first epoch.
        """
        return self.plan().carried if self._taken_all() else self._carried

    def micro_batches_per_step(self) -> list[int]:
        """Micro-batches every rank runs in each step the next iteration yields; sums to `len(self)`.

        A fresh epoch (or one `set_epoch` started): every step of it. After a resume (or a paused
        iteration) at position p: the steps not yet finished, the first shortened by the micro-batches
        of it already taken when p lies inside a step. Plan steps of 2 micro-batches, `[2, 2, 2]`:
        p=2 -> `[2, 2]`, p=3 -> `[1, 2]` (the rest of the step p fell in runs as a step of its own, so
        the steps after it stay those of the plan). Call it before iterating: a loader that prefetches
        has moved the sampler's position on.
        """
        plan, taken = self._upcoming()
        counts = [len(step.ranks[self.dp_rank]) for step in plan.steps]
        for i, count in enumerate(counts):
            if taken < count or taken == 0:
                return [count - taken, *counts[i + 1:]]
            taken -= count
        return []

    def __len__(self) -> int:
        """Micro-batches the next iteration yields: the rest of the current epoch (all of it, unless a
        `load_state_dict` or a paused iteration has already taken its first ones; all of the next one
        once its last was taken)."""
        plan, position = self._upcoming()
        return len(plan.micro_batches(self.dp_rank)) - position

    def _epoch_length(self) -> int:
        """Micro-batches of this rank in the whole current epoch."""
        return len(self.plan().micro_batches(self.dp_rank))

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch; when it is exhausted, the sampler moves to the next epoch.

        An iteration started (its first `next`) after an earlier one took the epoch's last micro-batch
        but has not finished moves the sampler to the next epoch first and yields that one. An earlier
        iterator whose epoch the sampler has left (that way, or by `set_epoch` / `load_state_dict`)
        yields nothing more and, exhausted, does not move the sampler on again. Two iterators within
        one epoch share its position.
        """
        if self._taken_all():
            self._finish_epoch()
        serial, plan = self._serial, self.plan()
        bins = plan.micro_batches(self.dp_rank)
        while self._serial == serial and self._position < len(bins):
            self._position += 1
            yield list(bins[self._position - 1].samples)
        if self._serial == serial:
            self._finish_epoch()

    def _finish_epoch(self) -> None:
        """Move from the current epoch (all of it taken) to the start of the next one."""
        self._previous = (self._epoch, self._carried, self._epoch_length(), self._resumed_at)
        self._epoch, self._position, self._carried = self._epoch + 1, 0, self.plan().carried
        self._resumed, self._resumed_at, self._serial = False, 0, self._serial + 1

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning (samples carried so far stay carried); the epoch a
        `load_state_dict` resumed keeps its place instead (its first micro-batches were trained)."""
        checked_int(epoch, "epoch", least=0)
        if self._resumed and int(epoch) == self._epoch:
            return
        self._epoch, self._position, self._resumed, self._previous = int(epoch), 0, False, None
        self._resumed_at, self._serial = 0, self._serial + 1

    def state_dict(self, consumed: int | None = None) -> dict:
        """Where this rank stands: epoch, micro-batches taken (or `consumed`), carried samples.

        `consumed` counts the epoch's micro-batches trained from its start, those before a resume
        included: below the position `load_state_dict` resumed it at is a ValueError (resuming there
        would train them again). Above the micro-batches yielded in this epoch it counts micro-batches
        of the epoch the sampler just finished (a prefetching loader runs ahead over the epoch
        boundary); more than either epoch yielded is a ValueError (resuming there would skip
        samples). A position at the end of an epoch is recorded as the start of the next one (with
        the samples it carries in), whether or not the iterator has finished: the same state either way.
        """
        epoch, position, carried = self._epoch, self._position, self._carried
        if consumed is not None:
            epoch, position, carried = self._consumed_at(consumed)
        if position and epoch == self._epoch and position == self._epoch_length():
            # the whole epoch taken, its iterator not yet finished: the state it will have when it is
            epoch, position, carried = epoch + 1, 0, self.plan().carried
        return {
            "format": STATE_FORMAT,
            "epoch": epoch,
            "position": position,
            "carried": list(carried),
            "layout": dict(self.layout()),
        }

    def _consumed_at(self, consumed) -> tuple[int, int, tuple[int, ...]]:
        """(epoch, position, carried) where `consumed` micro-batches of an epoch were trained: this epoch's,
        or the one the sampler just finished (see `state_dict`). ValueError for a count no epoch yielded
        (resuming there would skip), and for one below the position load_state_dict resumed that epoch at
        (counted from the resume, not the epoch's start: resuming there would train micro-batches again)."""
        if not is_int(consumed):  # int(1.5) was 1
            raise ValueError(f"consumed must be an int (micro-batches trained) or None, got {consumed!r}")
        consumed, position, previous = int(consumed), self._position, self._previous
        if 0 <= consumed <= position:
            _check_not_before_resume(consumed, self._epoch, self._resumed_at)
            return self._epoch, consumed, self._carried
        if previous is not None and position < consumed <= previous[2]:
            # Training is still in the previous epoch; resuming at the new one would skip the
            # rest of the previous epoch and the first `consumed` micro-batches of this one.
            _check_not_before_resume(consumed, previous[0], previous[3])
            if consumed == previous[2]:  # the previous epoch is done: the new one from 0
                return self._epoch, 0, self._carried
            return previous[0], consumed, previous[1]
        limit = position if previous is None else max(position, previous[2])
        raise ValueError(f"consumed={consumed} must lie in [0, {limit}]: this rank's sampler has yielded "
                         f"{position} micro-batch(es) of epoch {self._epoch}"
                         + (f" after {previous[2]} of epoch {previous[0]}" if previous is not None else ""))

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`. ValueError, naming the field and both values, if it was saved under
        another layout (any field of `layout_record`: dataset, bin layout, DP size, micro-batches per
        rank, tail, seed, ...), or at a position past the end of its epoch; the sampler is then
        unchanged. A position at the end of its epoch (saved after the last micro-batch was taken,
        before the iterator finished) resumes at the start of the next epoch. A state of format 1
        (before the layout was recorded) still loads, with a warning: only its seed, dataset size and
        DP size can be checked."""
        epoch, position, carried = state_fields(state)
        self._check_layout(state)
        plan = self._plan_of(epoch, carried)
        length = len(plan.micro_batches(self.dp_rank))
        if not 0 <= position <= length:
            raise ValueError(f"sampler state has position={position} but epoch {epoch} has {length} "
                             f"micro-batch(es) on this rank (an edited state, or one of format 1 saved under "
                             f"another layout?)")
        self._epoch, self._position, self._carried = epoch, position, carried
        self._previous, self._resumed, self._resumed_at, self._serial = None, True, position, self._serial + 1
        if position and position == length:  # saved at the end of an epoch: resume at the next one
            self._epoch, self._position, self._carried, self._resumed_at = epoch + 1, 0, plan.carried, 0

    def _check_layout(self, state: dict) -> None:
        """ValueError if `state` was saved under another layout than this sampler's."""
        version = state.get("format", 1)
        if not is_int(version):  # True == 1 read as format 1; a tensor(2) == 2 failed as a KeyError below
            raise ValueError(f"sampler state has format={version!r}; this version reads formats 1 and {STATE_FORMAT}")
        if version == 1:
            saved = {key: state.get(key) for key in ("num_samples", "dp_size", "seed")}
            warnings.warn("sampler state of format 1 records only num_samples, dp_size and seed: a change of "
                          "capacity, micro_batches_per_rank, tail or the other planner settings since it was "
                          "saved goes unnoticed (and resumes at other samples); the next state_dict() records them",
                          stacklevel=3)
        elif version == STATE_FORMAT:
            if not isinstance(state.get("layout"), dict):  # else an AttributeError ('get')
                raise ValueError(f"sampler state has {shown_field(state, 'layout')}: it must be a dict (what "
                                 f"state_dict() saved)")
            saved = planning_fields(state["layout"])
        else:
            raise ValueError(f"sampler state has format={version!r}; this version reads formats 1 and {STATE_FORMAT}")
        # A key no format saves is read by nothing here: a typo ("postion") or another object's state
        # resumed as if it were this one's.
        unread = sorted(map(repr, set(state) - STATE_KEYS[version]))
        if unread:
            raise ValueError(f"sampler state of format {version} has key(s) {', '.join(unread)} that no sampler "
                             f"saves (it saves {sorted(STATE_KEYS[version])}): is it this sampler's state_dict()?")
        mine = self.layout() if version == STATE_FORMAT else {key: self.layout()[key] for key in saved}
        for key in [*mine, *(k for k in saved if k not in mine)]:
            if key not in saved or key not in mine or saved[key] != mine[key]:
                raise ValueError(f"sampler state has {shown_field(saved, key)} but this sampler has "
                                 f"{shown_field(mine, key)}: it was saved under another layout or dataset, and "
                                 f"resuming at its position would skip or repeat samples")
