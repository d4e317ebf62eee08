"""Under pipeline parallelism Megatron's schedule receives every micro-batch into a buffer of the `seq_length`
(and `micro_batch_size`) given to it, unless the model config has `variable_seq_lengths`. A micro-batch of another
shape was sent into it: on CPU (gloo) a longer one aborted the receiving process and a shorter one left the
buffer's tail uninitialised (the reference attention then failed on its boundaries); on GPUs NCCL hangs or
truncates the receive silently. The step now refuses it on every stage before the model runs (no send, no
receive), naming the numbers and the two fixes. Two CPU processes (gloo), a real Megatron-Core GPTModel at PP = 2."""

import sys
from argparse import Namespace

import pytest

from megatron_vlm_packing.runtime import run_distributed
from megatron_vlm_packing.train.pipeline_shapes import ScheduleShape, check_pipeline_shape, schedule_shape
from tests.step.pipeline_shape_workers import bridge_state, run_pipeline_shapes

FIXES = ("variable_seq_lengths = True",)


@pytest.fixture(scope="module")
def results():
    return run_distributed(run_pipeline_shapes, 2, timeout_s=300)


def test_a_pack_of_its_own_length_is_refused_on_every_stage_when_the_schedule_is_unseen(results):
    for stage in results["said"]:  # before: stage 0 packed 21 tokens and sent them into the schedule's buffer
        said = stage["pack_own_length"]
        assert said is not None and "length 21 is its own, fixed by neither pad_to" in said, said
        assert "make_forward_step(pad_to=<that seq_length>)" in said and FIXES[0] in said, said
        said = stage["dense_own_length"]  # dense rows padded to the longest row: the next micro-batch differs
        assert said is not None and "make_forward_step(seq_length=<that seq_length>)" in said, said


@pytest.mark.parametrize("case, numbers", [
    ("bridge_longer", ("length 21 (its own)", "seq_length=32", "make_forward_step(pad_to=32)")),
    ("bridge_shorter", ("length 21 (its own)", "seq_length=16", "make_forward_step(pad_to=16)")),
    ("bridge_pad_to_differs", ("length 32 (pad_to=32)", "seq_length=40", "make_forward_step(pad_to=40)")),
    ("bridge_dense_differs", ("length 12 (seq_length=12)", "seq_length=16", "make_forward_step(seq_length=16)")),
])
def test_a_length_other_than_bridges_loops_is_refused_with_the_numbers(results, case, numbers):
    for stage in results["said"]:
        said = stage[case]
        assert said is not None and all(n in said for n in numbers) and FIXES[0] in said, said
        assert "Megatron-Bridge's training loop (cfg.model.seq_length" in said, said


def test_a_pack_of_one_row_into_a_buffer_of_several_is_refused(results):
    for stage in results["said"]:
        said = stage["bridge_rows_differ"]
        assert said is not None and "1 row(s)" in said and "micro_batch_size=4" in said, said


def test_what_the_schedule_receives_is_accepted_and_trains_alike(results):
    # a refusal on any stage would have failed the launch; two micro-batches of the same 18 targets, padded
    # (pad_to=32 as the schedule's seq_length, seen or declared) or at real length (variable_seq_lengths): one loss
    losses = results["losses"]
    assert losses["pad_to"][1] == losses["variable"][1] == 36.0, losses
    assert losses["pad_to"] == pytest.approx(losses["variable"], rel=1e-6) == losses["bridge_pad_to"], losses


def test_the_per_rank_lengths_are_compared_as_the_schedule_divides_them():
    # TP = 2 + SP: a pack of 28 slots sends 14 per rank; seq_length=29 receives 29 // 2 = 14, 30 receives 15
    shape = dict(pipeline_size=2, shapes_exchanged=False, fixed_by="pad_to=28", fix="pad_to", sp_tp_size=2)
    check_pipeline_shape(28, 1, schedule=ScheduleShape(29, 1, "a loop"), **shape)
    with pytest.raises(ValueError, match=r"seq_length=30 \(14 vs 15 per rank, divided by cp=1 x sp tp=2\)"):
        check_pipeline_shape(28, 1, schedule=ScheduleShape(30, 1, "a loop"), **shape)
    with pytest.raises(ValueError, match=r"seq_length=28 \(7 vs 7 per rank|micro_batch_size=2"):
        check_pipeline_shape(28, 1, schedule=ScheduleShape(28, 2, "a loop"), **dict(shape, cp_size=2))
    for exempt in (dict(pipeline_size=1), dict(shapes_exchanged=True)):
        check_pipeline_shape(28, 1, schedule=ScheduleShape(30, 1, "a loop"), **dict(shape, **exempt))
        check_pipeline_shape(21, 1, schedule=None, **dict(shape, fixed_by=None, **exempt))


def test_the_schedule_shape_is_read_from_the_loops_that_fix_it(monkeypatch):
    assert schedule_shape(bridge_state(64, 2)) == (64, 2, schedule_shape(bridge_state(64, 2)).source)
    batched = bridge_state(64)
    batched.cfg.dataset.dataloader_type = "batch"  # Bridge takes each global batch's own length there
    assert schedule_shape(batched) is None
    monkeypatch.delitem(sys.modules, "megatron.training.global_vars", raising=False)
    assert schedule_shape(None) is None  # a direct get_forward_backward_func: not known


def test_megatron_lms_args_give_the_schedule_shape(monkeypatch):
    global_vars = pytest.importorskip("megatron.training.global_vars")  # not in the floor's environment
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", None)
    assert schedule_shape(None) is None  # imported but not initialised: not its loop
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", Namespace(seq_length=64, decoder_seq_length=None,
                                                               micro_batch_size=4))
    assert schedule_shape(None)[:2] == (64, 4)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", Namespace(seq_length=64, decoder_seq_length=48,
                                                               micro_batch_size=1))
    assert schedule_shape(None)[:2] == (48, 1)  # what the schedule without interleaving reads
    assert schedule_shape(None, interleaved=True)[:2] == (64, 1)
