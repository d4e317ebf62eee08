"""`megatron-vlm-packing check FILE --hf-config PATH`: a real Hugging Face config (Qwen2.5-VL, Qwen3-VL,
Qwen3-Omni; tiny sizes, `save_pretrained`) read into the model's mRoPE index, against which the saved
pack's positions are compared per document. A clean pack from `pack_batch(mrope=MRopeConfig.from_hf_config)`
exits 0 and says the positions were compared; one position off by 1 on an image token exits 1 naming
the check; a config that is not an mRoPE model, or a path with no config, exits 2 with the reason.

Rows: `tests/rope/conftest.py` (images, videos, Qwen3-VL per-frame video blocks); Qwen3-Omni audio:
`tests/validate/test_omni_audio.py`'s mix.
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing import pack_batch
from megatron_vlm_packing.cli import main
from megatron_vlm_packing.rope import MRopeConfig

transformers = pytest.importorskip("transformers")

from megatron_vlm_packing.validate import validate_packed_batch  # noqa: E402
from tests.rope.conftest import IMAGE, VIDEO, hf_config, random_rows  # noqa: E402


def saved(packed, batch: dict) -> dict:
    """The saved-batch keys (validate.saved_keys.SAVED_KEYS) another packer would write for `packed`: no
    placeholder ids (the config gives them), the unpacked rows as the source."""
    params = packed.packed_seq_params
    fields = dict(input_ids=packed.input_ids, labels=packed.labels, loss_mask=packed.loss_mask,
                  position_ids=packed.position_ids, padding_mask=packed.padding_mask,
                  packed_seq_params={k: getattr(params, k) for k in ("cu_seqlens_q", "cu_seqlens_q_padded",
                                                                     "max_seqlen_q", "max_seqlen_kv")},
                  source_input_ids=batch["input_ids"], source_labels=batch["labels"],
                  source_attention_mask=batch["attention_mask"], label_style="hf")
    fields.update({k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
                   if batch.get(k) is not None})
    return fields


def vision_pack(family: str, config_path, seed: int = 2, cp_size: int = 2) -> tuple[dict, object]:
    """(saved fields, packed) of 4 rows with images and videos, packed with the saved config's index."""
    config = transformers.AutoConfig.from_pretrained(str(config_path))
    ids, mask, images, videos, seconds = random_rows(family, 4, seed)
    assert images is not None and videos is not None
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, image_grid_thw=images,
                 video_grid_thw=videos, **({"second_per_grid_ts": seconds} if family == "qwen2_5_vl" else {}))
    packed = pack_batch(batch, label_style="hf", mrope=MRopeConfig.from_hf_config(config), cp_size=cp_size)
    return saved(packed, batch), packed


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """{name: path}: Qwen2.5-VL as a model directory, Qwen3-VL as a config.json file, a Llama directory."""
    root = tmp_path_factory.mktemp("hf")
    hf_config("qwen2_5_vl").save_pretrained(root / "qwen2_5_vl")
    hf_config("qwen3_vl").save_pretrained(root / "qwen3_vl")
    transformers.LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=32).save_pretrained(root / "llama")
    return {"qwen2_5_vl": root / "qwen2_5_vl", "qwen3_vl": root / "qwen3_vl" / "config.json", "llama": root / "llama"}


@pytest.fixture(scope="module")
def qwen25(configs, tmp_path_factory):
    """(path of the saved Qwen2.5-VL pack, its fields, packed)."""
    fields, packed = vision_pack("qwen2_5_vl", configs["qwen2_5_vl"])
    path = tmp_path_factory.mktemp("packs") / "qwen2_5_vl.pt"
    torch.save(fields, path)
    return path, fields, packed


def check(capsys, *argv) -> tuple[int, str]:
    status = main(["check", *map(str, argv)])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_clean_pack_is_compared_with_the_configs_index(family, configs, tmp_path, capsys):
    fields, _ = vision_pack(family, configs[family])
    path = tmp_path / "batch.pt"
    torch.save(fields, path)
    status, out = check(capsys, path, "--cp", 2, "--hf-config", configs[family])
    assert status == 0, out
    assert f"positions: compared with the {family} index of {configs[family]}, per document" in out
    assert "not checked" not in out  # placeholders (ids from the config) and every document's positions checked
    torch.save({**fields, "image_token_id": IMAGE, "video_token_id": VIDEO}, path)
    status, out = check(capsys, path)  # no config: said so, with the flag that would check them
    assert status == 0 and "not checked: mrope_positions (no mrope" in out, out
    assert "positions: not compared with the model's index (give --hf-config PATH" in out


