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


@pytest.mark.parametrize("lengths", ["5,,3", "5,3,", ",", ""])
def test_inspect_rejects_empty_entries(lengths, capsys):
    with pytest.raises(SystemExit):  # "5,,3" was read as 2 rows, "" reached max() of nothing
        main(["inspect", lengths])
    assert "expected comma-separated ints" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["5,3", "--pad-to", str(10**14)], "must be <= 2147483647 (cu_seqlens are int32)"),   # was a RuntimeError traceback
    (["2000000000,2000000000"], "the pack has 4000000000 slots"),
])
def test_inspect_packs_beyond_int32_are_a_clear_error(argv, words, capsys):
    assert main(["inspect", *argv]) == 2
    assert words in capsys.readouterr().err


def _saved_pack(tmp_path, name="batch.pt", **changes):
    import torch

    from megatron_vlm_packing import pack_batch

    ids = torch.tensor([[11, 12, 13, 14, 15, 0], [21, 22, 0, 0, 0, 0], [31, 32, 33, 0, 0, 0]])
    mask = (torch.arange(6) < torch.tensor([[5], [2], [3]])).long()
    labels = torch.where(mask.bool(), ids, -100)
    packed = pack_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, cp_size=2, label_style="hf")
    batch = {"input_ids": packed.input_ids, "labels": packed.labels, "loss_mask": packed.loss_mask,
             "position_ids": packed.position_ids, "padding_mask": packed.padding_mask,
             "packed_seq_params": packed.packed_seq_params, "cp_size": 2,
             "source_input_ids": ids, "source_labels": labels, "source_attention_mask": mask, "label_style": "hf"}
    batch.update(changes)
    path = tmp_path / name
    torch.save(batch, path)
    return path, packed


def test_check_a_clean_saved_batch_exits_0(tmp_path, capsys):
    path, _ = _saved_pack(tmp_path)
    assert main(["check", str(path)]) == 0
    assert "packed batch: 3 documents, 10 real tokens in 16 slots: OK" in capsys.readouterr().out


def test_check_reports_uniform_boundaries_and_exits_1(tmp_path, capsys):
    import torch

    cu = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    path, _ = _saved_pack(tmp_path, packed_seq_params={"cu_seqlens_q": cu, "cu_seqlens_q_padded": cu,
                                                       "max_seqlen_q": 8, "max_seqlen_kv": 8})
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "1 violation(s)" in out
    assert "[uniform_boundaries] (contract 2, bug class 4)" in out and "(document, pad slots) [(0, 3), (1, 2), (2, 1)]" in out


def test_check_layout_flags_override_the_file(tmp_path, capsys):
    path, _ = _saved_pack(tmp_path)
    assert main(["check", str(path), "--cp", "4"]) == 1
    assert "[alignment]" in capsys.readouterr().out


def test_check_unreadable_files_exit_2(tmp_path, capsys):
    import torch

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    assert main(["check", str(garbage)]) == 2
    assert "not a readable torch.save file" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "missing.pt")]) == 2
    assert "no such file" in capsys.readouterr().err
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    assert main(["check", str(listed)]) == 2
    assert "holds a list, expected a dict" in capsys.readouterr().err
    unknown, _ = _saved_pack(tmp_path, "unknown.pt", cu_seqlen=1)
    assert main(["check", str(unknown)]) == 2
    assert "unknown keys in the batch: ['cu_seqlen']" in capsys.readouterr().err


