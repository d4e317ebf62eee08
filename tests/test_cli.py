import pytest

from megatron_vlm_packing.cli import main


def test_inspect_prints_both_boundary_sets_and_cp_indices(capsys):
    assert main(["inspect", "5,0,3", "--seq", "8", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "cu_seqlens         [0, 5, 8]" in out
    assert "cu_seqlens_padded  [0, 8, 12]" in out
    assert "cp rank 0: [0, 1, 6, 7, 8, 11]" in out and "cp rank 1: [2, 3, 4, 5, 9, 10]" in out


def test_inspect_bad_input_is_a_clear_error(capsys):
    assert main(["inspect", "5,3", "--pad-to", "4"]) == 2
    assert "pad_to=4 is smaller than the 8 physical tokens" in capsys.readouterr().err


def test_inspect_rejects_non_integers():
    with pytest.raises(SystemExit):
        main(["inspect", "5,x"])
