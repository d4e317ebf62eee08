"""Bad or unusual inputs through `make_forward_step` with real Megatron-Core models (one process, gloo).

`run_step_cases(rank, world_size)` is a `run_distributed` target: it builds the tiny models once,
runs every case in `CASES` and returns {name: ("ok", value) | ("error", exception type, message)}.
Each case is a function `(models) -> value`; the test file states what each must give.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from megatron_vlm_packing.demo.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.models.adapter import ModelAdapter, register_adapter, unregister_adapter
from megatron_vlm_packing.models.audio import TinyAudioTower
from megatron_vlm_packing.models.gpt_adapter import GPTModelAdapter
from megatron_vlm_packing.models.packed_vlm import PackedVLM
from megatron_vlm_packing.models.tiny_gpt import TinyGPTConfig, build_tiny_gpt
from megatron_vlm_packing.models.vision import TinyVisionTower
from megatron_vlm_packing.rope import MRopeConfig
from megatron_vlm_packing.step import make_forward_step

DATA = SyntheticVLMConfig(max_text=10, max_images=2, grid_choices=(2, 4), max_videos=1, max_audios=1)
LM = TinyGPTConfig(vocab_size=DATA.vocab_size, max_sequence_length=512)
ROPE = MRopeConfig(family="qwen2_vl", image_token_id=DATA.image_token_id, video_token_id=DATA.video_token_id,
                   vision_start_token_id=DATA.vision_start_id, mrope_section=(1, 1, 2))
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def loss(step, model, batch) -> tuple[float, int]:
    """(loss_sum, num_tokens) of one micro-batch through `step`, no grad."""
    with torch.no_grad():
        output, reduce = step(iter([batch]), model)
        loss_sum, num_tokens, _ = reduce(output)
    return round(loss_sum.item(), 4), int(num_tokens)


def text_batch() -> dict:
    ids = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 0, 0, 0], [12, 13, 14, 15, 16, 17]])
    mask = (ids != 0).long()
    return {"input_ids": ids, "labels": torch.where(mask.bool(), ids, -100), "attention_mask": mask}


def media_batch(seed: int = 11) -> dict:
    """4 samples with images, a video and audio clips (checked: each kind is present)."""
    batch = collate(synthetic_samples(4, seed=seed, cfg=DATA))
    assert {"pixel_values_videos", "input_features"} <= set(batch) and len(batch["image_grid_thw"]), sorted(batch)
    return batch


def only(batch: dict, *keys: str) -> dict:
    """The text keys plus `keys`; placeholders of dropped media become text."""
    out = {k: batch[k].clone() for k in ("input_ids", "labels", "attention_mask")}
    out.update({k: batch[k] for k in keys})
    dropped = {"pixel_values": DATA.image_token_id, "pixel_values_videos": DATA.video_token_id,
               "input_features": DATA.audio_token_id}
    for key, token in dropped.items():
        if key not in keys:
            out["input_ids"][out["input_ids"] == token] = 7
    return out


def build_models() -> dict:
    torch.manual_seed(0)
    lm = lambda cfg=LM: build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False)  # noqa: E731
    vision = lambda: TinyVisionTower(patch_features=DATA.patch_features, width=16, out_hidden=LM.hidden_size, heads=2)  # noqa: E731
    audio = TinyAudioTower(mel_bins=DATA.mel_bins, width=16, out_hidden=LM.hidden_size)
    mrope_cfg = replace(LM, position_embedding_type="mrope", mrope_section=ROPE.mrope_section)
    mrope_gpt = build_tiny_gpt(mrope_cfg)
    from megatron_vlm_packing.rope import use_packed_mrope

    use_packed_mrope(mrope_gpt)
    return dict(
        gpt=build_tiny_gpt(LM),
        vlm=PackedVLM(lm(), vision(), image_token_id=DATA.image_token_id),
        media=PackedVLM(lm(), vision(), image_token_id=DATA.image_token_id, video_token_id=DATA.video_token_id,
                        audio=audio, audio_token_id=DATA.audio_token_id),
        mrope_gpt=mrope_gpt,
        mrope_vlm=PackedVLM(lm(mrope_cfg), vision(), image_token_id=DATA.image_token_id,
                            video_token_id=DATA.video_token_id, mrope=ROPE),
    )


class Wrapper(nn.Module):
    """A DDP / Float16Module-like wrapper (holds the model as `.module`)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class NoPackedSeqParams(nn.Module):
    """A user's model whose forward takes no packed_seq_params (an old step withheld it silently)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt, self.config = gpt, gpt.config

    def forward(self, input_ids, position_ids, labels=None):
        return self.gpt(input_ids, position_ids, None, labels=labels)


class NoPackedSeqParamsAdapter(ModelAdapter):
    takes_packed_seq_params = False

    def forward(self, model, mb):
        return model(mb.input_ids, mb.position_ids, labels=mb.labels)


class UserLM(Wrapper):
    """A user's own model class around a GPTModel (registered with its own adapter)."""

    @property
    def config(self):
        return self.module.config


