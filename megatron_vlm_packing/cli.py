"""Command line: `megatron-vlm-packing {demo,plan,inspect,check}` (also `python -m megatron_vlm_packing`).

Building the parser imports nothing heavy (`--help` and argument errors leave torch, Megatron-Core and
transformers unloaded); each `cmd_*` imports what its subcommand runs."""

from __future__ import annotations

import argparse
import sys


def _int_list(text: str) -> list[int]:
    # An empty entry ("5,,3", "5,3,", "") is refused, not skipped: skipping planned 2 rows for "5,,3"
    # (the user may have meant 5,0,3) and left nothing for max() on "".
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints such as 5,0,3, got {text!r}") from None


def int_at_least(minimum: int):
    """argparse type: an int >= `minimum` (a count of steps, ranks or samples; a seed)."""

    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {what}{' (>= 1)' if minimum == 1 else ''}, got {value}")
        return value

    return parse


_positive_int = int_at_least(1)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print the pack plan a batch of the given real lengths gets under a parallel layout."""
    from megatron_vlm_packing.packing import PackMultiples, make_pack_plan

    multiples = PackMultiples.for_parallel(
        tp_size=args.tp, cp_size=args.cp, sequence_parallel=args.sp, fp8=args.fp8
    )
    capacity = args.seq or max(args.lengths)
    # cu_seqlens are int32: a larger pack cannot be printed (torch raised an overflow RuntimeError)
    int32_max = 2**31 - 1
    if max(args.lengths + [capacity, args.pad_to or 0]) > int32_max:
        raise ValueError(f"lengths, --seq and --pad-to must be <= {int32_max} (cu_seqlens are int32)")
    plan = make_pack_plan(args.lengths, row_capacity=capacity, multiples=multiples, pad_to=args.pad_to)  # T < 2**31
    print(f"multiples: segment {multiples.segment}, total {multiples.total}")
    print(f"cu_seqlens         {plan.cu_seqlens().tolist()}")
    print(f"cu_seqlens_padded  {plan.cu_seqlens_padded().tolist()}")
    print(f"max_seqlen {plan.max_seqlen}, T {plan.total}, real tokens {plan.num_real_tokens}, "
          f"efficiency {plan.efficiency:.3f} (padded to {capacity}: {plan.num_real_tokens / (capacity * len(args.lengths)):.3f})")
    if args.cp > 1:
        from megatron_vlm_packing import cp_partition_index

        for rank in range(args.cp):
            print(f"cp rank {rank}: {cp_partition_index(plan.cu_seqlens_padded(), args.cp, rank).tolist()}")
    return 0


# The demo's training flags and their defaults: `--planner` trains nothing, so it refuses any of them set.
_DEMO_TRAINING_FLAGS = {"steps": 40, "no_pack": False, "device": "auto", "micro_batch_size": 8}


def cmd_demo(args: argparse.Namespace) -> int:
    if args.planner:  # dataset-level packing: per-rank cost with and without balancing, no training
        unused = [f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
                  for name, default in _DEMO_TRAINING_FLAGS.items() if (value := getattr(args, name)) != default]
        if unused:  # --steps 0 or --no-pack were silently ignored
            raise ValueError(f"--planner trains nothing, so {', '.join(unused)} would be ignored: drop "
                             f"{'it' if len(unused) == 1 else 'them'} (--tp, --cp, --sp, --seed are used)")
        from megatron_vlm_packing.planner.report import plan_args_from, run_plan

        return run_plan(plan_args_from(args))
    from megatron_vlm_packing.demo import run_demo

    return run_demo(args)


def cmd_check(args: argparse.Namespace) -> int:
    """Validate a saved packed batch: exit 0 clean, 1 on violations (2 unreadable, from main)."""
    from megatron_vlm_packing.validate import validate_packed_batch
    from megatron_vlm_packing.validate.saved import index_note, load_hf_mrope_config, load_saved_batch

    if args.text_offset is not None and args.hf_config is None:
        raise ValueError(f"--text-offset {args.text_offset} chooses the index rule of --hf-config's model: give "
                         f"--hf-config PATH too")
    batch = load_saved_batch(args.file)
    mrope = load_hf_mrope_config(args.hf_config, text_offset=args.text_offset or "max_hw") \
        if args.hf_config is not None else None
    layout = {k: v for k, v in (("tp_size", args.tp), ("cp_size", args.cp), ("pad_token_id", args.pad_token_id),
                                ("mrope", mrope)) if v is not None}
    layout.update({k: True for k, v in (("sequence_parallel", args.sp), ("fp8", args.fp8)) if v})
    report = validate_packed_batch({**batch, **layout})
    print(report)
    note = index_note(report, batch, mrope, args.hf_config)
    if note:
        print(note)
    return 0 if report.ok else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from megatron_vlm_packing.planner.report import run_plan

    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    """The `megatron-vlm-packing` parser: one sub-command per `_add_*_command`, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(prog="megatron-vlm-packing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_demo_command, _add_plan_command, _add_inspect_command, _add_check_command):
        add_command(sub)
    return parser


def _add_demo_command(sub) -> None:
    """`demo`: train a tiny VLM (defaults of the training flags from `_DEMO_TRAINING_FLAGS`), or `--planner`."""
    demo = sub.add_parser("demo", help="train a tiny VLM on embedded synthetic data with packing")
    defaults = _DEMO_TRAINING_FLAGS
    demo.add_argument("--steps", type=int, default=defaults["steps"], help="optimizer steps (default 40)")
    demo.add_argument("--no-pack", action="store_true", help="pad rows densely instead of packing")
    demo.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    demo.add_argument("--cp", type=int, default=1, help="context-parallel size (under torchrun)")
    demo.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default=defaults["device"])
    demo.add_argument("--micro-batch-size", type=int, default=defaults["micro_batch_size"])
    demo.add_argument("--seed", type=int, default=1234)
    demo.add_argument("--planner", action="store_true",
                      help="show dataset-level packing instead: per-rank cost with and without balancing")
    demo.set_defaults(func=cmd_demo)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """`plan`'s arguments (also the defaults of `demo --planner`, `planner.report.plan_args_from`). Here, not in the
    planner, whose package imports Megatron-Core: `plan --help` imports nothing heavy."""
    parser.add_argument("--samples", type=int_at_least(1), default=20000, help="synthetic samples (default 20000)")
    parser.add_argument("--capacity", type=int, default=32768, help="physical tokens per bin")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per rank per step")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1, as Megatron-Core does)")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--steps-shown", type=int_at_least(0), default=2,  # -1 sliced off the last step
                        help="steps whose per-rank cost is printed")
    parser.add_argument("--seed", type=int_at_least(0), default=0,
                        help="epoch shuffle seed, >= 0 (default 0; numpy takes no negative seed)")
    parser.add_argument("--progress", action="store_true", help="progress line on stderr while planning")