@pytest.mark.parametrize("family, runs, named", [
    ("qwen2_5_vl", [2, 2], True),   # one block per video: a run ending at a frame is a broken block
    ("qwen3_vl", [2, 2], False),    # one block per frame (timestamp text between)
    ("qwen3_vl", [1, 3], True),     # a run ending inside a frame
    (None, [2, 2], False),          # family unknown: either layout is some model's
])
def test_video_runs_per_frame_are_qwen3_vl_only(family, runs, named):
    """A 2-frame video of 2 tokens per frame laid out as placeholder runs `runs`, text around them."""
    ids = [7] + [VIDEO] * runs[0] + [8] + [VIDEO] * runs[1] + [9]
    mrope = MRopeConfig(family=family) if family else None
    report = validate_packed_batch(input_ids=torch.tensor([ids]), cu_seqlens=torch.tensor([0, len(ids)]),
                                   max_seqlen=len(ids), video_grid_thw=torch.tensor([[2, 2, 4]]),
                                   video_token_id=VIDEO, mrope=mrope)
    assert "vision_placeholders" in report.checked
    assert ("vision_placeholders" in report.failed_checks) == named, str(report)


def test_one_position_off_on_an_image_token_exits_1(qwen25, configs, tmp_path, capsys):
    _, fields, packed = qwen25
    cu = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    slot = int((packed.input_ids[0] == IMAGE).nonzero()[1])  # inside a block: a document's first token is 0
    document = sum(1 for start in cu[1:] if start <= slot)
    positions = packed.position_ids.clone()
    positions[1, 0, slot] += 1  # the h channel of one image token
    path = tmp_path / "planted.pt"
    torch.save({**fields, "position_ids": positions}, path)
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"])
    assert status == 1, out
    assert "1 violation(s)" in out and "[mrope_positions] (contract 3)" in out
    assert f"documents [{document}]: document {document} token" in out and "where the model's index gives" in out
    status, out = check(capsys, path)  # restarts and distinct channels hold: only the index sees it
    assert status == 0 and "positions: not compared" in out, out


def test_1d_positions_for_an_mrope_model_are_named(qwen25, configs, tmp_path, capsys):
    _, fields, packed = qwen25
    path = tmp_path / "flat.pt"
    torch.save({**fields, "position_ids": packed.position_ids[0]}, path)  # [1, T]: bug class 1
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"])
    assert status == 1 and "[mrope_channels_identical]" in out, out
    assert "positions: 1D; the qwen2_5_vl index" in out
    assert "not checked: mrope_positions (position_ids are 1D" in out, out  # the report's own skip
    no_positions = {k: v for k, v in fields.items() if k != "position_ids"}
    torch.save(no_positions, path)
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"])
    assert status == 0 and "positions: NOT compared with the qwen2_5_vl index" in out, out
    assert "the file has no position_ids" in out


def test_qwen3_omni_config_checks_audio_and_positions(tmp_path, capsys):
    pytest.importorskip("transformers.models.qwen3_omni_moe", reason="transformers without Qwen3-Omni")
    from megatron_vlm_packing.bridge.build_omni import thinker_hf_config
    from tests.models.test_packed_vlm_omni import _collate, _omni_cfg, _samples
    from tests.validate.test_omni_audio import saved_fields

    cfg = _omni_cfg()
    # the thinker's block-opening id, which a thinker config does not carry by default (this tiny model's
    # is not Qwen's 151652), written into config.json as a real checkpoint's thinker_config holds it
    thinker = {**thinker_hf_config(cfg).to_dict(), "vision_start_token_id": cfg.token_ids["vision_start_token_id"]}
    transformers.Qwen3OmniMoeConfig(thinker_config=thinker).save_pretrained(tmp_path / "omni")
    mrope = MRopeConfig.from_hf_config(transformers.AutoConfig.from_pretrained(str(tmp_path / "omni")))
    assert mrope.family == "qwen3_omni" and mrope.audio_token_id == cfg.token_ids["audio_token_id"]
    assert mrope.vision_start_token_id == cfg.token_ids["vision_start_token_id"]
    packed = pack_batch(_collate(_samples(cfg)), mrope=mrope, label_style="hf", cp_size=2)
    fields = saved_fields(packed)  # no audio_token_id: the config's
    torch.save(fields, tmp_path / "omni.pt")
    status, out = check(capsys, tmp_path / "omni.pt", "--hf-config", tmp_path / "omni")
    assert status == 0 and "positions: compared with the qwen3_omni index" in out, out
    assert "not checked: mrope_positions" not in out and "not checked: audio_placeholders" not in out, out
    positions = packed.position_ids.clone()
    slot = int((packed.input_ids[0] == mrope.audio_token_id).nonzero()[2])
    positions[0, 0, slot] += 0.5  # Qwen3-Omni t positions are fractional
    torch.save({**fields, "position_ids": positions}, tmp_path / "omni.pt")
    status, out = check(capsys, tmp_path / "omni.pt", "--hf-config", tmp_path / "omni")
    assert status == 1 and "[mrope_positions]" in out, out