class UserLMAdapter(GPTModelAdapter):
    def __init__(self, model):
        super().__init__(model.module)

    def forward(self, model, mb):
        return super().forward(model.module, mb)


# --- inputs the model does not consume --------------------------------------------------------

@case
def gpt_with_images(m):
    return loss(make_forward_step(), m["gpt"], only(media_batch(), "pixel_values", "image_grid_thw"))


@case
def gpt_with_videos(m):
    return loss(make_forward_step(), m["gpt"], only(media_batch(), "pixel_values_videos", "video_grid_thw"))


@case
def gpt_with_audio(m):
    return loss(make_forward_step(), m["gpt"], only(media_batch(), "input_features", "feature_attention_mask"))


@case
def image_vlm_with_videos(m):
    return loss(make_forward_step(), m["vlm"], only(media_batch(), "pixel_values", "image_grid_thw",
                                                    "pixel_values_videos", "video_grid_thw"))


@case
def image_vlm_with_audio(m):
    return loss(make_forward_step(), m["vlm"], only(media_batch(), "input_features", "feature_attention_mask"))


@case
def gpt_with_unknown_per_token_tensor(m):
    batch = text_batch()
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    return loss(make_forward_step(), m["gpt"], batch)


# --- models and adapters ----------------------------------------------------------------------

@case
def model_without_packed_seq_params_unregistered(m):
    return loss(make_forward_step(), NoPackedSeqParams(m["gpt"]), text_batch())


@case
def model_without_packed_seq_params_packed(m):
    return loss(make_forward_step(adapter=NoPackedSeqParamsAdapter), NoPackedSeqParams(m["gpt"]), text_batch())


@case
def unknown_model_type(m):
    return loss(make_forward_step(), Wrapper(nn.Linear(2, 2)), text_batch())


@case
def adapter_not_an_adapter(m):
    return loss(make_forward_step(adapter="gpt"), m["gpt"], text_batch())


@case
def adapter_factory_returns_wrong_type(m):
    return loss(make_forward_step(adapter=lambda model: object()), m["gpt"], text_batch())


class TokenWeightAdapter(GPTModelAdapter):
    """A user's adapter that consumes a per-token tensor: it scales each token's loss by it."""

    consumes = frozenset({"extra:token_weight"})

    def forward(self, model, mb):
        return super().forward(model, mb) * mb.extras["token_weight"].reshape(mb.labels.shape)


@case
def adapter_consuming_a_per_token_tensor_receives_it(m):
    """Declared in `consumes`, the collated batch's tensor reaches the adapter, packed and dense
    (the packer refused it as an unknown batch key: only a PackingCollator could carry extras)."""
    batch = text_batch()
    weighted = batch | {"token_weight": torch.full(batch["input_ids"].shape, 2.0)}
    plain = loss(make_forward_step(), m["gpt"], batch)
    step = make_forward_step(adapter=TokenWeightAdapter)
    packed, dense = loss(step, m["gpt"], weighted), loss(make_forward_step(pack=False, adapter=TokenWeightAdapter),
                                                         m["gpt"], weighted)
    return packed == dense and abs(packed[0] - 2 * plain[0]) < 1e-3 and packed[1] == plain[1]


@case
def wrapped_vlm_found_through_wrappers(m):
    """Through two `.module` wrappers: PackedVLM's adapter, the same loss, and its videos reach the loss."""
    from megatron_vlm_packing.models.adapter import adapter_for

    wrapped = Wrapper(Wrapper(m["media"]))
    batch = only(media_batch(), "pixel_values_videos", "video_grid_thw")
    bright = {**batch, "pixel_values_videos": batch["pixel_values_videos"] * 100}
    same = loss(make_forward_step(), wrapped, batch) == loss(make_forward_step(), m["media"], batch)
    return type(adapter_for(wrapped)).__name__, same, loss(make_forward_step(), wrapped, bright) != \
        loss(make_forward_step(), wrapped, batch)


