"""Megatron-Bridge's own Qwen-VL collate output (`tests/bridge/bridge_collate.py`: `qwen2_5_collate_fn`'s lines on the
processor's output, with Bridge's own `GenericVisualInputs` and `prepare_sequence_batch`) through the shipped step.

Before, the README's recipe for Bridge users (`make_forward_step(pack=True, label_style="hf", with_state=True)`)
refused every such batch (`unknown batch key 'visual_inputs'`); unpacked by hand, with `label_style="hf"`, its
already-shifted labels were shifted again: the tiny Qwen3-VL's loss read 259.84 over 46 targets for 313.00 over 56,
no error. Now the step unpacks `visual_inputs` and takes the batch with `label_style="megatron"`: the pack is the
one the Hugging Face-style batch of the same samples gives (per-token losses and every gradient identical), equal
to each sample alone; the rows' padding to 128 is neither packed nor counted; a batch Bridge packed itself
(enable_in_batch_packing) is cut back into its rows and gives the same pack; the wrong combinations are errors.
Tiny Bridge models (CPU, one process, local specs).
"""

from __future__ import annotations

import pytest
import torch

from megatron_vlm_packing.testing.step_models import step_loss
from tests.bridge.bridge_collate import bridge_collate, generic_visual_inputs, processor_output
from tests.bridge.tiny_qwen_vl import tiny_qwen_vl_case
from tests.bridge.step_run import run_step

pytestmark = pytest.mark.bridge
FAMILIES = ("qwen3_vl", "qwen25_vl")
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-5
README_BRIDGE_STEP = dict(pack=True, label_style="megatron", with_state=True)  # the README's arguments


