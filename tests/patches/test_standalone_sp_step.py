"""Bug class 3 through the shipped step: a GPTModel built with `scatter_embedding_sequence_parallel=False`
(as VLM language models are), called standalone at TP=2 + SP. Where megatron-core lacks the upstream fix
(0.16.1, the floor leg) the GPTModel adapter refuses it while `patches.apply_sp_embedding_scatter()` is off,
asked per micro-batch (a patch undone after the adapter was built counts); before, the step crashed inside
THD rotary with a split-size error, or in the loss with an index shape mismatch. Patched, or where upstream
scatters itself (0.19), the step gives the TP=1 loss."""

import pytest

from megatron_vlm_packing.testing.distributed import run_distributed
from megatron_vlm_packing.testing.patch_checks import run_standalone_sp_step_checks


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(run_standalone_sp_step_checks, 2)


def _matches(outcome: dict, truth: dict) -> bool:
    return "error" not in outcome and outcome["tokens"] == truth["tokens"] \
        and abs(outcome["loss"] - truth["loss"]) < 1e-4 * abs(truth["loss"])


def test_patched_standalone_step_gives_the_tp1_loss(outcomes):
    assert "error" not in outcomes["reference"], outcomes
    assert _matches(outcomes["patched"], outcomes["reference"]), outcomes


@pytest.mark.parametrize("when", ["unpatched", "undone_after_the_adapter_was_built"])
def test_unpatched_standalone_step_is_refused_where_upstream_lacks_the_fix(outcomes, when):
    outcome = outcomes[when]
    if outcomes["upstream_has_fix"]:  # megatron-core scatters itself: no patch needed, nothing refused
        assert _matches(outcome, outcomes["reference"]), outcomes
        return
    error = outcome.get("error", "")
    assert error.startswith("ValueError: GPTModel "), outcomes
    for named in ("scatter_embedding_sequence_parallel=False", "tensor_model_parallel_size=2",
                  "sequence_parallel=True", "apply_sp_embedding_scatter()", "apply_all()"):
        assert named in error, (named, error)


@pytest.mark.parametrize("scatters, pre_process, tp, sp, refused", [
    (False, True, 2, True, True),  # a VLM's language model, alone: the one layout that needs the patch
    (True, True, 2, True, False),  # GPTModel's own embedding scatters
    (False, False, 2, True, False),  # a later pipeline stage: no embedding, hidden states arrive scattered
    (False, True, 2, False, False),  # no SP: every TP rank holds the whole sequence by design
    (False, True, 1, True, False),  # TP = 1: the scatter keeps every token
], ids=["lm-alone", "scattering-embedding", "later-stage", "no-sp", "tp1"])
def test_only_a_standalone_first_stage_under_tp_sp_needs_the_patch(single_process_megatron, scatters, pre_process,
                                                                   tp, sp, refused):
    """Read from the model (one process, its config set to the layout): nothing else is refused, patch off."""
    from megatron_vlm_packing.models.gpt_adapter import GPTModelAdapter
    from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
    from megatron_vlm_packing.patches import gpt_model_forward as patch

    model = build_tiny_gpt(TinyGPTConfig(), scatter_embedding_sequence_parallel=scatters, pre_process=pre_process)
    model.config.tensor_model_parallel_size, model.config.sequence_parallel = tp, sp
    patch.undo_sp_embedding_scatter()
    adapter = GPTModelAdapter(model)
    if refused and not patch.upstream_scatters_standalone_embeddings():
        with pytest.raises(ValueError, match=r"apply_sp_embedding_scatter\(\)"):
            adapter.refuse_unscattered_embeddings()
        assert patch.apply_sp_embedding_scatter()
        try:
            adapter.refuse_unscattered_embeddings()  # the live state: applied after the adapter was built
        finally:
            patch.undo_sp_embedding_scatter()
    else:
        adapter.refuse_unscattered_embeddings()