@case
def registered_user_model_equals_gpt(m):
    register_adapter(UserLM, UserLMAdapter)
    try:
        return loss(make_forward_step(), UserLM(m["gpt"]), text_batch()) == loss(make_forward_step(), m["gpt"], text_batch())
    finally:
        unregister_adapter(UserLM)


@case
def explicit_adapter_overrides_registry(m):
    return loss(make_forward_step(adapter=GPTModelAdapter), m["gpt"], text_batch()) == \
        loss(make_forward_step(), m["gpt"], text_batch())


@case
def with_state_form_equals_plain(m):
    """Megatron-Bridge's (state, data_iterator, model) form: the same loss, audio included."""
    batch = only(media_batch(), "input_features", "feature_attention_mask")
    with torch.no_grad():
        output, reduce = make_forward_step(with_state=True)(object(), iter([batch]), m["media"])
        with_state = (round(reduce(output)[0].item(), 4), int(reduce(output)[1]))
    loud = {**batch, "input_features": batch["input_features"] * 100}
    return with_state == loss(make_forward_step(), m["media"], batch), with_state != loss(make_forward_step(), m["media"], loud)


@case
def batch_not_a_dict(m):
    return loss(make_forward_step(), m["gpt"], [text_batch()["input_ids"]])


@case
def batch_a_mapping_not_a_dict(m):
    """A Hugging Face processor's BatchFeature is a UserDict, which pack_batch and the collators take: the step
    refused it ('must yield a dict of tensors ... got UserDict')."""
    from collections import UserDict

    return loss(make_forward_step(), m["gpt"], UserDict(text_batch())) == loss(make_forward_step(), m["gpt"],
                                                                              text_batch())


@case
def batch_with_a_meta_tensor(m):
    """Was a NotImplementedError ('Cannot copy out of meta tensor') from moving the batch to the model's device."""
    batch = text_batch()
    return loss(make_forward_step(), m["gpt"], {**batch, "labels": batch["labels"].to("meta")})


@case
def data_iterator_none(m):
    """A pipeline stage given no iterator (None): was TypeError 'NoneType' object is not an iterator."""
    return make_forward_step()(None, m["gpt"])


@case
def data_iterator_a_list(m):
    """A list, not an iterator: refused (iter() each step would restart it), was a TypeError."""
    return make_forward_step()([text_batch()], m["gpt"])


@case
def data_iterator_exhausted(m):
    """An exhausted iterator: the bare StopIteration of Megatron-LM's and Megatron-Bridge's own steps
    (next(data_iterator)), kept so that a loop catching it to end an epoch works with ours too."""
    return make_forward_step()(iter([]), m["gpt"])


@case
def megatron_rerun_data_iterator_accepted(m):
    """Megatron-LM wraps iterators in RerunDataIterator, which has __next__ but no __iter__."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    step = make_forward_step()
    with torch.no_grad():
        output, reduce = step(RerunDataIterator(iter([text_batch()])), m["gpt"])
    return (round(reduce(output)[0].item(), 4), int(reduce(output)[1])) == loss(step, m["gpt"], text_batch())


class NoConfig(nn.Module):
    """A user's model that keeps its GPTModel's config elsewhere (no .config)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, *args, **kwargs):
        return self.gpt(*args, **kwargs)


@case
def model_without_config(m):
    """Was AttributeError: 'NoConfig' object has no attribute 'config'."""
    return loss(make_forward_step(adapter=lambda model: GPTModelAdapter(model.gpt)), NoConfig(m["gpt"]), text_batch())


