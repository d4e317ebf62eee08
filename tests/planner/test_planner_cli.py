"""`megatron-vlm-packing plan` prints both plans, and balancing lowers the per-rank max/mean."""

from megatron_vlm_packing.cli import main


def test_plan_command_shows_balancing(capsys):
    assert main(["plan", "--samples", "2000", "--dp", "4", "--cp", "2", "--steps-shown", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["unbalanced"], ["balanced"])
            and "step" not in line}
    assert set(rows) == {"unbalanced", "balanced"}
    assert float(rows["balanced"][3]) < float(rows["unbalanced"][3])  # mean over steps of max/mean
    assert "balanced     step 0 per-rank cost (PFLOP)" in out and "segment 4, total 4" in out


def test_demo_planner_flag_prints_both_plans(capsys):
    assert main(["demo", "--planner", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "unbalanced   step 0 per-rank cost" in out and "balanced     step 0 per-rank cost" in out
    assert "segment 4, total 4" in out  # the demo's --cp reached the planner's alignment


def test_plan_command_refuses_a_negative_seed(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error, not numpy's message
        main(["plan", "--samples", "100", "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "argument --seed: must be an int >= 0, got -1" in capsys.readouterr().err


def test_plan_command_refuses_counts_it_cannot_show_naming_them(capsys):
    """--steps-shown -1 printed every step but the last (a slice); --samples -5 and an epoch with no full step
    exited with numpy's words ('negative dimensions are not allowed', 'zero-size array to reduction ...')."""
    import pytest

    for flag, value, words in (("--steps-shown", "-1", "argument --steps-shown: must be an int >= 0, got -1"),
                               ("--samples", "-5", "argument --samples: must be a positive int (>= 1), got -5")):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--samples", "100", flag, value])
        assert exit_info.value.code == 2 and words in capsys.readouterr().err
    assert main(["plan", "--samples", "3", "--dp", "8"]) == 2
    assert ("the epoch has no full step: its 3 samples fill fewer bins than a step's 8 (--dp 8 x --micro-batches 1)"
            in capsys.readouterr().err)


def test_plan_and_inspect_refuse_sp_without_tp(capsys):
    """`plan --sp --tp 1` planned as if SP were off; Megatron-Core refuses SP without TP (ModelParallelConfig)."""
    for argv in (["plan", "--samples", "100", "--sp"], ["plan", "--samples", "100", "--sp", "--tp", "1"],
                 ["demo", "--planner", "--sp"], ["inspect", "5,3", "--sp"]):
        assert main(argv) == 2, argv
        assert "sequence_parallel=True needs tp_size > 1, got tp_size=1" in capsys.readouterr().err, argv
    assert main(["plan", "--samples", "100", "--sp", "--tp", "2", "--steps-shown", "0"]) == 0
