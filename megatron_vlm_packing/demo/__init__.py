"""`megatron-vlm-packing demo`: the main job. A tiny VLM (its own model and synthetic data,
`demo/model.py`, `demo/synthetic.py`) trained with packing through the shipped forward step, on
the product CPU runtime (`runtime/`) or a GPU; it imports no test helpers."""


def run_demo(args) -> int:
    """See `megatron_vlm_packing.demo.main.run_demo` (imported on call: importing the package is cheap)."""
    from megatron_vlm_packing.demo.main import run_demo as run

    return run(args)
