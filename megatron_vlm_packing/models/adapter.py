"""Model adapters: how each model type takes a `MicroBatch`, declared, never sniffed from a signature.

An adapter says which optional inputs the model consumes ("images", "videos", "audio",
"image_tiles", "extra:<key>"), which sequence-aligned fields it needs full length under CP
(`LocalizeNeeds`), whether it takes `packed_seq_params`, and how to call it. The forward step refuses, with a
`ValueError` naming the input, anything the micro-batch carries that the adapter does not consume
(bug class 10: inputs silently dropped between the step and the model).

The registry finds an adapter by the model's class (its MRO, by qualified name, so that models of
packages that are not installed cost nothing), looking through DDP / Float16Module wrappers.
Registering your own model (a few lines):

    from megatron_vlm_packing.models.adapter import ModelAdapter, register_adapter

    class MyVLMAdapter(ModelAdapter):
        consumes = frozenset({"images"})
        needs = LocalizeNeeds(full_input_ids=True)
        def forward(self, model, mb):  # tensors by keyword: Float16Module casts float32 positional inputs
            return model(mb.input_ids, position_ids=mb.position_ids, labels=mb.labels, cp_index=mb.cp_index,
                         packed_seq_params=mb.packed_seq_params, pixel_values=mb.vision.pixel_values)

    register_adapter(MyVLM, MyVLMAdapter)
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from megatron_vlm_packing.packing.localize import LocalizeNeeds
from megatron_vlm_packing.packing.micro_batch import MicroBatch


class ModelAdapter:
    """How one model type takes a micro-batch. Subclass, set the class attributes, write `forward`.

    Class attributes:
        consumes: optional inputs the model takes ("images", "videos", "audio", "image_tiles",
            "extra:<key>"; `MicroBatch.inputs_present`).
        needs: which fields stay full length under CP.
        takes_packed_seq_params: False for a model that can only run dense rows.

    `vocab_size` (set by `__init__` from the model, `model_vocab_size`; None: unknown) is what the step
    packs with: ids and labels outside [0, vocab_size) are a ValueError in the packer's read.
    `unembedded_token_id` (None: every id is embedded) is an id the model replaces before its embedding
    (LLaVA's image token, which may lie outside the vocabulary): the step's checks of ids against the vocabulary
    (`train.loader_vocab.check_loader_vocab`, `check_unpacked_ids`) skip it, as the model's own packer does.
    `checks_unpacked_ids` (False) says that `check` refuses ids no packer checked outside [0, vocab_size)
    (`check_unpacked_ids`): the step then reads them in its one read of what no packer checked
    (`train.unpacked_checks.check_unpacked_fields`), so `check` reads nothing for clean ids, and checks them itself
    after `check` if `check` did not.
    `pipeline_length` (None: the micro-batch's own) is the sequence length a model pads every micro-batch to
    under pipeline parallelism whatever the step packs (LLaVA's `language_max_sequence_length`): the length
    Megatron's schedule must receive (`train.pipeline_shapes`).

    An adapter is built once per model (`adapter_for(model)`), so `__init__` may read the model's
    config (e.g. to check an mRoPE setting) and raise a ValueError for a model it cannot drive.
    """

    consumes: frozenset[str] = frozenset()
    needs: LocalizeNeeds = LocalizeNeeds()
    takes_packed_seq_params: bool = True
    vocab_size: int | None = None
    unembedded_token_id: int | None = None
    checks_unpacked_ids: bool = False
    pipeline_length: int | None = None

    def __init__(self, model: nn.Module):
        self.model_name = type(model).__name__
        self.vocab_size = model_vocab_size(model)

    def check(self, micro_batch: MicroBatch) -> None:
        """Refuse what this model cannot take: a ValueError naming every unconsumed input."""
        unconsumed = sorted(micro_batch.inputs_present() - self.consumes)
        if unconsumed:
            raise ValueError(
                f"the micro-batch carries {unconsumed} but {self.model_name}'s adapter "
                f"({type(self).__name__}) consumes only {sorted(self.consumes) or 'no optional inputs'}: "
                f"it would be dropped silently; remove it from the batch or use an adapter that consumes it "
                f"({'; '.join(micro_batch.describe_input(name) for name in unconsumed)})"
            )
        refuse_vision_fields_without_media(micro_batch)
        if micro_batch.is_packed and not self.takes_packed_seq_params:
            raise ValueError(
                f"{self.model_name} cannot take packed_seq_params ({type(self).__name__}), so a packed "
                f"micro-batch would train as one causal document; use pack=False or a model that takes it"
            )

    def collated_batch(self, batch, options):
        """The collated batch in this package's format, before it moves to the device: where an adapter reads a
        format of its own (LLaVA: Megatron-LM examples/multimodal's). The default takes the batch as it is.

        Raises:
            ValueError: `make_forward_step(megatron_lm_pad_id=...)` for a model whose adapter reads no
                Megatron-LM examples/multimodal batches (it would be ignored).
        """
        if options.megatron_lm_pad_id is not None:
            raise ValueError(f"megatron_lm_pad_id={options.megatron_lm_pad_id} reads Megatron-LM examples/multimodal "
                             f"LLaVA batches, which {type(self).__name__} ({self.model_name}) does not take: drop it")
        return batch

    def build_micro_batch(self, batch: dict, layout, options) -> MicroBatch | None:
        """A model-specific micro-batch from a collated batch (LLaVA plans in its expanded space);
        None (the default) lets the step use `pack_batch` / `pad_batch`."""
        return None

    def micro_batch_from_loader(self, micro_batch: MicroBatch, layout, options, device) -> MicroBatch:
        """A micro-batch packed in the DataLoader (`packing.collate.PackingCollator`), checked for the
        layout (its plan's multiples) and moved to `device` without a host sync; adapters that plan in
        a space of their own (LLaVA) check their own plan instead."""
        from megatron_vlm_packing.packing.collate import micro_batch_from_loader
        from megatron_vlm_packing.packing.plan import PackMultiples

        multiples = PackMultiples.for_parallel(tp_size=layout.tp_size, cp_size=layout.cp_size,
                                               sequence_parallel=layout.sequence_parallel, fp8=options.fp8)
        check_loader_shape(micro_batch, multiples, options)
        return micro_batch_from_loader(micro_batch, multiples=multiples, device=device)

    def forward(self, model: nn.Module, micro_batch: MicroBatch):
        """Call `model` (possibly wrapped) on a localized micro-batch; return its output."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(model, micro_batch)")


def refuse_vision_fields_without_media(micro_batch: MicroBatch) -> None:
    """Grids, per-sample counts, tiles or seconds of images (videos) no pixels of which the micro-batch carries
    (`VisionInputs.fields_without_media`) are read by no model: before, every adapter passed the pixels alone
    (or nothing) and such fields were dropped silently. Only a micro-batch built or edited by hand carries them:
    the packers keep none (a micro-batch whose media they checked, `media_checked_by_packer`, is not looked at:
    the grids an mRoPE index read alone beside another kind's pixels are kept there for `validate`). Reads no
    tensor value.

    Raises:
        ValueError: naming each field and the items it describes.
    """
    vision = micro_batch.vision
    if vision is None or micro_batch.media_checked_by_packer:
        return
    found = vision.fields_without_media()
    if found:
        raise ValueError(f"{'; '.join(found)}: nothing reads them without those pixels, so they would be dropped "
                         f"silently; drop them from the micro-batch (an mRoPE index reads grids alone before the "
                         f"micro-batch is built, as pack_batch(mrope=) does)")


def check_loader_shape(micro_batch: MicroBatch, multiples, options) -> None:
    """A micro-batch built before the step must be what the step's options ask for and divide for the
    layout; these read shapes only (no host sync).

    `check_layout` compares a packed micro-batch's plan; a dense one (`pad_batch`) or one without a
    plan was not checked, so a row length the layout cannot split reached Megatron (an assertion in
    its SP scatter), and `pack=`, `pad_to=` and `seq_length=` were ignored silently (a pack of the
    wrong length under PP > 1, whose shapes are fixed).

    Raises:
        ValueError: packed vs dense differs from `options.pack`, the length is not `pad_to` /
            `seq_length`, or not a multiple of the layout's total multiple (naming the numbers).
    """
    check_loader_kind(micro_batch, options)
    kind = "packed" if micro_batch.is_packed else "dense"
    length = micro_batch.input_ids.shape[-1]
    wanted = options.pad_to if micro_batch.is_packed else options.seq_length
    if wanted is not None and length != wanted:
        name = "pad_to" if micro_batch.is_packed else "seq_length"
        raise ValueError(f"the {kind} micro-batch from the data iterator has length {length} but the step was made "
                         f"with {name}={wanted}: build it with {name}={wanted} too")
    if length % multiples.total:
        raise ValueError(f"the {kind} micro-batch from the data iterator has length {length}, not a multiple of "
                         f"{multiples.total} that the model's layout needs ({multiples}): build it with the model's "
                         f"tp_size, cp_size, sequence_parallel and fp8")


def check_loader_kind(micro_batch: MicroBatch, options) -> None:
    """A micro-batch built before the step is packed exactly when the step's `options.pack` says so.

    Raises:
        ValueError: naming both.
    """
    if micro_batch.is_packed != options.pack:
        kind = "packed" if micro_batch.is_packed else "dense"
        raise ValueError(f"the data iterator yielded a {kind} micro-batch but the step was made with "
                         f"pack={options.pack}: make_forward_step(pack={micro_batch.is_packed}) or build it the other way")


def check_loader_mrope(micro_batch: MicroBatch, mrope, source: str) -> None:
    """A micro-batch packed before the step (a `PackingCollator`, `pack_batch` / `pad_batch` by hand) whose
    mRoPE positions an `MRopeConfig` made (`micro_batch.mrope_config`) must have been made with the
    model's config `mrope` (what `train.build.resolve_mrope` gives): else every image and video token
    trains at positions the model never computes, silently. Only the fields that make positions are
    compared (`rope.config.position_differences`: not `mrope_section` / `mrope_interleaved`, which lay
    out the model's rotary from its own config). Nothing is compared when the micro-batch records no
    config (positions given in the batch or made by a callable) or `mrope` is no `MRopeConfig` (a
    callable, or None: a model that takes positions as given). Reads no tensor value.

    Raises:
        ValueError: naming each differing field with both values, and `source` (where the model's
            config came from).
    """
    from megatron_vlm_packing.rope import MRopeConfig
    from megatron_vlm_packing.rope.config import position_differences

    made_with = micro_batch.mrope_config
    if made_with is None or not isinstance(mrope, MRopeConfig) or micro_batch.position_ids.dim() != 3:
        return
    differences = position_differences(made_with, mrope)
    if differences:
        named = ", ".join(f"{name}={made!r} where the model's is {wanted!r}" for name, made, wanted in differences)
        raise ValueError(f"the micro-batch from the data iterator has mRoPE positions made with another MRopeConfig "
                         f"than the model's ({source}): {named}; build the PackingCollator (or pack_batch / "
                         f"pad_batch) with mrope= the model's MRopeConfig")


def check_unpacked_ids(micro_batch: MicroBatch, vocab_size: int | None, *,
                       unembedded_token_id: int | None = None) -> None:
    """Input ids no packer checked (not the ids of `MicroBatch.checked_media` / `checked_ids`: a transform's, a
    `replace`) must be an integer tensor of ids in [0, vocab_size) (>= 0 when the vocabulary is unknown) at every
    slot but those holding `unembedded_token_id` (an id the model replaces before its embedding: LLaVA's image
    token, -200 by default). Else a negative or too large id was an IndexError inside the embedding at TP=1, and at
    TP > 1 a zero embedding (the vocab-parallel embedding masks it on every rank), silently. Packed ids: no sync; ids
    an adapter that `checks_unpacked_ids` declares were read in the step's one read (`MicroBatch.ids_checked`): no
    sync either, unless they are bad (then read again here, to be named in the adapter's order).

    Raises:
        ValueError: ids that are no integer tensor, or naming the first bad slot and its value. One host sync.
    """
    if micro_batch.ids_checked(vocab_size, unembedded_token_id):  # the packer's, or the step's one read
        return
    ids = micro_batch.input_ids
    from megatron_vlm_packing.packing.checks import check_ids, integer_token_rows

    rows = integer_token_rows(ids, "input_ids")
    embedded = torch.ones_like(rows, dtype=torch.bool) if unembedded_token_id is None else rows != unembedded_token_id
    check_ids(rows, embedded, vocab_size, "input_ids")


def model_vocab_size(model: nn.Module) -> int | None:
    """The (padded) vocabulary of `model`'s embedding: Megatron's GPTModel `.vocab_size`, else its
    `.language_model`'s (PackedVLM, LLaVA, Megatron-Bridge's VLMs), through wrappers; None when neither
    has a positive int. Without it a label >= the vocabulary reached the vocab-parallel cross entropy,
    which masks such a target (its loss silently became the log-sum-exp of the logits)."""
    from megatron_vlm_packing.packing.bounds import is_int

    inner = unwrap_model(model)
    for holder in (inner, getattr(inner, "language_model", None)):
        size = getattr(holder, "vocab_size", None)
        if is_int(size) and size > 0:
            return int(size)
    return None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / Float16Module / similar wrappers (each holds it as `.module`)."""
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
        seen += 1
        if seen > 16:
            raise ValueError("model wrappers nest more than 16 deep through .module")
    return model


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


AdapterFactory = Callable[[nn.Module], ModelAdapter]

# Built-in adapters, by the qualified name of the model class; resolved on first use so that no
# optional package (megatron.bridge, multimodal models) is imported unless its model is passed in.
_BUILTIN: dict[str, str] = {}
_REGISTERED: dict[str, AdapterFactory] = {}


def register_builtin_adapter(model_qualified_name: str, factory_path: str) -> None:
    """For this package's own adapters: `factory_path` is "module:attribute", imported lazily."""
    _BUILTIN[model_qualified_name] = factory_path


def register_adapter(model_type: type | str, factory: AdapterFactory) -> None:
    """Make `adapter_for` use `factory(model)` for `model_type` and its subclasses.

    Args:
        model_type: the model class, or its qualified name ("package.module.ClassName").
        factory: a `ModelAdapter` subclass or any callable `model -> ModelAdapter`.
    Overrides a built-in adapter for the same class.
    """
    name = _registry_name(model_type)
    if not callable(factory):
        raise ValueError(f"factory for {name} must be callable (a ModelAdapter subclass), got {factory!r}")
    if isinstance(factory, type) and not issubclass(factory, ModelAdapter):  # int: a TypeError in adapter_for
        raise ValueError(f"factory for {name} is the class {factory.__qualname__}, not a ModelAdapter subclass")
    _REGISTERED[name] = factory


def unregister_adapter(model_type: type | str) -> None:
    _REGISTERED.pop(_registry_name(model_type), None)


def _registry_name(model_type) -> str:
    """The qualified name a model class is registered under. A model instance was an AttributeError
    (__qualname__); "" or "ClassName" (no module) never matched a model's qualified name."""
    if isinstance(model_type, type):
        return qualified_name(model_type)
    if isinstance(model_type, str) and "." in model_type and model_type.strip() and not any(
            c.isspace() for c in model_type):
        return model_type
    raise ValueError(f"model_type must be a model class or its qualified name (\"package.module.ClassName\"), got "
                     f"{type(model_type).__name__} {model_type!r:.80}: register_adapter(type(model), ...)")


def _resolve(path: str) -> AdapterFactory:
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter of `model`'s class (or its nearest registered base class), built for this model.

    Raises:
        ValueError: no adapter is registered for any class in the model's MRO.
    """
    inner = unwrap_model(model)
    for cls in type(inner).__mro__:
        name = qualified_name(cls)
        if name in _REGISTERED:
            adapter = _REGISTERED[name](inner)
            if not isinstance(adapter, ModelAdapter):  # else handed back as "the adapter" and failing later
                raise ValueError(f"the adapter factory for {name} returned {type(adapter).__name__} {adapter!r:.80}, "
                                 f"not a ModelAdapter")
            return adapter
        if name in _BUILTIN:
            return _resolve(_BUILTIN[name])(inner)
    known = sorted(set(_REGISTERED) | set(_BUILTIN))
    raise ValueError(
        f"no model adapter for {qualified_name(type(inner))}; registered: {known}. Register one with "
        f"megatron_vlm_packing.models.adapter.register_adapter(YourModel, YourAdapter) "
        f"or pass make_forward_step(adapter=...)"
    )


register_builtin_adapter("megatron.core.models.gpt.gpt_model.GPTModel",
                         "megatron_vlm_packing.models.gpt_adapter:GPTModelAdapter")
register_builtin_adapter("megatron_vlm_packing.models.packed_vlm.PackedVLM",
                         "megatron_vlm_packing.models.packed_vlm:PackedVLMAdapter")
# Megatron-Bridge's Qwen-VL models (megatron_vlm_packing.bridge.adapters), resolved lazily.
register_builtin_adapter("megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model.Qwen3VLModel",
                         "megatron_vlm_packing.bridge.adapters:Qwen3VLAdapter")
register_builtin_adapter("megatron.bridge.models.qwen_vl.modeling_qwen25_vl.Qwen25VLModel",
                         "megatron_vlm_packing.bridge.adapters:Qwen25VLAdapter")
register_builtin_adapter("megatron.core.models.multimodal.llava_model.LLaVAModel", "megatron_vlm_packing.models.llava:LLaVAAdapter")
# Megatron-Bridge's Qwen3-Omni model and thinker (megatron_vlm_packing.bridge.omni_adapter), resolved lazily.
register_builtin_adapter("megatron.bridge.models.qwen_omni.modeling_qwen3_omni.model.Qwen3OmniModel",
                         "megatron_vlm_packing.bridge.omni_adapter:Qwen3OmniAdapter")
register_builtin_adapter("megatron.bridge.models.qwen_omni.modeling_qwen3_omni.thinker_model.Qwen3OmniThinkerModel",
                         "megatron_vlm_packing.bridge.omni_adapter:Qwen3OmniAdapter")
