"""Small pure pieces: SwiGLU-aware TP sharding, labels handed back full length, the Bridge patches'
defect checks, idempotence and undo."""

import types

import pytest
import torch

from megatron_vlm_packing.testing.parity import tp_shard, tp_unshard


def _param(shape, dim):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.tensor_model_parallel, p.partition_dim = True, dim
    return p


@pytest.mark.parametrize("gated", [False, True])
def test_tp_shard_unshard_round_trip(gated):
    full = torch.arange(8 * 3.0).reshape(8, 3)  # gated: rows 0-3 gate, 4-7 up
    param = _param((4, 3), 0)
    parts = [tp_shard(full, param, gated=gated, tp_rank=r, tp_size=2) for r in range(2)]
    assert torch.equal(tp_unshard(parts, param, gated=gated), full)
    if gated:  # rank 0 holds the first half of gate and the first half of up
        assert parts[0][:, 0].tolist() == [0.0, 3.0, 12.0, 15.0]


def test_full_length_puts_local_values_at_the_cp_index():
    from megatron_vlm_packing.bridge.adapters import full_length
    from megatron_vlm_packing.packing.micro_batch import BatchStats, MicroBatch

    ids = torch.zeros(1, 8, dtype=torch.long)
    local = torch.tensor([[5, 6, 7, 8]])
    mb = MicroBatch(input_ids=ids, labels=local, loss_mask=local.float(), position_ids=ids, padding_mask=ids.bool(),
                    packed_seq_params=None, rope_cu_seqlens=None, stats=BatchStats(8, 8, 8),
                    cp_index=torch.tensor([0, 1, 6, 7]))
    assert full_length(local, mb, -100).tolist() == [[5, 6, -100, -100, -100, -100, 7, 8]]


class _Group:  # the two methods Bridge calls on a process group
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.bridge
def test_thd_cp_index_follows_te_rule_and_checks_the_total():
    from megatron_vlm_packing.parallel.cp import cp_partition_index
    from megatron_vlm_packing.patches.bridge_thd_cp_index import thd_cp_partition_indices

    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    for rank in range(2):
        got = thd_cp_partition_indices(cu, total_tokens=12, cp_group=_Group(2, rank), device="cpu")
        assert torch.equal(got, cp_partition_index(cu, 2, rank))
    with pytest.raises(ValueError, match="ends at 12 but the packed stream has 16"):
        thd_cp_partition_indices(cu, total_tokens=16, cp_group=_Group(2, 0), device="cpu")


def test_qwen25_cp_patch_restores_the_language_models_own_instance_forward():
    """The patch records Bridge's language-model call through an instance `forward`; one the model
    already had there (a user's or a wrapper's) must come back, and none must be left when it had none."""
    import types

    from megatron_vlm_packing.patches.bridge_qwen25_vl_cp import _bridge_call_without_lm

    def bridge_forward(self, **kwargs):  # Bridge ends in language_model.forward(...)
        return self.language_model.forward(decoder_input="x")

    own = lambda **kwargs: "own"  # noqa: E731
    for had in (True, False):
        lm = torch.nn.Identity()
        if had:
            lm.forward = own
        model = types.SimpleNamespace(language_model=lm, config=types.SimpleNamespace(sequence_parallel=True))
        assert _bridge_call_without_lm(bridge_forward, model, (), {}) == {"decoder_input": "x"}
        assert vars(lm).get("forward") is (own if had else None) and model.config.sequence_parallel


