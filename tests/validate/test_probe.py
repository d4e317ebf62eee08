"""The sampled parity probe on a real tiny Megatron-Core GPTModel (CPU, one process, one launch): alone,
wrapped around a forward step, and inside `make_forward_step(parity_probe_every=N)`."""

import re

import numpy as np
import pytest
import torch

from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.validate.probe import split_rows


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 3, 14, 6]
    width = max(lengths)
    keep = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    ids = torch.where(keep, torch.randint(1, 120, (len(lengths), width), generator=g), 0)
    return {"input_ids": ids, "labels": torch.where(keep, ids, -100), "attention_mask": keep.long()}


def _uniform(packed, width: int):
    """Bug class 4 made harmful: [0, S, 2S, ...] laid over a real-length pack (samples merge). Declared
    (`declare_boundaries`): the step would otherwise refuse boundaries that are not the plan's before the probe
    could show that it catches them."""
    from dataclasses import replace

    from megatron_vlm_packing.packing.micro_batch import declare_boundaries

    total = packed.input_ids.shape[1]
    cu = torch.tensor(list(range(0, total, width)) + [total], dtype=torch.int32)
    params = replace(packed.packed_seq_params, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                     cu_seqlens_kv_padded=cu, max_seqlen_q=width, max_seqlen_kv=width)
    return declare_boundaries(packed, params)


def _crossing(packed):
    """Bug class 8: the last token of the first sample learns the first token of the second."""
    from dataclasses import replace

    labels, mask = packed.labels.clone(), packed.loss_mask.clone()
    end, start = int(packed.packed_seq_params.cu_seqlens_q[1]) - 1, int(packed.packed_seq_params.cu_seqlens_q_padded[1])
    labels[0, end], mask[0, end] = packed.input_ids[0, start], 1.0
    return replace(packed, labels=labels, loss_mask=mask)


def run_probe_cases(rank, world_size):
    from megatron_vlm_packing import make_forward_step, pack_batch
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.testing.distributed import initialize_parallel
    from megatron_vlm_packing.validate import ParityProbeError, model_losses, parity_probe, with_parity_probe

    initialize_parallel()
    model = build_tiny_gpt(TinyGPTConfig(position_embedding_type="rope", backend="reference"))
    batch, out = _batch(), {}
    forward = model_losses(model)
    clean = parity_probe(forward, batch, label_style="hf")
    out["clean"] = (clean.max_abs_diff, clean.num_tokens, len(clean.per_document), str(clean))
    for name, corrupt in (("uniform", lambda p: _uniform(p, batch["input_ids"].shape[1])), ("crossing", _crossing)):
        packed = corrupt(pack_batch(batch, label_style="hf"))
        try:
            parity_probe(forward, batch, packed=packed, label_style="hf")
            out[name] = None
        except ParityProbeError as err:
            out[name] = (err.result.max_abs_diff, sorted(err.report.failed_checks), str(err))
    seen = []
    step = with_parity_probe(make_forward_step(pack=True, label_style="hf"), every=2, label_style="hf",
                             on_result=seen.append)
    for _ in range(3):  # calls 0 and 2 are probed
        output, loss = step(iter([batch]), model)
    out["wrapped"] = ([r.max_abs_diff for r in seen], model.training, tuple(output.shape))
    out.update(run_step_probe_cases(model, batch))
    return out