@pytest.mark.parametrize("changes, words", [
    ({1: 0, "x": 0}, "unknown keys in the batch: ['x', 1]"),      # keys of mixed types did not sort: TypeError
    ({"labels": "abc"}, "labels must be a tensor"),
    ({"packed_seq_params": {"cu_seqlens_q": "0,5"}}, "cu_seqlens must be a tensor"),
    ({"image_token_id": 13, "image_grid_thw": [[1, 2, 2]], "spatial_merge_size": 0}, "spatial_merge_size must be >= 1"),
    ({"images_per_document": 3}, "images_per_document must be N counts"),
    ({"source_labels": [[1, 2]]}, "source_labels must be [B, S] like source_input_ids (3, 6)"),
    ({"cp_ranks": {0: 5}}, "cp_ranks must be {rank:"),
    ({"cp_size": 2.5}, "cp_size must be an int, got 2.5"),
    ({"mrope": 5}, "mrope must be an MRopeConfig"),
    ({"fp8": "no"}, "fp8 must be a bool, got 'no'"),               # bool("no") checked FP8 alignment
    ({"sequence_parallel": "off", "tp_size": 2}, "sequence_parallel must be a bool, got 'off'"),
    ({"cu_seqlens": [0, 5]}, "the batch has packed_seq_params and ['cu_seqlens']: give the boundaries one way"),
])
def test_check_malformed_fields_exit_2_with_the_field_named(tmp_path, capsys, changes, words):
    path, _ = _saved_pack(tmp_path)
    import torch

    torch.save({**torch.load(path, weights_only=False), **changes}, path)
    assert main(["check", str(path)]) == 2  # before: a TypeError / ZeroDivisionError / IndexError traceback
    assert words in capsys.readouterr().err


def test_check_a_meta_tensor_exits_2(tmp_path, capsys):
    import torch

    path, _ = _saved_pack(tmp_path, labels=torch.empty(1, 16, dtype=torch.long, device="meta"))
    assert main(["check", str(path)]) == 2
    assert "labels must be a dense tensor with data" in capsys.readouterr().err


def test_check_hf_config_without_transformers_exits_2(tmp_path, monkeypatch, capsys):
    import sys

    path, _ = _saved_pack(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    assert main(["check", str(path), "--hf-config", str(tmp_path)]) == 2
    assert "--hf-config needs the transformers package" in capsys.readouterr().err


def test_demo_on_cuda_without_a_cuda_device_is_a_clear_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["demo", "--device", "cuda", "--steps", "1"]) == 2  # was torch's "no NVIDIA driver" traceback
    assert "--device cuda, but torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("flags, named", [
    (["--steps", "0"], "--steps 0"), (["--no-pack"], "--no-pack"), (["--device", "cpu"], "--device cpu"),
    (["--micro-batch-size", "3", "--steps", "5"], "--steps 5, --micro-batch-size 3"),
])
def test_demo_planner_refuses_the_training_flags_it_does_not_use(flags, named, capsys):
    """`demo --planner` trains nothing: --steps 0 (or -1), --no-pack, --device and --micro-batch-size were
    accepted and silently ignored."""
    assert main(["demo", "--planner", *flags]) == 2
    assert f"--planner trains nothing, so {named} would be ignored" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["input_ids", "labels", "loss_mask"])
def test_check_a_token_row_with_an_extra_dimension_exits_2(tmp_path, capsys, field):
    """[1, 1, T] token ids / labels were taken for [3, 1, T] positions and the check was an IndexError traceback."""
    path, packed = _saved_pack(tmp_path)
    import torch

    torch.save({**torch.load(path, weights_only=False), field: getattr(packed, field)[None]}, path)
    assert main(["check", str(path)]) == 2
    assert f"{field} must be [1, T] (or [3, 1, T] for position_ids), got shape (1, 1, " in capsys.readouterr().err


def test_check_a_file_holding_numpy_arrays_exits_2_saying_what_to_save(tmp_path, capsys):
    """A numpy array in the saved dict: the weights-only load refuses it (no code from the file runs), and the
    CLI said the file was 'not a readable torch.save file' with torch's advice to load it with weights_only=False."""
    import numpy as np
    import torch

    path, _ = _saved_pack(tmp_path)
    torch.save({**torch.load(path, weights_only=False), "labels": np.zeros((1, 10), dtype=np.int64)}, path)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "holds a numpy" in err and "torch.from_numpy" in err and "weights_only` set to `False" not in err


