"""Pipeline parallelism: a micro-batch must have the shape Megatron's schedule receives it in.

Megatron-Core's schedules (`forward_backward_pipelining_without_interleaving` / `_with_interleaving`,
0.16.1 and 0.19.2) allocate every receive buffer (activations forward, their gradients backward) as
`[seq_length // cp // (tp if sequence_parallel), micro_batch_size, hidden]` from the numbers given to
`get_forward_backward_func()(...)` (`decoder_seq_length` instead of `seq_length` when given, without
interleaving), unless the model config has `variable_seq_lengths` (or `mtp_standalone`): then each
send is preceded by its shape. A micro-batch of another length is sent into that buffer. On CPU
(gloo) a longer one aborts the receiving process (`gloo::EnforceNotMet`) and a shorter one is taken
with the buffer's tail left uninitialised; on GPUs NCCL's send / receive of unequal sizes hangs when
the receive is larger and truncates silently when it is smaller (NVIDIA/nccl#1938). So the step
refuses it before the model runs, on every stage, before its first send.

The step does not see the schedule's numbers; `schedule_shape` reads them where a training loop
fixes them: Megatron-Bridge's (the `state` of the `(state, data_iterator, model)` form: its
`cfg.model.seq_length`, `cfg.train.micro_batch_size`) and Megatron-LM's (`megatron.training.get_args()`,
when that loop has set it). Called directly, `get_forward_backward_func` takes whatever the caller
passes: then the micro-batch's length must be fixed by the step (`pad_to`, `seq_length` with
`pack=False`) or by the model (LLaVA's `language_max_sequence_length`), never the pack's own length.
"""

from __future__ import annotations

import sys
from typing import NamedTuple


class ScheduleShape(NamedTuple):
    """What the schedule sizes its receive buffers from (host ints), and who passes them.

    Attributes:
        seq_length: the full sequence length (before the CP / SP division).
        micro_batch_size: rows per micro-batch (None: not known).
        source: the training loop that passes them, for messages.
    """

    seq_length: int
    micro_batch_size: int | None
    source: str


def check_pipeline_shape(length: int, rows: int, *, pipeline_size: int, shapes_exchanged: bool,
                         schedule: ScheduleShape | None, fixed_by: str | None, fix: str, cp_size: int = 1,
                         sp_tp_size: int = 1) -> None:
    """Refuse a micro-batch that the pipeline schedule would receive into a buffer of another shape.

    Args:
        length: the micro-batch's full sequence length, as the language model runs it (host int).
        rows: its rows (1 for a pack, B for dense rows).
        pipeline_size: pipeline-parallel world size (nothing is checked at 1).
        shapes_exchanged: the model config's `variable_seq_lengths` (or `mtp_standalone`): shapes travel first.
        schedule: the schedule's numbers when a training loop fixes them, else None.
        fixed_by: what fixes `length` for every micro-batch ("pad_to=64"), else None (the pack's own length).
        fix: the step option that would fix it ("pad_to" or "seq_length").
        cp_size, sp_tp_size: the divisors of the sequence (CP; TP under sequence parallelism).

    Example: at PP=2, TP=2 + SP, a pack of 28 slots sends [14, 1, H]; `seq_length=30` receives into
    [30 // 2, 1, H] = [15, 1, H]: refused; `seq_length=29` receives [14, 1, H]: accepted.

    Raises:
        ValueError: naming the lengths (full and per rank), the rows, where the schedule's come from,
            and the two fixes (`make_forward_step(<fix>=...)`, `config.variable_seq_lengths = True`).
    """
    if pipeline_size <= 1 or shapes_exchanged:
        return
    or_variable = "or set the model config's variable_seq_lengths = True (each shape is sent first)"
    if schedule is None:
        if fixed_by is None:
            raise ValueError(
                f"at pipeline-parallel size {pipeline_size} Megatron's schedule receives every micro-batch into a "
                f"buffer of the seq_length given to get_forward_backward_func (variable_seq_lengths is False), "
                f"which this step cannot see, and this micro-batch's length {length} is its own, fixed by neither "
                f"{fix} nor the model (the next one's may differ): give make_forward_step({fix}=<that seq_length>) "
                f"{or_variable}")
        return
    divisor = cp_size * sp_tp_size
    sent, received = length // divisor, schedule.seq_length // cp_size // sp_tp_size
    rows_differ = schedule.micro_batch_size is not None and rows != schedule.micro_batch_size
    if sent == received and not rows_differ:
        return
    per_rank = f" ({sent} vs {received} per rank, divided by cp={cp_size} x sp tp={sp_tp_size})" if divisor > 1 else ""
    what = f"a micro-batch of length {length}" + (f" ({fixed_by})" if fixed_by else " (its own)")
    if sent != received:
        raise ValueError(
            f"at pipeline-parallel size {pipeline_size} {what} would be sent into the schedule's receive buffer of "
            f"seq_length={schedule.seq_length}{per_rank}, which {schedule.source} passes (variable_seq_lengths is "
            f"False): a hang or a silently truncated receive on GPUs; give make_forward_step({fix}="
            f"{schedule.seq_length}) {or_variable}")
    raise ValueError(
        f"at pipeline-parallel size {pipeline_size} a micro-batch of {rows} row(s) would be sent into the schedule's "
        f"receive buffer of micro_batch_size={schedule.micro_batch_size}, which {schedule.source} passes "
        f"(variable_seq_lengths is False; a pack is one row whatever the samples in it): set micro_batch_size={rows} "
        f"in the loop {or_variable}")