def run_step_probe_cases(model, batch) -> dict:
    """make_forward_step(parity_probe_every=N): quiet on the step's own packs, raising on a corrupted one."""
    import contextlib
    import io

    from megatron_vlm_packing import make_forward_step
    from megatron_vlm_packing.validate import ParityProbeError

    out = {}
    step = make_forward_step(label_style="hf", parity_probe_every=2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in range(3):  # micro-batches 0 and 2 are probed
            output, loss = step(iter([batch]), model)
            loss(output)[0].backward()  # the step's own graph is untouched by the probe
    out["step_clean"] = (printed.getvalue(), model.training)
    width = batch["input_ids"].shape[1]
    corrupt = make_forward_step(label_style="hf", parity_probe_every=1, transform=lambda mb: _uniform(mb, width))
    try:
        corrupt(iter([batch]), model)
        out["step_corrupt"] = None
    except ParityProbeError as err:
        out["step_corrupt"] = (err.result.max_abs_diff, sorted(err.report.failed_checks), str(err))
    try:
        make_forward_step(parity_probe_every=0)
        out["step_bad_every"] = None
    except ValueError as err:
        out["step_bad_every"] = str(err)
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.models.gpt_adapter import GPTModelAdapter

    class OwnBuild(GPTModelAdapter):  # like LLaVA's adapter: plans its own micro-batches
        def build_micro_batch(self, batch, layout, options):
            return pack_batch(batch, label_style="hf")

    try:
        make_forward_step(label_style="hf", parity_probe_every=1, adapter=OwnBuild)(iter([batch]), model)
        out["step_own_build"] = None
    except ValueError as err:
        out["step_own_build"] = str(err)
    return out


@pytest.fixture(scope="module")
def probe_cases():
    return run_distributed(run_probe_cases, 1)


def test_probe_passes_on_a_correct_pack(probe_cases):
    max_diff, tokens, docs, text = probe_cases["clean"]
    assert max_diff <= 1e-5 and tokens == 9 + 3 + 14 + 6 - 4 and docs == 4
    assert text.startswith("parity probe: max |dloss|")


def test_probe_raises_with_the_validators_report_on_uniform_boundaries(probe_cases):
    max_diff, failed, message = probe_cases["uniform"]
    assert max_diff > 1e-2
    assert "tokens_vs_source" in failed and "packing is not exact" in message and "[tokens_vs_source]" in message


def test_probe_raises_and_names_bug_class_8(probe_cases):
    max_diff, failed, message = probe_cases["crossing"]
    assert max_diff > 1e-2 and failed == ["labels_cross_documents"] and "bug class 8" in message


def test_wrapped_forward_step_probes_every_nth_call(probe_cases):
    diffs, training, shape = probe_cases["wrapped"]
    assert len(diffs) == 2 and max(diffs) <= 1e-5
    assert training  # the probe ran in eval mode and restored training mode


def test_the_step_probes_every_nth_micro_batch_and_passes_on_its_own_packs(probe_cases):
    printed, training = probe_cases["step_clean"]
    lines = [line for line in printed.splitlines() if line.startswith("parity probe:")]
    assert len(lines) == 2 and all("of 4 samples" in line for line in lines), printed
    assert all(float(line.split("max |dloss| ")[1].split(",")[0]) <= 1e-5 for line in lines)
    assert training


def test_the_step_probe_raises_on_uniform_boundaries_with_the_report(probe_cases):
    max_diff, failed, message = probe_cases["step_corrupt"]
    assert max_diff > 1e-2 and "tokens_vs_source" in failed and "packing is not exact" in message


def test_parity_probe_every_must_be_positive_and_refuses_adapters_that_build_their_own(probe_cases):
    assert "parity_probe_every must be an int >= 1, got 0" in probe_cases["step_bad_every"]
    assert "OwnBuild builds its own micro-batches" in probe_cases["step_own_build"]


def test_split_rows_gives_each_sample_its_images():
    ids = torch.tensor([[5, 9, 9, 9, 9, 6, 0], [9, 7, 0, 0, 0, 0, 0]])
    batch = {"input_ids": ids, "labels": ids, "attention_mask": (ids != 0).long(),
             "pixel_values": torch.arange(20.0)[:, None], "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 2]])}
    (r0, a), (r1, b) = split_rows(batch, image_token_id=9)
    assert (r0, r1) == (0, 1) and a["input_ids"].shape == (1, 6) and b["input_ids"].shape == (1, 2)
    assert a["pixel_values"].shape[0] == 16 and b["pixel_values"].flatten().tolist() == [16.0, 17.0, 18.0, 19.0]
    with pytest.raises(ValueError, match="no per-sample counts and no image_token_id to count them"):
        split_rows(batch)
    with pytest.raises(ValueError, match=r"cannot split \['num_image_tiles'\] per sample"):
        split_rows({**batch, "num_image_tiles": torch.ones(2)}, image_token_id=9)


def test_a_pack_with_a_different_number_of_documents_fails_before_any_forward():
    from dataclasses import replace

    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.validate import ParityProbeError, parity_probe

    batch = _batch()
    packed = pack_batch(batch, label_style="hf")
    total = packed.input_ids.shape[1]
    one = torch.tensor([0, total], dtype=torch.int32)  # every sample in one document
    params = replace(packed.packed_seq_params, cu_seqlens_q=one, cu_seqlens_kv=one, cu_seqlens_q_padded=one,
                     cu_seqlens_kv_padded=one)
    foreign = replace(packed, packed_seq_params=params, plan=None)

    def never(_):
        raise AssertionError("no forward runs for a pack whose documents are not the samples")

    with pytest.raises(ParityProbeError, match="the pack has 1 documents for 4 samples") as err:
        parity_probe(never, batch, packed=foreign, label_style="hf")
    assert "tokens_vs_source" in err.value.report.failed_checks


@pytest.mark.parametrize("dtype, expected", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 5e-2)])
def test_the_default_tolerance_follows_the_models_parameter_dtype(dtype, expected):
    """1e-4 for a float32 model; bf16 / fp16 parameters (Float16Module) get 5e-2, where packed and each
    sample alone differ by rounding alone and 1e-4 would stop a sound run."""
    from megatron_vlm_packing.validate import StepProbe, default_tolerance

    model = torch.nn.Sequential(torch.nn.Embedding(4, 2).to(dtype))
    assert default_tolerance(model) == expected
    assert default_tolerance(torch.nn.ReLU()) == 1e-4  # no parameters: float32's bound
    assert StepProbe(1).tolerance is None and StepProbe(1, tolerance=0.3).tolerance == 0.3
    assert StepProbe(1, tolerance=np.float32(0.25)).tolerance == 0.25  # a numpy scalar is a number too