def test_configs_that_cannot_give_an_index_exit_2(qwen25, configs, tmp_path, capsys):
    path = qwen25[0]
    status, out = check(capsys, path, "--hf-config", configs["llama"])
    assert status == 2 and "model_type 'llama' is not an mRoPE model" in out and "qwen2_5_vl" in out, out
    status, out = check(capsys, path, "--hf-config", tmp_path / "missing")  # never looked up on the Hub
    assert status == 2 and "missing: no such file or directory" in out, out
    (tmp_path / "empty").mkdir()
    status, out = check(capsys, path, "--hf-config", tmp_path / "empty")
    assert status == 2 and "a directory without config.json" in out, out
    (tmp_path / "bad.json").write_text("{not json")
    status, out = check(capsys, path, "--hf-config", tmp_path / "bad.json")
    assert status == 2 and "not a Hugging Face config transformers can read" in out, out


def test_text_offset_picks_the_transformers_4_57_rule(configs, tmp_path, capsys):
    """Positions made by transformers 4.57 (text resumes at the video block's largest position + 1) fail
    against the default rule after a video whose time positions outrun h and w, and pass with
    `--text-offset max_position`; the flag without --hf-config exits 2."""
    config = transformers.AutoConfig.from_pretrained(str(configs["qwen2_5_vl"]))  # 2 tokens per second
    video = [5, 151652] + [VIDEO] * 16 + [151653, 7, 8]  # grid [4, 4, 4], merge 2: 16 tokens, t up to 6
    ids = torch.tensor([video, [9, 10, 11] + [0] * (len(video) - 3)])
    mask = (ids != 0).long()
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, video_grid_thw=torch.tensor([[4, 4, 4]]),
                 second_per_grid_ts=torch.tensor([1.0]))
    old_rule = MRopeConfig.from_hf_config(config, text_offset="max_position")
    packed = pack_batch(batch, label_style="hf", mrope=old_rule)
    assert not torch.equal(packed.position_ids, pack_batch(batch, label_style="hf",
                                                           mrope=MRopeConfig.from_hf_config(config)).position_ids)
    path = tmp_path / "qwen2_5_vl_457.pt"
    torch.save(saved(packed, batch), path)
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"])
    assert status == 1 and "[mrope_positions]" in out and "document 0" in out, out
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"], "--text-offset", "max_position")
    assert status == 0 and "compared with the qwen2_5_vl index" in out and "transformers 4.57" in out, out
    status, out = check(capsys, path, "--text-offset", "max_position")
    assert status == 2 and "give --hf-config PATH too" in out, out


def test_videos_saved_without_their_seconds_are_named_not_compared(configs, tmp_path, capsys):
    """A Qwen2.5-VL pack whose videos take 2 s per temporal grid step, saved without `second_per_grid_ts`: its
    positions were compared with the index at transformers' default of 1 s (what its get_rope_index assumes when
    given none; its processor always gives them) and reported as mrope_positions. What is wrong is the missing
    input: the documents with videos are listed as not checked, naming the field; the others are compared."""
    config = transformers.AutoConfig.from_pretrained(str(configs["qwen2_5_vl"]))
    ids, mask, images, videos, seconds = random_rows("qwen2_5_vl", 4, seed=2)
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=mask, image_grid_thw=images, video_grid_thw=videos,
                 second_per_grid_ts=torch.full_like(seconds, 2.0))  # t steps 4 positions, not the default's 2
    packed = pack_batch(batch, label_style="hf", mrope=MRopeConfig.from_hf_config(config))
    fields = saved(packed, batch)
    path = tmp_path / "batch.pt"
    torch.save(fields, path)
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"])
    assert status == 0 and "not checked" not in out, out
    cu = packed.packed_seq_params.cu_seqlens_q_padded.tolist()
    with_videos = [d for d in range(len(cu) - 1) if bool((packed.input_ids[0, cu[d]:cu[d + 1]] == VIDEO).any())]
    assert 0 < len(with_videos) < len(cu) - 1  # some documents are compared, some cannot be
    torch.save({k: v for k, v in fields.items() if k != "second_per_grid_ts"}, path)
    status, out = check(capsys, path, "--hf-config", configs["qwen2_5_vl"])
    assert status == 0 and "[mrope_positions]" not in out, out
    assert f"not checked: mrope_positions (documents {with_videos}: video placeholders but no second_per_grid_ts" \
        in out, out
    assert "per document; the documents listed as not checked were not" in out
    from megatron_vlm_packing.validate.model_index import NO_SECONDS
    from tests.rope.conftest import hf_get_rope_index

    index = hf_get_rope_index("qwen2_5_vl", config)  # the model's own index: a callable naming second_per_grid_ts
    report = validate_packed_batch(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                   packed_seq_params=packed.packed_seq_params, image_token_id=IMAGE,
                                   video_token_id=VIDEO, image_grid_thw=images, video_grid_thw=videos, mrope=index)
    assert report.ok and ("mrope_positions", f"documents {with_videos}: {NO_SECONDS}") in report.skipped, str(report)