def schedule_shape(state=None, *, interleaved: bool = False) -> ScheduleShape | None:
    """The schedule's numbers where a training loop fixes them: Megatron-Bridge's `state` (the step's
    `with_state` form) or Megatron-LM's global args (only read when `megatron.training` is already imported
    and its args set); None when the step is called some other way (a direct `get_forward_backward_func`).
    Bridge's `dataloader_type="batch"` takes the length from each global batch: None there too."""
    cfg = getattr(state, "cfg", None)
    model, train = getattr(cfg, "model", None), getattr(cfg, "train", None)
    if isinstance(getattr(model, "seq_length", None), int):
        if getattr(getattr(cfg, "dataset", None), "dataloader_type", None) == "batch":
            return None
        return ScheduleShape(model.seq_length, getattr(train, "micro_batch_size", None),
                             "Megatron-Bridge's training loop (cfg.model.seq_length, cfg.train.micro_batch_size)")
    global_vars = sys.modules.get("megatron.training.global_vars")  # never imported here: its loop did
    if global_vars is None:
        return None
    try:
        args = global_vars.get_args()
    except AssertionError:  # Megatron-LM imported but its args not set: not its training loop
        return None
    decoder = getattr(args, "decoder_seq_length", None)
    if decoder is not None and not interleaved:  # the schedule without interleaving prefers it
        return ScheduleShape(decoder, args.micro_batch_size,
                             "Megatron-LM's training loop (args.decoder_seq_length, args.micro_batch_size)")
    return ScheduleShape(args.seq_length, args.micro_batch_size,
                         "Megatron-LM's training loop (args.seq_length, args.micro_batch_size)")


def check_for_pipeline(micro_batch, adapter, layout, options, config, state=None) -> None:
    """`check_pipeline_shape` for the step's full-length micro-batch: this rank's pipeline size and the model
    config's flags (what the schedule reads), the length the language model runs (the adapter's
    `pipeline_length` when the model pads every sequence to it itself, LLaVA's, else the micro-batch's) and what
    fixes it; shapes and host ints only, no device sync."""
    from megatron.core import parallel_state as ps

    pipeline_size = ps.get_pipeline_model_parallel_world_size()
    if pipeline_size <= 1:
        return
    fix = "pad_to" if options.pack else "seq_length"
    declared = options.pad_to if options.pack else options.seq_length
    length, fixed_by = micro_batch.input_ids.shape[-1], None if declared is None else f"{fix}={declared}"
    if getattr(adapter, "pipeline_length", None) is not None:  # the model pads to it whatever the step packs
        length, fixed_by = adapter.pipeline_length, f"{adapter.model_name}'s own pipeline length"
    exchanged = bool(getattr(config, "variable_seq_lengths", False) or getattr(config, "mtp_standalone", False))
    interleaved = ps.get_virtual_pipeline_model_parallel_world_size() is not None
    check_pipeline_shape(length, micro_batch.input_ids.shape[0], pipeline_size=pipeline_size,
                         shapes_exchanged=exchanged, schedule=schedule_shape(state, interleaved=interleaved),
                         fixed_by=fixed_by, fix=fix, cp_size=layout.cp_size,
                         sp_tp_size=layout.tp_size if layout.sequence_parallel else 1)
