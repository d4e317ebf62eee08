"""make_forward_step(parity_probe_every=N): the shipped step probes every N-th micro-batch
(real tiny GPTModel on CPU, one process): quiet on a correct pack, raising on a corrupted one."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed

from tests.validate.test_probe import _batch, _uniform


def run_step_probe_cases(rank, world_size):
    import contextlib
    import io

    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.validate import ParityProbeError

    initialize_parallel()
    model = build_tiny_gpt(TinyGPTConfig(position_embedding_type="rope", backend="reference"))
    batch, out = _batch(), {}
    step = make_forward_step(label_style="hf", parity_probe_every=2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in range(3):  # micro-batches 0 and 2 are probed
            output, loss = step(iter([batch]), model)
            loss(output)[0].backward()  # the step's own graph is untouched by the probe
    out["clean"] = (printed.getvalue(), model.training)
    width = batch["input_ids"].shape[1]
    corrupt = make_forward_step(label_style="hf", parity_probe_every=1, transform=lambda mb: _uniform(mb, width))
    try:
        corrupt(iter([batch]), model)
        out["corrupt"] = None
    except ParityProbeError as err:
        out["corrupt"] = (err.result.max_abs_diff, sorted(err.report.failed_checks), str(err))
    try:
        make_forward_step(parity_probe_every=0)
        out["bad_every"] = None
    except ValueError as err:
        out["bad_every"] = str(err)
    return out


@pytest.fixture(scope="module")
def cases():
    return run_distributed(run_step_probe_cases, 1)


def test_the_step_probes_every_nth_micro_batch_and_passes_on_its_own_packs(cases):
    printed, training = cases["clean"]
    lines = [line for line in printed.splitlines() if line.startswith("parity probe:")]
    assert len(lines) == 2 and all("of 4 samples" in line for line in lines), printed
    assert all(float(line.split("max |dloss| ")[1].split(",")[0]) <= 1e-5 for line in lines)
    assert training


def test_the_step_probe_raises_on_uniform_boundaries_with_the_report(cases):
    max_diff, failed, message = cases["corrupt"]
    assert max_diff > 1e-2 and "tokens_vs_source" in failed and "packing is not exact" in message


def test_parity_probe_every_must_be_positive(cases):
    assert "parity_probe_every must be a positive int, got 0" in cases["bad_every"]