class NoParameters(nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.config, self.call = gpt.config, gpt.__call__  # not a submodule: no parameters

    def forward(self, *args, **kwargs):
        return self.call(*args, **kwargs)


@case
def model_without_parameters(m):
    """Was a bare StopIteration out of the step (next(model.parameters()))."""
    return loss(make_forward_step(adapter=lambda model: GPTModelAdapter(m["gpt"])), NoParameters(m["gpt"]), text_batch())


@case
def transform_returns_none(m):
    """Was AttributeError: 'NoneType' object has no attribute 'inputs_present'."""
    return loss(make_forward_step(transform=lambda mb: None), m["gpt"], text_batch())


# --- micro-batches built before the step (in the DataLoader): checked against the step and layout ---

def _hf(fn, batch, **kwargs):
    return fn(batch, label_style="hf", **kwargs)


@case
def loader_packed_micro_batch_for_a_dense_step(m):
    """Was run packed although the step was made with pack=False."""
    from megatron_vlm_packing.packing import pack_batch

    return loss(make_forward_step(pack=False), m["gpt"], _hf(pack_batch, text_batch()))


@case
def loader_dense_micro_batch_for_a_packed_step(m):
    from megatron_vlm_packing.packing import pad_batch

    return loss(make_forward_step(), m["gpt"], _hf(pad_batch, text_batch()))


@case
def loader_micro_batch_shorter_than_pad_to(m):
    """pad_to=64 (fixed shapes for PP > 1) was ignored: the 13-token pack ran as it was."""
    from megatron_vlm_packing.packing.collate import PackingCollator

    return loss(make_forward_step(pad_to=64), m["gpt"], PackingCollator(label_style="hf")(text_batch()))


@case
def loader_micro_batch_with_pad_to_equals_in_step(m):
    from megatron_vlm_packing.packing.collate import PackingCollator

    step = make_forward_step(pad_to=64)
    return loss(step, m["gpt"], PackingCollator(label_style="hf", pad_to=64)(text_batch())) == \
        loss(step, m["gpt"], text_batch())


@case
def loader_dense_micro_batch_other_than_seq_length(m):
    from megatron_vlm_packing.packing import pad_batch

    return loss(make_forward_step(pack=False, seq_length=8), m["gpt"], _hf(pad_batch, text_batch()))


@case
def loader_dense_rows_that_sp_cannot_split(m):
    """Rows of 5 for TP 2 + SP: the packed path compared plans, the dense path checked nothing
    (Megatron's SP scatter then asserts)."""
    from megatron_vlm_packing.packing import pad_batch
    from megatron_vlm_packing.parallel.layout import ParallelLayout
    from megatron_vlm_packing.train.build import StepOptions

    batch = text_batch()
    batch = {k: v[:, :5] for k, v in batch.items()}
    dense = _hf(pad_batch, batch)
    return GPTModelAdapter(m["gpt"]).micro_batch_from_loader(
        dense, ParallelLayout(tp_size=2, sequence_parallel=True), StepOptions(pack=False), torch.device("cpu"))


def _negative_weight(micro_batch):
    weights = micro_batch.loss_mask.clone()
    weights[0, 2] = -1.0
    return weights


@case
def hand_built_micro_batch_with_a_negative_loss_weight(m):
    """A MicroBatch built by the user (not by a packer): its weights reached the loss unchecked."""
    from megatron_vlm_packing.packing import pack_batch
    from megatron_vlm_packing.packing.micro_batch import MicroBatch

    packed = _hf(pack_batch, text_batch())
    fields = {name: getattr(packed, name) for name in MicroBatch.__dataclass_fields__ if name != "checked_loss_mask"}
    return loss(make_forward_step(), m["gpt"], MicroBatch(**{**fields, "loss_mask": _negative_weight(packed)}))


@case
def transform_giving_a_nan_loss_weight(m):
    def nan_weight(micro_batch):
        weights = micro_batch.loss_mask.clone()
        weights[0, 3] = float("nan")
        return replace(micro_batch, loss_mask=weights)

    return loss(make_forward_step(transform=nan_weight), m["gpt"], text_batch())


# --- rotary kind ------------------------------------------------------------------------------

@case
def mrope_for_1d_gpt(m):
    batch = only(media_batch(), "image_grid_thw")
    return loss(make_forward_step(mrope=ROPE), m["gpt"], batch)


@case
def mrope_for_1d_vlm(m):
    return loss(make_forward_step(mrope=ROPE), m["vlm"], only(media_batch(), "pixel_values", "image_grid_thw"))


@case
def positions_3d_for_1d_gpt(m):
    batch = text_batch()
    batch["position_ids"] = torch.arange(6).expand(3, 3, 6).clone()
    return loss(make_forward_step(), m["gpt"], batch)


@case
def mrope_gpt_without_mrope(m):
    return loss(make_forward_step(), m["mrope_gpt"], text_batch())


@case
def mrope_vlm_uses_its_own_config(m):
    batch = only(media_batch(), "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    return loss(make_forward_step(), m["mrope_vlm"], batch) == loss(make_forward_step(mrope=ROPE), m["mrope_vlm"], batch)


@case
def mrope_vlm_positions_matter(m):
    """Different t/h/w positions give a different loss (mRoPE reaches the rotary, not 1D copies)."""
    batch = only(media_batch(), "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    shifted = replace(ROPE, spatial_merge_size=1)  # wrong grid arithmetic on purpose: h/w positions change
    try:
        other = loss(make_forward_step(mrope=shifted), m["mrope_vlm"], batch)
    except ValueError:  # tokens per block no longer match the grid: also proof that positions are computed
        return True
    return other != loss(make_forward_step(), m["mrope_vlm"], batch)


@case
def mrope_vlm_with_collated_3d_positions(m):
    """[3, B, S] positions from the collator are packed as given, and equal the model's own config's."""
    from megatron_vlm_packing.rope import get_rope_index

    batch = only(media_batch(), "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    positions = get_rope_index(batch["input_ids"], ROPE, image_grid_thw=batch["image_grid_thw"],
                               video_grid_thw=batch["video_grid_thw"], attention_mask=batch["attention_mask"]).position_ids
    return loss(make_forward_step(), m["mrope_vlm"], batch | {"position_ids": positions}) == \
        loss(make_forward_step(), m["mrope_vlm"], batch)


@case
def vlm_mrope_with_1d_lm(m):
    return PackedVLM(build_tiny_gpt(LM, scatter_embedding_sequence_parallel=False), None,
                     image_token_id=DATA.image_token_id, mrope=ROPE)


@case
def vlm_mrope_lm_without_config(m):
    cfg = replace(LM, position_embedding_type="mrope", mrope_section=ROPE.mrope_section)
    return PackedVLM(build_tiny_gpt(cfg, scatter_embedding_sequence_parallel=False), None,
                     image_token_id=DATA.image_token_id)


# --- media placement --------------------------------------------------------------------------

def _move_one_image_placeholder_to_another_sample(batch: dict) -> dict:
    """One placeholder of the first image moves to another row: the total stays, the samples' counts do not."""
    ids = batch["input_ids"].clone()
    image = DATA.image_token_id
    donor = next(r for r in range(ids.shape[0]) if bool((ids[r] == image).any()))
    target = next(r for r in range(ids.shape[0]) if r != donor)
    ids[donor, int(torch.nonzero(ids[donor] == image)[0])] = 7
    ids[target, 0] = image
    return {**batch, "input_ids": ids}


@case
def image_placeholders_moved_to_another_sample(m):
    batch = only(media_batch(), "pixel_values", "image_grid_thw")
    return loss(make_forward_step(), m["vlm"], _move_one_image_placeholder_to_another_sample(batch))


@case
def image_tokens_without_pixel_values(m):
    return loss(make_forward_step(), m["vlm"], only(media_batch()) | {"input_ids": media_batch()["input_ids"]})


@case
def image_tokens_loader_packed_with_another_image_id(m):
    """The loader counted id 261, not the model's 253: PackedVLM keeps its own check (no silencing)."""
    from megatron_vlm_packing.packing.collate import PackingCollator

    batch = only(media_batch()) | {"input_ids": media_batch()["input_ids"]}
    return loss(make_forward_step(), m["vlm"], PackingCollator(pack_options=dict(image_token_id=261))(batch))


@case
def video_grid_one_frame_short(m):
    batch = only(media_batch(), "pixel_values_videos", "video_grid_thw")
    grid = batch["video_grid_thw"].clone()
    grid[0, 0] -= 1
    frames = int(grid[0].prod())
    return loss(make_forward_step(), m["media"], {**batch, "video_grid_thw": grid,
                                                  "pixel_values_videos": batch["pixel_values_videos"][:frames]})


@case
def audio_mask_with_a_hole(m):
    batch = only(media_batch(), "input_features", "feature_attention_mask")
    mask = batch["feature_attention_mask"].clone()
    mask[0, 1] = 0
    return loss(make_forward_step(), m["media"], {**batch, "feature_attention_mask": mask})


@case
def audio_clip_shorter_than_its_placeholders(m):
    batch = only(media_batch(), "input_features", "feature_attention_mask")
    mask = batch["feature_attention_mask"].clone()
    mask[0, 4:] = 0  # 4 frames -> 1 token, fewer than the clip's placeholders
    return loss(make_forward_step(), m["media"], {**batch, "feature_attention_mask": mask})


@case
def video_content_reaches_the_loss(m):
    """A video 100x brighter changes the loss (an old step embedded video placeholders as text)."""
    batch = only(media_batch(), "pixel_values_videos", "video_grid_thw")
    bright = {**batch, "pixel_values_videos": batch["pixel_values_videos"] * 100}
    return loss(make_forward_step(), m["media"], batch) != loss(make_forward_step(), m["media"], bright)


@case
def audio_content_reaches_the_loss(m):
    batch = only(media_batch(), "input_features", "feature_attention_mask")
    loud = {**batch, "input_features": batch["input_features"] * 100}
    return loss(make_forward_step(), m["media"], batch) != loss(make_forward_step(), m["media"], loud)


@case
def all_media_packed_equals_each_sample_alone(m):
    """Images + videos + audio: the packed loss sum equals the sum of each sample alone."""
    samples = synthetic_samples(4, seed=11, cfg=DATA)
    packed = loss(make_forward_step(), m["media"], collate(samples))
    alone = [loss(make_forward_step(pack=False), m["media"], collate([s])) for s in samples]
    batch = collate(samples)
    changed = {**batch, "pixel_values_videos": batch["pixel_values_videos"] * 100, "input_features": batch["input_features"] * 100}
    media_matter = loss(make_forward_step(), m["media"], changed) != packed
    return abs(packed[0] - sum(a[0] for a in alone)) < 1e-3 and packed[1] == sum(a[1] for a in alone), media_matter


# --- packing off (pad_batch): the same checks as packing --------------------------------------

@case
def dense_left_padding(m):
    batch = text_batch()
    batch["attention_mask"] = batch["attention_mask"].flip(1)
    return loss(make_forward_step(pack=False), m["gpt"], batch)


@case
def dense_mask_with_a_hole(m):
    batch = text_batch()
    batch["attention_mask"][2, 3] = 0
    return loss(make_forward_step(pack=False), m["gpt"], batch)


@case
def dense_seq_length_shorter_than_a_row(m):
    return loss(make_forward_step(pack=False, seq_length=4), m["gpt"], text_batch())


@case
def dense_seq_lens_equal_the_attention_mask(m):
    batch = text_batch()
    by_lengths = {k: v for k, v in batch.items() if k != "attention_mask"} | {"seq_lens": torch.tensor([4, 3, 6])}
    return loss(make_forward_step(pack=False), m["gpt"], by_lengths) == loss(make_forward_step(pack=False), m["gpt"], batch)


@case
def dense_mrope_equals_packed_mrope(m):
    """Packing off gives an mRoPE model its 3D positions too (it used to get 1D ones)."""
    batch = only(media_batch(), "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    dense, packed = loss(make_forward_step(pack=False), m["mrope_vlm"], batch), loss(make_forward_step(), m["mrope_vlm"], batch)
    return abs(dense[0] - packed[0]) < 1e-3 and dense[1] == packed[1]


@case
def float_input_ids(m):
    batch = text_batch()
    return loss(make_forward_step(), m["gpt"], batch | {"input_ids": batch["input_ids"].float()})


# --- options ----------------------------------------------------------------------------------

@case
def pack_with_seq_length(m):
    return make_forward_step(pack=True, seq_length=16)


@case
def dense_with_pad_to(m):
    return make_forward_step(pack=False, pad_to=16)


@case
def bad_label_style(m):
    return make_forward_step(label_style="shifted")


def run_step_cases(rank: int, world_size: int, names: list[str] | None = None) -> dict:
    from megatron_vlm_packing.runtime import initialize_parallel

    initialize_parallel(seed=0)
    models = build_models()
    out = {}
    for name in names or list(CASES):
        try:
            value = CASES[name](models)
            out[name] = ("ok", value if isinstance(value, (bool, int, float, tuple)) else type(value).__name__)
        except Exception as err:  # reported to the test, which says which exception each case must raise
            out[name] = ("error", type(err).__name__, str(err))
    return out