def _add_plan_command(sub) -> None:
    """`plan`: the planner's own arguments (`add_plan_arguments`)."""
    plan = sub.add_parser("plan", help="dataset-level packing: per-rank cost with and without balancing")
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)


def _add_inspect_command(sub) -> None:
    """`inspect LENGTHS`: the pack plan of given real lengths under a parallel layout."""
    inspect = sub.add_parser("inspect", help="show the pack plan for given real lengths")
    inspect.add_argument("lengths", type=_int_list, help="comma-separated real lengths, e.g. 5,0,3")
    inspect.add_argument("--seq", type=_positive_int, default=None, help="padded row length (default: max length)")
    inspect.add_argument("--tp", type=_positive_int, default=1)
    inspect.add_argument("--cp", type=_positive_int, default=1)
    inspect.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    inspect.add_argument("--fp8", action="store_true")
    inspect.add_argument("--pad-to", type=int, default=None)
    inspect.set_defaults(func=cmd_inspect)


def _check_description() -> str:
    """`check --help`'s text: the exit statuses, what --hf-config compares, and the keys a saved FILE holds."""
    from megatron_vlm_packing.validate.saved_keys import saved_keys_help  # plain strings: imports nothing heavy

    return ("Exit status 0 when clean, 1 on violations, 2 when the file (or one of its fields, or --hf-config) "
            "cannot be read.\nWith --hf-config, each document's mRoPE positions are compared with the model's own "
            "index for that sample alone\n(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-Omni); the report says when they "
            "were and which documents could not be.\nFILE is torch.save of a dict with these keys:\n"
            + saved_keys_help())


def _add_check_command(sub) -> None:
    """`check FILE`: validate a saved packed batch, with the layout and mRoPE index to judge it by."""
    check = sub.add_parser("check", help="validate a saved packed batch from any packer",
                           formatter_class=argparse.RawDescriptionHelpFormatter, description=_check_description())
    check.add_argument("file", help="torch.save'd dict (see the keys above)")
    check.add_argument("--tp", type=int, default=None, help="tensor-parallel size (overrides tp_size in FILE)")
    check.add_argument("--cp", type=int, default=None, help="context-parallel size (overrides cp_size)")
    check.add_argument("--sp", action="store_true", help="sequence parallelism")
    check.add_argument("--fp8", action="store_true", help="FP8 alignment")
    check.add_argument("--pad-token-id", type=int, default=None)
    check.add_argument("--hf-config", default=None, metavar="PATH",
                       help="the model's Hugging Face config.json (or its directory), read with transformers: "
                            "compare mRoPE positions with its index; its placeholder ids and merge size are "
                            "used where FILE gives none")
    check.add_argument("--text-offset", choices=("max_hw", "max_position"), default=None,
                       help="with --hf-config: where text resumes after an image or video block in the index "
                            "compared with. max_hw (default): start + max(h, w) / merge, as transformers 5.x; "
                            "max_position: 1 + the block's largest position, as transformers 4.57 (differs "
                            "only after videos whose time positions outrun h and w)")
    check.set_defaults(func=cmd_check)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"megatron-vlm-packing {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
