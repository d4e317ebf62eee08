"""Patches of `megatron.core.models.gpt.GPTModel.forward` for sequence parallelism (SP).

1. `apply_sp_embedding_scatter()`: a GPTModel built with `scatter_embedding_sequence_parallel=False`
   (as VLM language models are) and called standalone, without `decoder_input`, never scattered
   its embeddings under SP: every TP rank ran the full sequence and the output doubled in length
   (bug class 3). Megatron-Core fixed it in `GPTModel._preprocess` (0.19: "scatter here so a
   standalone LM forward isn't double-gathered"); the patch applies only where that fix is absent,
   and is deleted once megatron-core < 0.19 is no longer supported. It scatters the `padding_mask` with
   the embeddings, as upstream does where it embeds (the MoE router reads it per local token).
2. `apply_sp_padding_mask_scatter()`: when the caller supplies `decoder_input`, Megatron-Core
   (0.16-0.19) leaves `padding_mask` full length while the decoder sees T/tp tokens per rank, so
   the MoE router's mask no longer lines up with its tokens. The patch scatters a full-length mask,
   and leaves one that is already local alone (never scatters twice); it applies only while that
   path leaves the mask untouched (`upstream_scatters_mask_with_decoder_input`). Delete it once
   upstream scatters the mask on the decoder_input path too.

Both are explicit, idempotent and reversible; neither runs on import.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch

from megatron_vlm_packing.patches.owned import OwnedAttributes, probe_failure, signature_naming


def _gpt_model():
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel


def _source(function, *, parsed: bool = False):
    """The source of `function` (through functools.wraps), which these feature checks read; its syntax
    tree when `parsed`.

    Raises:
        RuntimeError: there is none to read (a function built at run time, a build without .py files), or
            it does not parse alone (a lambda's line).
    """
    try:
        source = textwrap.dedent(inspect.getsource(function))
        return ast.parse(source) if parsed else source
    except Exception as err:
        raise probe_failure(function, err, __name__) from err


def upstream_scatters_standalone_embeddings() -> bool:
    """Feature check: does GPTModel scatter embeddings itself when its embedding does not?

    Raises:
        RuntimeError: the source of `GPTModel.forward` / `_preprocess` cannot be read.
    """
    GPTModel = _gpt_model()
    source = "".join(_source(fn) for fn in (GPTModel.forward, getattr(GPTModel, "_preprocess", GPTModel.forward)))
    return "not self.embedding.scatter_to_sequence_parallel" in source


def upstream_scatters_mask_with_decoder_input() -> bool:
    """Feature check: does GPTModel touch `padding_mask` in the branch it takes when `decoder_input` is
    given (`if decoder_input is not None:` in `_preprocess`, or `forward` before it existed)?

    Megatron-Core 0.16-0.19 leave that branch empty of it (the mask stays full length there). A
    version that scatters or checks the mask there would see a mask this patch already scattered,
    so the patch stands down. A source without that branch (rewritten upstream) reads as the defect
    present: the patch then applies, and still leaves a mask already local alone.

    Raises:
        RuntimeError: the source of `GPTModel._preprocess` (or `forward`) cannot be read.
    """
    GPTModel = _gpt_model()
    tree = _source(getattr(GPTModel, "_preprocess", GPTModel.forward), parsed=True)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _tests_decoder_input_given(node.test):
            return any(isinstance(name, ast.Name) and name.id == "padding_mask"
                       for statement in node.body for name in ast.walk(statement))
    return False


def _tests_decoder_input_given(test: ast.expr) -> bool:
    """`decoder_input is not None`."""
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "decoder_input" \
        and [type(op) for op in test.ops] == [ast.IsNot] \
        and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None


def scatter_sequence(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """Scatter `x` along `seq_dim` over the TP group (autograd-aware, Megatron's SP region)."""
    from megatron.core import tensor_parallel

    moved = x.transpose(0, seq_dim).contiguous() if seq_dim else x
    out = tensor_parallel.scatter_to_sequence_parallel_region(moved)
    return out.transpose(0, seq_dim).contiguous() if seq_dim else out


def _bind(args, kwargs):
    return inspect.signature(_OWNED.original("forward")).bind_partial(*args, **kwargs)


_APPLIED: list[str] = []
_OWNED = OwnedAttributes(__name__)  # GPTModel.forward, shared by both fixes; .original(): the unpatched one


def _install() -> None:
    GPTModel = _gpt_model()
    if _OWNED.active():
        return
    _OWNED.restore()  # records of a patch an earlier patch's undo removed (an original is back): install again
    original = GPTModel.forward
    signature_naming(original, ("input_ids", "position_ids", "decoder_input", "padding_mask"), __name__)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = _bind((self, *args), kwargs)
        call = bound.arguments
        sp = self.config.sequence_parallel and getattr(self, "pre_process", True)
        if sp and "embedding" in _APPLIED and call.get("decoder_input") is None \
                and not self.embedding.scatter_to_sequence_parallel:
            emb = self.embedding(input_ids=call["input_ids"], position_ids=call.get("position_ids"))
            call["decoder_input"] = scatter_sequence(emb, 0)
            if call.get("padding_mask") is not None:
                # Upstream scatters the mask where it embeds (full length, as it asserts); handed decoder_input
                # it no longer does, and the MoE router got a [B, T] mask for T/tp tokens (a shape error).
                call["padding_mask"] = scatter_sequence(call["padding_mask"], 1)  # [B, T] -> [B, T/tp]
        mask = call.get("padding_mask")
        if sp and "padding_mask" in _APPLIED and mask is not None and call.get("decoder_input") is not None:
            from megatron.core import parallel_state as ps

            local = call["decoder_input"].shape[0]
            if mask.shape[1] == local * ps.get_tensor_model_parallel_world_size():
                call["padding_mask"] = scatter_sequence(mask, 1)  # [B, T] -> [B, T/tp]
        return original(*bound.args, **bound.kwargs)

    _OWNED.set(GPTModel, "forward", forward)


def _undo(fix: str) -> None:
    """Turn `fix` off; the last one off restores GPTModel.forward. A no-op when `fix` is not applied.

    Raises:
        RuntimeError: `fix` is the last one on and a later patch wraps GPTModel.forward; `fix` stays on.
    """
    if fix not in _APPLIED:
        return
    if _APPLIED == [fix]:
        _OWNED.restore()  # raises before anything changes
    _APPLIED.remove(fix)


def apply_sp_embedding_scatter() -> bool:
    """Scatter standalone-LM embeddings (and the `padding_mask` with them) under SP where Megatron-Core does
    not. Returns whether the patch is active (False where upstream already has the fix)."""
    if upstream_scatters_standalone_embeddings():
        return False
    _install()  # again too where an earlier patch's undo removed it
    if "embedding" not in _APPLIED:
        _APPLIED.append("embedding")
    return True


def undo_sp_embedding_scatter() -> None:
    _undo("embedding")


def embedding_scatter_applied() -> bool:
    """Does the embedding-scatter fix run now: switched on, and GPTModel.forward still holds our wrapper (an
    earlier patch's undo may have put its original back over ours). What `GPTModelAdapter` asks per
    micro-batch."""
    return "embedding" in _APPLIED and _OWNED.active()


def apply_sp_padding_mask_scatter() -> bool:
    """Scatter a full-length padding_mask under SP when decoder_input is given, where Megatron-Core
    does not (`upstream_scatters_mask_with_decoder_input`). Returns whether the patch is active."""
    if upstream_scatters_mask_with_decoder_input():
        return False
    _install()  # again too where an earlier patch's undo removed it
    if "padding_mask" not in _APPLIED:
        _APPLIED.append("padding_mask")
    return True


def undo_sp_padding_mask_scatter() -> None:
    _undo("padding_mask")


def padding_mask_scatter_applied() -> bool:
    """Does the padding-mask scatter fix run now (as `embedding_scatter_applied`)."""
    return "padding_mask" in _APPLIED and _OWNED.active()