def test_bridge_adapters_refuse_a_model_of_another_family():
    """`make_forward_step(adapter=Qwen3VLAdapter)` on a model that is not Bridge's was an AttributeError
    (`vision_transformer_config`, `vision_config`, `thinker_transformer_config`)."""
    import types

    from megatron_vlm_packing.bridge.adapters import Qwen25VLAdapter, Qwen3VLAdapter
    from megatron_vlm_packing.bridge.omni_adapter import Qwen3OmniAdapter

    class NotBridge(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(sequence_parallel=False, tensor_model_parallel_size=1,
                                                context_parallel_size=1)

    wrapped = torch.nn.Module()
    wrapped.module = NotBridge()  # DDP's shape: named through the wrapper
    for adapter, family in ((Qwen3VLAdapter, "Qwen3VLModel"), (Qwen25VLAdapter, "Qwen25VLModel"),
                            (Qwen3OmniAdapter, "Qwen3OmniModel / Qwen3OmniThinkerModel")):
        with pytest.raises(ValueError, match=f"{adapter.__name__} drives Megatron-Bridge's {family}, not .*NotBridge"):
            adapter(wrapped)


@pytest.mark.bridge
def test_bridge_family_check_takes_subclasses_and_unwraps():
    from megatron_vlm_packing.bridge.adapters import QWEN3_VL_MODEL_CLASS, bridge_model_of
    from megatron_vlm_packing.bridge.imports import import_bridge_module
    from megatron_vlm_packing.patches.bridge_deepstack_sp import QWEN3_VL_MODEL

    class UsersQwen3VL(import_bridge_module(QWEN3_VL_MODEL).Qwen3VLModel):
        pass

    model = torch.nn.Module.__new__(UsersQwen3VL)  # the class is what is checked; no build needed
    torch.nn.Module.__init__(model)
    wrapper = torch.nn.Module()
    wrapper.module = model
    assert bridge_model_of(wrapper, (QWEN3_VL_MODEL_CLASS,), "Qwen3VLAdapter") is model
    # Each adapter checks for the very classes the registry resolves it for.
    from megatron_vlm_packing.bridge import adapters, omni_adapter
    from megatron_vlm_packing.models.adapter import _BUILTIN

    for name, adapter in ((adapters.QWEN3_VL_MODEL_CLASS, "Qwen3VLAdapter"),
                          (adapters.QWEN25_VL_MODEL_CLASS, "Qwen25VLAdapter"),
                          (omni_adapter.OMNI_MODEL, "Qwen3OmniAdapter"), (omni_adapter.OMNI_THINKER, "Qwen3OmniAdapter")):
        assert _BUILTIN[name].endswith(f":{adapter}")


@pytest.mark.bridge
def test_bridge_patches_detect_apply_once_and_undo():
    from megatron_vlm_packing.bridge.imports import import_bridge_module
    from megatron_vlm_packing.patches import apply_bridge_patches, undo_bridge_patches
    from megatron_vlm_packing.patches import bridge_deepstack_sp as deepstack
    from megatron_vlm_packing.patches import bridge_thd_cp_index as cp_index

    from megatron_vlm_packing.patches import bridge_qwen25_vl_cp as qwen25_cp
    from megatron_vlm_packing.patches import bridge_qwen3_vl_moe_pads as moe_pads

    model = import_bridge_module(deepstack.QWEN3_VL_MODEL)
    utils = import_bridge_module(cp_index.PACKED_SEQ_UTILS)
    qwen25 = import_bridge_module(qwen25_cp.QWEN25_VL_MODEL).Qwen25VLModel
    block = import_bridge_module(moe_pads.QWEN3_VL_BLOCK).Qwen3VLTransformerBlock
    originals = (model.split_deepstack_embs, utils.get_thd_cp_partition_indices, qwen25.forward, block.forward)
    active = {"bridge_deepstack_sp": True, "bridge_thd_cp_index": True, "bridge_qwen25_vl_cp": True,
              "bridge_qwen3_vl_moe_pads": True}
    assert moe_pads.upstream_block_drops_padding_mask()  # the 0.6.2 block takes no padding_mask
    assert deepstack.upstream_deepstack_split_is_plain_slice()  # the 0.6.2 defect is seen
    try:
        assert apply_bridge_patches() == active
        patched = (model.split_deepstack_embs, utils.get_thd_cp_partition_indices, qwen25.forward, block.forward)
        assert apply_bridge_patches() == active
        assert (model.split_deepstack_embs, utils.get_thd_cp_partition_indices, qwen25.forward,
                block.forward) == patched  # idempotent
        assert all(p is not o for p, o in zip(patched, originals))
        assert deepstack.upstream_deepstack_split_is_plain_slice()  # judged on Bridge's split, not on ours
        assert moe_pads.upstream_block_drops_padding_mask()  # judged on Bridge's forward, not on ours
        # Without SP the patched split is Bridge's own (nothing to gather).
        mask, embeds = torch.ones(1, 4, dtype=torch.bool), [torch.arange(4.0)[:, None]]
        assert model.split_deepstack_embs(mask, embeds)[1][0] is embeds[0]
    finally:
        undo_bridge_patches()
    assert (model.split_deepstack_embs, utils.get_thd_cp_partition_indices, qwen25.forward, block.forward) == originals


@pytest.mark.bridge
def test_tiny_qwen_vl_and_omni_share_one_base_config_and_language_fields():
    """Qwen-VL and Qwen3-Omni tiny models state only what differs: the same base fields reach both
    providers with the same values (sizes, layout, fp32 / CPU init, no CUDA-only fusions)."""
    import dataclasses

    from megatron_vlm_packing.bridge.build_omni import TinyOmniConfig, tiny_omni_provider
    from megatron_vlm_packing.bridge.tiny import TinyBridgeConfig, TinyModelConfig, language_fields, tiny_bridge_provider

    base = {f.name for f in dataclasses.fields(TinyModelConfig)}
    own = {cls: {f.name for f in dataclasses.fields(cls)} - base for cls in (TinyBridgeConfig, TinyOmniConfig)}
    assert own[TinyBridgeConfig] == {"family", "num_moe_experts", "moe_router_topk"}
    assert not own[TinyBridgeConfig] & own[TinyOmniConfig] and "pipeline_parallel" in base
    layout = dict(num_layers=4, tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True)
    vl, omni = TinyBridgeConfig(family="qwen3_vl", **layout), TinyOmniConfig(**layout)
    vl_provider, omni_provider = tiny_bridge_provider(vl), tiny_omni_provider(omni)
    shared = (set(language_fields(vl)) & set(language_fields(omni))) - set(vl.token_ids)  # ids: per family
    assert {"num_layers", "pipeline_model_parallel_size", "pipeline_dtype", "use_cpu_initialization"} <= shared
    for name in shared:
        assert getattr(vl_provider, name) == getattr(omni_provider, name), name
    assert omni_provider.pipeline_model_parallel_size == 2 and omni_provider.pipeline_dtype == torch.float32
    with pytest.raises(ValueError, match="mrope_section"):
        TinyOmniConfig(mrope_section=(1, 1, 1))


@pytest.mark.bridge
@pytest.mark.parametrize("tokens_per_second, expected", [(2, 2), (0.5, 0.5), (0, "finite number > 0, got 0"),
                                                          (None, "has no tokens_per_second")])
def test_qwen25_vl_rotary_reads_tokens_per_second_as_the_models_own_index(tokens_per_second, expected):
    """`qwen25_vl_mrope` takes `vision_config.tokens_per_second` as Bridge's model reads it (HF's get_rope_index,
    no default): 0 and None were read as 1.0, video time positions the model never computes."""
    from megatron_vlm_packing.bridge.adapters import qwen25_vl_mrope
    from megatron_vlm_packing.bridge.imports import import_bridge_module
    from megatron_vlm_packing.patches.bridge_qwen25_vl_cp import QWEN25_VL_MODEL

    model = torch.nn.Module.__new__(import_bridge_module(QWEN25_VL_MODEL).Qwen25VLModel)  # only its config is read
    torch.nn.Module.__init__(model)
    vision = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=tokens_per_second)
    model.config = types.SimpleNamespace(vision_config=vision, image_token_id=151655, video_token_id=151656,
                                         vision_start_token_id=151652, mrope_section=[16, 24, 24])
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            qwen25_vl_mrope(model)
    else:
        assert qwen25_vl_mrope(model).tokens_per_second == expected
