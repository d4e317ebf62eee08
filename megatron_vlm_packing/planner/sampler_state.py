"""What a `PackedBatchSampler` state records and how a saved one is read back.

`layout_record` is the layout the plan was made under (the dataset's size and fingerprints, every
planner setting that moves samples between bins); `load_state_dict` compares it field by field.
`state_fields` reads the position fields of a saved state, each checked.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from megatron_vlm_packing.packing.bounds import is_int
from megatron_vlm_packing.planner.metadata import SampleTable, count_array
from megatron_vlm_packing.planner.epoch_plan import PlannerConfig

STATE_FORMAT = 2
"""`state_dict()["format"]`. 2 records the layout (`layout_record`); 1 (no "format" key, before
the layout was recorded) holds only seed, num_samples and dp_size besides the position."""


def _fingerprint(*arrays: np.ndarray) -> str:
    """16 hex digits of a blake2b hash of integer arrays (their shapes included): a few seconds per GB."""
    digest = hashlib.blake2b(digest_size=8)
    for array in arrays:
        array = np.ascontiguousarray(array, dtype="<i8")
        digest.update(repr(array.shape).encode())
        digest.update(array)
    return digest.hexdigest()


def _plain(value):
    """A numpy scalar as its Python value: the state must load under torch.load(weights_only=True)."""
    return value.item() if isinstance(value, np.generic) else value


def shown_field(record: dict, key: str) -> str:
    """`key=value` of `record`, or `no key` (a field missing from a saved state or layout)."""
    return f"{key}={record[key]!r}" if key in record else f"no {key}"


def layout_record(table: SampleTable, config: PlannerConfig) -> dict:
    """What decides which samples land in which micro-batch, as plain values keyed by field name.

    The dataset (its size, a fingerprint of its columns and of the token counts
    `config.expanded_tokens` gives) and every planner setting that moves samples between bins.
    Not recorded: `layout.oversize` (a plan under "error" has no oversize sample, so "own_bin" plans
    it the same; the other way round, planning raises), the rank (every rank's state is the same),
    and the cost model under `balance=False` (costs then only price the bins: packing, steps and
    ranks read sizes alone, see `planner/schedule.py` and `planner/stream_bins.py`).
    Costs O(N) (a hash of the table's columns; about 1 s for 1M samples): build it once.
    """
    layout = config.layout
    record = {
        "num_samples": len(table),
        "dp_size": config.dp_size,
        "micro_batches_per_rank": config.micro_batches_per_rank,
        "samples_per_step": config.samples_per_step,
        "tail": config.tail,
        "seed": config.seed,
        "shuffle": config.shuffle,
        "balance": config.balance,
        "window_steps": config.window_steps,
        "layout.capacity": layout.capacity,
        "layout.multiples.segment": layout.multiples.segment,
        "layout.multiples.total": layout.multiples.total,
        "layout.static_shapes": layout.static_shapes,
    }
    if config.balance:
        record.update(_cost_model_record(config.cost_model))
    record["table_fingerprint"] = _fingerprint(*(getattr(table, f.name) for f in dataclasses.fields(table)))
    tokens = count_array(config.expanded_tokens(table), "expanded_tokens")
    record["expanded_tokens_fingerprint"] = _fingerprint(tokens)
    return {key: _plain(value) for key, value in record.items()}


def _cost_model_record(cost_model) -> dict:
    """The cost model's coefficients keyed `cost_model.<field>`, or its type if it is no dataclass."""
    if dataclasses.is_dataclass(cost_model):
        return {f"cost_model.{f.name}": getattr(cost_model, f.name) for f in dataclasses.fields(cost_model)}
    # a duck-typed cost model: its type is all that can be compared
    return {"cost_model": f"{type(cost_model).__module__}.{type(cost_model).__qualname__}"}


# The keys each state format saves: 1 before the layout was recorded, STATE_FORMAT by state_dict().
STATE_KEYS = {1: frozenset({"format", "epoch", "position", "carried", "seed", "num_samples", "dp_size"}),
               STATE_FORMAT: frozenset({"format", "epoch", "position", "carried", "layout"})}


def state_fields(state) -> tuple[int, int, tuple[int, ...]]:
    """(epoch, position, carried) of a saved sampler state, each checked: int() truncated 1.5 to 1 (another
    epoch, position or sample), and None or a count where a list goes was a TypeError.

    Raises:
        ValueError: `state` is not a dict, or a field is missing or of the wrong type (naming it and its value).
    """
    if not isinstance(state, dict):
        raise ValueError(f"the sampler state must be a dict (what state_dict() saved), got {type(state).__name__}")

    for key in ("epoch", "position"):
        if not is_int(state.get(key)) or state[key] < 0:
            raise ValueError(f"sampler state has {shown_field(state, key)}: it must be an int >= 0")
    carried = state.get("carried")
    if not isinstance(carried, (list, tuple)) or not all(is_int(i) for i in carried):
        raise ValueError(f"sampler state has {shown_field(state, 'carried')}: it must be a list of sample indices")
    return int(state["epoch"]), int(state["position"]), tuple(int(i) for i in carried)


def planning_fields(record: dict) -> dict:
    """`record` less the cost model under balance=False: states saved before it was left out there
    recorded it, and it moves no sample."""
    if record.get("balance", True):
        return record
    return {key: value for key, value in record.items() if key.split(".")[0] != "cost_model"}


def rank_record(state: dict, dp_rank: int) -> dict:
    """What one rank's sampler must share with every other rank of its data-parallel group, from its
    `state_dict()`: the layout (dataset fingerprints and every planner setting), the epoch, the position
    in it and the samples carried into it (a count and a fingerprint: at most a step's worth); and its
    `dp_rank`, which every rank must hold a different one of."""
    carried = state["carried"]
    return {**state["layout"], "epoch": state["epoch"], "position": state["position"],
            "carried": f"{len(carried)} sample(s), fingerprint {_fingerprint(np.asarray(carried, np.int64))}",
            "dp_rank": dp_rank}


def _on_ranks(ranks: list[int]) -> str:
    return f"on rank {ranks[0]}" if len(ranks) == 1 else f"on ranks {', '.join(map(str, ranks))}"


def _differing_fields(records: list[dict]) -> list[str]:
    """`field: value on ranks ...; other value on ranks ...` for every field the records do not agree on."""
    fields = list(dict.fromkeys(key for record in records for key in record if key != "dp_rank"))
    lines = []
    for key in fields:
        holders: dict[str, list[int]] = {}
        for rank, record in enumerate(records):
            holders.setdefault(repr(record[key]) if key in record else "no such field", []).append(rank)
        if len(holders) > 1:
            lines.append(f"{key}: " + "; ".join(f"{value} {_on_ranks(at)}" for value, at in holders.items()))
    return lines


def plan_disagreement(records: list[dict]) -> str | None:
    """Why the ranks of a group, whose `rank_record`s these are (in group rank order), would not each take its
    own share of one plan at one place in it; None when they would.

    Either the records differ (each rank plans its own epoch: samples trained twice or never), or the group
    has another size than dp_size, or two ranks hold one dp_rank (its share trained twice, another by none).
    """
    lines = _differing_fields(records)
    if lines:
        return (f"the {len(records)} ranks of the group disagree on the plan or their place in it, so each would "
                f"take its share of another epoch or step (samples trained twice or never):\n  "
                + "\n  ".join(lines)
                + "\nBuild every rank's SampleTable in one order (sort a file listing) and its PlannerConfig alike, "
                  "and resume every rank from one state")
    dp_size = records[0]["dp_size"]
    if len(records) != dp_size:
        return (f"the group has {len(records)} ranks but dp_size={dp_size}, so some shares of the plan would be "
                f"trained twice or by no rank: pass the data-parallel group (in Megatron "
                f"parallel_state.get_data_parallel_group()) and its size as PlannerConfig(dp_size=)")
    holders: dict[int, list[int]] = {}
    for rank, record in enumerate(records):
        holders.setdefault(record["dp_rank"], []).append(rank)
    if len(holders) != dp_size:
        shared = "; ".join(f"dp_rank={r} {_on_ranks(at)}" for r, at in sorted(holders.items()) if len(at) > 1)
        missing = ", ".join(str(r) for r in range(dp_size) if r not in holders)
        return (f"each rank of the group must take its own share of the plan, but {shared}; dp_rank {missing} on "
                f"none: those micro-batches are trained by no rank, those of a shared dp_rank twice")
    return None