@pytest.mark.parametrize("pad_id, words", [("-1", "pad_token_id must be a non-negative int"),
                                           (str(2**70), "pad_token_id must be at most 2**63 - 1")])
def test_check_a_pad_token_id_no_slot_can_hold_exits_2(tmp_path, capsys, pad_id, words):
    """A negative (or beyond int64) pad id matched no slot, so the checks reading it ran inert and a pack whose
    real spans end in pads passed without even the 'uniform_boundaries not checked' line; the packers' rule now."""
    path, _ = _saved_pack(tmp_path)
    assert main(["check", str(path), "--pad-token-id", pad_id]) == 2
    assert words in capsys.readouterr().err


def _saved_local_pack(tmp_path, cp_rank: int, **changes):
    """The text pack of `_saved_pack` at cp=2 as CP rank `cp_rank` received it (`localize`): labels, loss mask,
    padding mask, ids and positions hold T/2 slots; `cp_index` is the rank's partition index."""
    import torch

    from megatron_vlm_packing.packing.localize import localize
    from megatron_vlm_packing.parallel.layout import ParallelLayout

    _, packed = _saved_pack(tmp_path)
    local = localize(packed, ParallelLayout(cp_size=2, cp_rank=cp_rank))
    batch = {name: getattr(local, name) for name in ("input_ids", "labels", "loss_mask", "position_ids",
                                                     "padding_mask", "packed_seq_params", "cp_index")}
    batch.update(cp_size=2, cp_rank=cp_rank, **changes)
    path = tmp_path / f"rank{cp_rank}.pt"
    torch.save(batch, path)
    return path, local


def test_check_reads_the_cp_index_of_a_batch_saved_on_one_cp_rank(tmp_path, capsys):
    """`cp_index` (and `cp_rank`) are what validate_packed_batch checks a localized batch by, but the CLI
    refused cp_index as an unknown key (exit 2): a batch saved inside a CP run could not be checked."""
    path, local = _saved_local_pack(tmp_path, cp_rank=1)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "packed batch: 3 documents, 10 real tokens in 16 slots: OK" in out, out
    assert "localized to one CP rank" in out
    other, _ = _saved_local_pack(tmp_path, cp_rank=0, cp_index=local.cp_index)  # rank 1's index saved as rank 0's
    assert main(["check", str(other)]) == 1
    out = capsys.readouterr().out
    assert "[cp_partition] (contract 5)" in out and "not TE's zigzag for rank 0 at cp=2" in out, out
    assert "cp_index: [T/cp]" in "\n".join(line.strip() for line in _check_help(capsys).splitlines())


def _check_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    return capsys.readouterr().out


def test_top_level_help_names_every_sub_command(capsys):
    """The description once listed {demo,inspect,check} after `plan` was added."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # after the usage line, which argparse writes itself
    assert description.startswith("Command line"), out
    for command in ("demo", "plan", "inspect", "check"):
        assert command in description, (command, description)


@pytest.mark.parametrize("dtype", ["int64", "uint8", "float32"])
def test_check_a_padding_mask_that_is_not_bool_exits_1_naming_its_dtype(tmp_path, capsys, dtype):
    """An integer padding mask was reported clean (exit 0); Megatron-Core's MoE router reads `~padding_mask`,
    which for int64 0 / 1 is -1 / -2, not the complement: its token count for the aux loss came out negative."""
    import torch

    path, packed = _saved_pack(tmp_path)
    torch.save({**torch.load(path, weights_only=False), "padding_mask": packed.padding_mask.to(getattr(torch, dtype))},
               path)
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"padding_mask has dtype torch.{dtype}; it must be a bool tensor (True at pad slots)" in out
    assert "[dtypes]" in out and "[padding_mask]" not in out  # its values still read as the pad slots they mark