@pytest.mark.parametrize("tolerance", [-1.0, float("nan"), True, "1e-4", float("inf")])
def test_a_bad_tolerance_is_refused_when_the_probe_is_built(tolerance):
    """inf was accepted: every difference is <= inf, so the probe could never raise."""
    from megatron_vlm_packing.validate import StepProbe, parity_probe, with_parity_probe

    with pytest.raises(ValueError, match="parity_probe_tolerance must be a finite number >= 0 or None"):
        StepProbe(1, tolerance=tolerance)
    with pytest.raises(ValueError, match="tolerance must be a finite number >= 0 or None"):
        with_parity_probe(lambda iterator, model: None, every=1, tolerance=tolerance)
    never = lambda micro_batch: pytest.fail("the forward ran before the tolerance was checked")  # noqa: E731
    with pytest.raises(ValueError, match=rf"tolerance must be a finite number >= 0, got {re.escape(repr(tolerance))}"):
        parity_probe(never, {"input_ids": torch.ones(1, 4, dtype=torch.long)}, tolerance=tolerance, label_style="hf")


@pytest.mark.parametrize("tolerance", [1e-3, "1e-4", -1.0])
def test_a_tolerance_without_a_probe_is_refused(tolerance):
    """make_forward_step(parity_probe_tolerance=...) without parity_probe_every was accepted (any value, a str
    included) and never used: no probe ran."""
    from megatron_vlm_packing import make_forward_step

    with pytest.raises(ValueError, match=rf"parity_probe_tolerance={tolerance!r} is the parity probe's bound, but "
                                         r"no probe runs: give parity_probe_every=N too"):
        make_forward_step(parity_probe_tolerance=tolerance)


@pytest.mark.parametrize("options, message", [
    (dict(forward_step=3), r"with_parity_probe wraps a forward_step\(data_iterator, model\), got 3"),
    (dict(on_result=3), r"on_result must be a callable taking each ProbeResult, or None, got 3"),
    (dict(model_forward="fwd"), r"model_forward must be a callable micro_batch -> per-token losses, or None, "
                                r"got 'fwd'"),
    (dict(lable_style="hf"), r"\['lable_style'\] are not parity_probe / pack_batch keywords; with_parity_probe "
                             r"passes on any of \[.*'label_style'"),
])
def test_with_parity_probe_refuses_what_it_cannot_call_when_it_wraps(options, message):
    """Were TypeErrors at the first probed call ('int' object is not callable, an unexpected keyword), after the
    wrapped step had run."""
    from megatron_vlm_packing.validate import with_parity_probe

    forward_step = options.pop("forward_step", lambda iterator, model: None)
    with pytest.raises(ValueError, match=message):
        with_parity_probe(forward_step, every=1, **options)


def test_a_probe_of_dense_rows_is_refused_when_the_step_is_made():
    """make_forward_step(pack=False, parity_probe_every=N) was accepted, and the first probed micro-batch was an
    AttributeError ('NoneType' object has no attribute 'cu_seqlens_q_padded'): the probe compares a pack."""
    from megatron_vlm_packing import make_forward_step

    with pytest.raises(ValueError, match=r"parity_probe_every compares a pack with each sample alone: it needs "
                                         r"pack=True \(the step was made with pack=False\)"):
        make_forward_step(pack=False, parity_probe_every=2)
