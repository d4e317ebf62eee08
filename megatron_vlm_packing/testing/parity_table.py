"""Print the parity table (packed vs each sample alone, every parallel layout) in one command.

    python -m megatron_vlm_packing.testing.parity_table

Runs the standard cases on CPU (gloo) in three launches (1, 2 and 4 processes) and prints a
markdown table: config, max |dloss| over real tokens, max |dlogit| ("-" where not checked), max
relative gradient error over all params. Every case runs the shipped `make_forward_step` and
`loss_func` (testing/parity_cases.py).
"""

from __future__ import annotations

from megatron_vlm_packing.runtime.launcher import run_distributed
from megatron_vlm_packing.testing.parity_cases import ParityCase, run_parity_cases

# Each case draws its own micro-batch lengths from its seed (a length-1 sample and an empty row always).
STANDARD_CASES = {
    1: [ParityCase("TP=1", seed=11), ParityCase("TP=1, get_forward_backward_func, 2 micro-batches", schedule=True,
                                                seed=12),
        ParityCase("dense rows (BSHD), TP=1", dense=True, seed=13)],
    2: [ParityCase("TP=2", tp=2, seed=21), ParityCase("TP=2 + SP", tp=2, sp=True, seed=22),
        ParityCase("CP=2", cp=2, seed=23), ParityCase("PP=2, get_forward_backward_func", pp=2, schedule=True, seed=24),
        ParityCase("dense rows (BSHD), CP=2", cp=2, dense=True, seed=25),
        ParityCase("PP=2, DDP + finalize_model_grads", pp=2, schedule=True, ddp=True, seed=26)],
    4: [ParityCase("TP=2 x CP=2 x SP, get_forward_backward_func", tp=2, cp=2, sp=True, schedule=True, seed=41),
        ParityCase("TP=2 x CP=2 x SP, DDP + finalize_model_grads", tp=2, cp=2, sp=True, schedule=True, ddp=True,
                   seed=42)],
}
CORRUPTION_CASES = {
    1: [ParityCase("corrupt: uniform cu_seqlens [0, S, 2S, ...]", corruption="uniform_cu_seqlens"),
        ParityCase("corrupt: boundaries off by one", corruption="boundary_off_by_one"),
        ParityCase("corrupt: labels shifted after packing", corruption="labels_shifted_after_packing")],
    2: [ParityCase("corrupt: CP index of the wrong rank", cp=2, corruption="wrong_cp_rank")],
}


def run_all(include_corruptions: bool = True) -> list[dict]:
    results = []
    for world in (1, 2, 4):
        cases = STANDARD_CASES.get(world, []) + (CORRUPTION_CASES.get(world, []) if include_corruptions else [])
        if cases:
            results += run_distributed(run_parity_cases, world, cases)
    return results


def format_table(results: list[dict]) -> str:
    lines = ["| config | max abs dloss (real tokens) | max abs dlogit (real tokens) | max relative grad error |",
             "|---|---|---|---|"]
    for r in results:
        logit = "-" if r["max_dlogit"] is None else f"{r['max_dlogit']:.2e}"  # None: not checked (PP, corruptions)
        lines.append(f"| {r['case']} | {r['max_dloss']:.2e} | {logit} | {r['max_rel_grad_err']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    print(format_table(run_all()))


if __name__ == "__main__":
    main()