@pytest.fixture(scope="module")
def cases(single_process_megatron):
    return {family: tiny_qwen_vl_case(family) for family in FAMILIES}


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def test_the_stand_in_is_bridges_format(cases):
    """The batch is what Bridge's collate returns: rows padded to 128, labels the next token (-100 where the
    shifted loss mask is 0), arange positions, the vision in one GenericVisualInputs."""
    case = cases["qwen3_vl"]
    batch, hf = bridge_collate(case["samples"], case["cfg"]), processor_output(case["samples"], case["cfg"])
    assert type(batch["visual_inputs"]).__name__ == "GenericVisualInputs"
    assert batch["input_ids"].shape[1] == 128 and hf["input_ids"].shape[1] < 128
    width = hf["input_ids"].shape[1]
    trained = hf["labels"][:, 1:] != -100
    assert torch.equal(batch["labels"][:, :width - 1][trained], hf["input_ids"][:, 1:][trained])
    assert torch.equal(batch["loss_mask"][:, :width - 1], trained.float())
    assert (batch["labels"][:, width - 1:] == -100).all() and not batch["attention_mask"][:, width:].any()
    assert torch.equal(batch["position_ids"], torch.arange(128).expand(len(case["samples"]), -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_batch_packs_as_the_hf_batch(cases, family):
    """Bridge's batch (label_style="megatron") and the HF-style batch of the same samples (label_style="hf") give
    the same pack: identical per-token losses, target count and gradients; the 128-padding is not packed."""
    case = cases[family]
    ours = run_step(case["model"], case["batch"], pack=True, label_style="hf")
    bridge = run_step(case["model"], bridge_collate(case["samples"], case["cfg"]), **README_BRIDGE_STEP)
    real = sum(len(s["input_ids"]) for s in case["samples"])
    assert bridge["micro_batch"].stats.real_tokens == ours["micro_batch"].stats.real_tokens == real
    assert bridge["count"] == ours["count"] and torch.equal(bridge["losses"], ours["losses"])
    assert torch.equal(bridge["micro_batch"].position_ids, ours["micro_batch"].position_ids)  # each sample's mRoPE
    assert bridge["grads"].keys() == ours["grads"].keys()
    assert all(torch.equal(bridge["grads"][n], ours["grads"][n]) for n in ours["grads"])


@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_batch_packed_equals_each_sample_alone(cases, family):
    """The pack of Bridge's batch against each sample's own Bridge batch (padded to 128 alone) through the step:
    per-token losses and the summed gradients, vision tower included."""
    case = cases[family]
    packed = run_step(case["model"], bridge_collate(case["samples"], case["cfg"]), pack=True, label_style="megatron")
    alone = [run_step(case["model"], bridge_collate([s], case["cfg"]), pack=True, label_style="megatron")
             for s in case["samples"]]
    assert packed["count"] == sum(a["count"] for a in alone) > 0
    assert _max_rel(packed["losses"], torch.cat([a["losses"] for a in alone])) < LOSS_TOLERANCE
    tower = ("vision_model." if family == "qwen3_vl" else "visual.")
    assert any(n.startswith(tower) for n in packed["grads"])
    for name, grad in packed["grads"].items():  # a text-only sample alone leaves the tower without gradients
        summed = sum(a["grads"].get(name, torch.zeros_like(grad)) for a in alone)
        assert _max_rel(grad, summed) < GRAD_TOLERANCE, name


@pytest.mark.parametrize("in_batch_packed", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_bridge_batch_dense_rows_as_the_hf_batch(cases, family, in_batch_packed):
    """pack=False: the same dense rows as the HF-style batch (the 128-padding cut back to the layout's length; a
    Bridge pack cut back into its rows)."""
    case = cases[family]
    ours = run_step(case["model"], case["batch"], pack=False, label_style="hf")
    batch = bridge_collate(case["samples"], case["cfg"], enable_in_batch_packing=in_batch_packed)
    bridge = run_step(case["model"], batch, pack=False, label_style="megatron")
    assert bridge["count"] == ours["count"] and torch.equal(bridge["losses"], ours["losses"])
    assert all(torch.equal(bridge["grads"][n], ours["grads"][n]) for n in ours["grads"])


def test_bridge_batch_with_tokens_for_input_ids(cases):
    """Bridge's batches name the ids `tokens` or `input_ids` (its step reads either): the same pack."""
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"])
    renamed = {("tokens" if key == "input_ids" else key): value for key, value in batch.items()}
    assert step_loss(case["model"], renamed, pack=True, label_style="megatron") == \
        step_loss(case["model"], batch, pack=True, label_style="megatron")


def test_bridge_batch_with_hf_labels_is_refused(cases):
    """label_style="hf" would shift Bridge's next-token labels a second time (before: no error once unpacked)."""
    case = cases["qwen3_vl"]
    with pytest.raises(ValueError, match=r"already next-token targets .* label_style='megatron'"):
        step_loss(case["model"], bridge_collate(case["samples"], case["cfg"]), pack=True, label_style="hf")


@pytest.mark.parametrize("multiple", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_in_batch_packed_bridge_batch_packs_as_the_hf_batch(cases, family, multiple):
    """Bridge's own in-batch THD packing (enable_in_batch_packing, documents aligned to `multiple`) is cut back into
    its rows and packed by the step: the HF-style batch's pack, per-token losses and gradients identical. Before,
    refused as unknown keys."""
    case = cases[family]
    batch = bridge_collate(case["samples"], case["cfg"], enable_in_batch_packing=True,
                           in_batch_packing_pad_to_multiple_of=multiple)
    assert batch["input_ids"].shape[0] == 1 and "cu_seqlens_q" in batch
    assert ("cu_seqlens_q_padded" in batch) == (multiple > 1)
    ours = run_step(case["model"], case["batch"], pack=True, label_style="hf")
    bridge = run_step(case["model"], batch, **README_BRIDGE_STEP)
    assert bridge["count"] == ours["count"] and torch.equal(bridge["losses"], ours["losses"])
    assert torch.equal(bridge["micro_batch"].input_ids, ours["micro_batch"].input_ids)
    assert all(torch.equal(bridge["grads"][n], ours["grads"][n]) for n in ours["grads"])


def _longer_first(boundaries: torch.Tensor) -> torch.Tensor:
    """The first document 4 tokens longer than its physical slots (the later boundaries moved with it)."""
    moved = boundaries.clone()
    moved[1:-1] += 4
    return moved


@pytest.mark.parametrize("edit, message", [
    (lambda b: b.update(cu_seqlens_q=_longer_first(b["cu_seqlens_q"]), cu_seqlens_kv=_longer_first(b["cu_seqlens_kv"])),
     r"boundaries do not describe its \d+ slots: cu_seqlens_q \[0, \d+, "),
    (lambda b: b.update(cu_seqlens_kv=_longer_first(b["cu_seqlens_kv"])),
     r"cu_seqlens_kv .* differs from cu_seqlens_q"),
    (lambda b: b.update(cu_seqlens_q_padded=b["cu_seqlens_q_padded"][:-1],
                        cu_seqlens_kv_padded=b["cu_seqlens_kv_padded"][:-1]), r"boundaries do not describe"),
    (lambda b: b.update(labels=b["labels"][:, :-4]), r"sequence fields must all be one \[1, T\] row"),
    (lambda b: b.pop("cu_seqlens_q"), r"carries \['cu_seqlens_kv', .* without its cu_seqlens_q"),
], ids=["a document longer than its slots", "kv boundaries", "a document missing", "labels cut", "no cu_seqlens_q"])
def test_bridge_pack_whose_boundaries_do_not_fit_is_refused(cases, edit, message):
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"], enable_in_batch_packing=True,
                           in_batch_packing_pad_to_multiple_of=4)
    edit(batch)
    with pytest.raises(ValueError, match=message):
        step_loss(case["model"], batch, pack=True, label_style="megatron")


def test_in_batch_packed_bridge_batch_with_hf_labels_is_refused(cases):
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"], enable_in_batch_packing=True)
    with pytest.raises(ValueError, match=r"carries \['visual_inputs', 'cu_seqlens_q'.* next-token targets"):
        step_loss(case["model"], batch, pack=True, label_style="hf")


def test_visual_inputs_field_no_adapter_consumes_is_refused(cases):
    """A field of GenericVisualInputs no adapter reads (Gemma's image_sizes) is named, not dropped."""
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"])
    fields = batch["visual_inputs"].as_model_kwargs()
    batch["visual_inputs"] = generic_visual_inputs(**fields, image_sizes=torch.tensor([[32, 64]]))
    with pytest.raises(ValueError, match=r"visual_inputs carries \{'image_sizes': \(1, 2\)\}, which no model adapter"):
        step_loss(case["model"], batch, pack=True, label_style="megatron")


def test_visual_inputs_field_also_a_batch_key_is_refused(cases):
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"])
    batch["pixel_values"] = batch["visual_inputs"].pixel_values
    with pytest.raises(ValueError, match=r"visual_inputs.pixel_values is given and so is the batch key"):
        step_loss(case["model"], batch, pack=True, label_style="megatron")


def test_bridge_positions_other_than_an_arange_are_refused(cases):
    """Bridge's models discard 2D positions; here they must be the arange its collate writes, else a ValueError
    (a restart inside a row is read as two documents, never replaced silently)."""
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"])
    batch["position_ids"][0, 5:] -= 5
    with pytest.raises(ValueError, match=r"position_ids .* is 0, expected 5 \(it restarts"):
        step_loss(case["model"], batch, pack=True, label_style="megatron")


def test_bridge_batch_with_1d_positions_copied_into_three_channels_is_refused(cases):
    """[3, B, S] positions given in a Bridge batch with images are packed as given: the arange of each row copied
    into the three mRoPE channels trained silently (tiny Qwen3-VL: a loss of 312.76 against 313.00 with the
    right positions); now a ValueError naming position_ids, the row and its image, saying to drop them. The
    model's own positions, given the same way, are taken and train as the step's."""
    case = cases["qwen3_vl"]
    batch = bridge_collate(case["samples"], case["cfg"])
    computed = step_loss(case["model"], batch, pack=True, label_style="megatron")
    flat = dict(batch, position_ids=batch["position_ids"][None].expand(3, -1, -1).clone())
    with pytest.raises(ValueError, match=r"position_ids of (row \d+|every row) are equal on their three mRoPE "
                                         r"channels .* holds image \d+ of image_grid_thw .* drop position_ids"):
        step_loss(case["model"], flat, pack=True, label_style="megatron")
    from megatron_vlm_packing.rope import get_rope_index

    visual = batch["visual_inputs"]
    own = get_rope_index(batch["input_ids"], case["cfg"].mrope_config(), image_grid_thw=visual.image_grid_thw,
                         video_grid_thw=getattr(visual, "video_grid_thw", None),
                         attention_mask=batch["attention_mask"]).position_ids
    assert step_loss(case["model"], dict(batch, position_ids=own), pack=True, label_style="megatron") == computed


def test_packing_collator_takes_bridge_batches(cases):
    """`PackingCollator(label_style="megatron")` around Bridge's collate: the step's pack, loss for loss."""
    from megatron_vlm_packing.packing.collate import PackingCollator

    case = cases["qwen25_vl"]
    cfg = case["cfg"]
    collator = PackingCollator(collate=lambda samples: bridge_collate(samples, cfg), label_style="megatron",
                               mrope=cfg.mrope_config())
    loader = step_loss(case["model"], collator(case["samples"]), pack=True, label_style="megatron")
    assert loader == step_loss(case["model"], case["batch"], pack=True, label_style="hf")


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_probe_on_bridge_batches(cases, family, capsys):
    """The step's parity probe splits Bridge's (unpacked) batch per sample: packed == alone within its bound."""
    case = cases[family]
    step_loss(case["model"], bridge_collate(case["samples"], case["cfg"]), pack=True, label_style="megatron",
              parity_probe_every=1)
    assert "parity probe" in capsys.readouterr().out


def test_text_pack_of_bridge_without_visual_inputs():
    """A Bridge text pack (its GPT collators' in-batch packing: no visual_inputs) packs as the rows it came from."""
    from megatron_vlm_packing import pack_batch
    from megatron_vlm_packing.bridge.imports import import_bridge_module

    build = import_bridge_module("megatron.bridge.data.packing.in_batch").build_mcore_thd_sequence_batch_from_rows
    rng = torch.Generator().manual_seed(3)
    ids = [torch.randint(1, 100, (n,), generator=rng) for n in (7, 3, 12)]
    rows = [dict(input_ids=i, position_ids=torch.arange(len(i)), loss_mask=torch.ones(len(i)),
                 labels=torch.cat([i[1:], torch.tensor([-100])])) for i in ids]
    packed = pack_batch(build(rows, pad_to_multiple_of=4), label_style="megatron", tp_size=2, sequence_parallel=True)
    width = max(len(i) for i in ids)
    padded = {key: torch.stack([torch.nn.functional.pad(r[key], (0, width - len(r[key])), value=fill) for r in rows])
              for key, fill in (("input_ids", 0), ("labels", -100), ("loss_mask", 0))}
    padded["attention_mask"] = (torch.arange(width)[None] < torch.tensor([len(i) for i in ids])[:, None]).long()
    expected = pack_batch(padded, label_style="megatron", tp_size=2, sequence_parallel=True)
    for field in ("input_ids", "labels", "loss_mask", "position_ids"):
        assert torch.equal(getattr(packed, field), getattr(expected, field)), field
    assert torch.equal(packed.packed_seq_params.cu_seqlens_q, expected.packed_seq_params.cu_seqlens_q)
