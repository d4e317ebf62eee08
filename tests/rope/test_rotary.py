import pytest
import torch

from megatron_vlm_packing.rope import PackedMultimodalRotaryEmbedding, mrope_frequencies, use_packed_mrope
from megatron_vlm_packing.testing import apply_cpu_shims, cpu_shims_applied, undo_cpu_shims


@pytest.fixture
def shims():
    applied_here = not cpu_shims_applied()
    apply_cpu_shims()
    yield
    if applied_here:
        undo_cpu_shims()


def test_contiguous_sections_equal_megatron_core(shims):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    megatron = MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    positions = torch.randint(0, 50, (3, 2, 7))
    expected = megatron(positions, [2, 3, 3])
    assert torch.equal(mrope_frequencies(positions, megatron.inv_freq, [2, 3, 3]), expected)


def test_interleaved_sections_equal_hf_qwen3():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    positions = torch.randint(0, 50, (3, 2, 7))
    freqs = positions.float()[..., None] * inv_freq  # [3, B, S, F]
    owner = type("Owner", (), {"mrope_section": [3, 3, 2]})()
    # transformers applies the layout to cos/sin; on the angles themselves it is the same selection.
    expected = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(owner, freqs.clone())  # [B, S, 2F]
    ours = mrope_frequencies(positions, inv_freq, [3, 3, 2], interleaved=True)  # [S, B, 1, 2F]
    assert torch.equal(ours[:, :, 0].transpose(0, 1), expected)


def test_sections_must_cover_the_frequencies():
    with pytest.raises(ValueError, match=r"must sum to 8 rotary frequencies"):
        mrope_frequencies(torch.zeros(3, 1, 2), torch.ones(8), [2, 2, 2])


def test_thd_mode_returns_the_full_table_and_dense_mode_slices_for_cp():
    class FakeGroup:
        def size(self):
            return 2

        def rank(self):
            return 1

    rotary = PackedMultimodalRotaryEmbedding(torch.ones(2), cp_group=FakeGroup())
    positions = torch.arange(8).expand(3, 1, 8)
    rotary.is_thd_format = True
    assert rotary(positions, [1, 1, 0]).shape[0] == 8
    rotary.is_thd_format = False
    dense = rotary(positions, [1, 1, 0])
    assert dense[:, 0, 0, 0].tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4 (the zigzag)


class TinyMropeModel(torch.nn.Module):
    """Just enough of GPTModel's interface to exercise the per-call hooks."""

    position_embedding_type = "mrope"

    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"apply_rope_fusion": False})()
        self.rotary_pos_emb = type("R", (torch.nn.Module,), {"inv_freq": torch.ones(2)})()
        self.seen = []

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None, fail=False):
        self.seen.append(self.rotary_pos_emb.is_thd_format)
        if fail:
            raise RuntimeError("boom")


def test_mode_is_set_per_call_and_restored_even_after_an_exception():
    from megatron.core.packed_seq_params import PackedSeqParams

    model = TinyMropeModel()
    handle = use_packed_mrope(model)
    assert use_packed_mrope(model) is handle  # idempotent
    thd = PackedSeqParams(qkv_format="thd")
    model(None, None, None, packed_seq_params=thd)
    model(None, None, None)
    with pytest.raises(RuntimeError, match="boom"):
        model(None, None, None, packed_seq_params=thd, fail=True)
    model(None, None, None)
    model(None, None, None, None, None, None, thd)  # positional packed_seq_params
    assert model.seen == [True, False, True, False, True]
    assert model.rotary_pos_emb.is_thd_format is False
    original = handle.original
    handle.undo()
    assert model.rotary_pos_emb is original


def test_refuses_models_it_cannot_serve():
    model = TinyMropeModel()
    model.config.apply_rope_fusion = True
    with pytest.raises(ValueError, match="fused rope cannot take 3D mRoPE positions"):
        use_packed_mrope(model)
    model.position_embedding_type = "rope"
    with pytest.raises(ValueError, match="needs position_embedding_type='mrope'"):
        use_packed_mrope(model)


def test_seq_len_interpolation_factor_is_kept(shims):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    megatron = MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0, seq_len_interpolation_factor=3.0)
    positions = torch.randint(0, 50, (3, 2, 7))
    ours = PackedMultimodalRotaryEmbedding(megatron.inv_freq, seq_len_interpolation_factor=3.0)
    assert torch.equal(ours(positions, [2, 3, 3]), megatron(positions, [2, 3, 3]))
    assert not torch.equal(ours(positions, [2, 3, 3]), mrope_frequencies(positions, megatron.inv_freq, [2, 3, 3]))


def test_refuses_interleaved_rotary_halves():
    model = TinyMropeModel()
    model.config.rotary_interleaved = True
    with pytest.raises(ValueError, match="rotary_interleaved=True is not supported with mRoPE"):
        use_packed_mrope(model)


def test_positions_broadcast_from_1d_change_the_rotary_of_image_tokens_only():
    """Bug class 1: three copies of a 1D position are not the t/h/w position of an image token."""
    from megatron_vlm_packing.rope import MRopeConfig, get_rope_index

    cfg = MRopeConfig(family="qwen2_vl")
    ids = torch.tensor([[5, 6, 151652] + [151655] * 6 + [151653, 7, 8]])  # one 2x3 merged image
    true_3d = get_rope_index(ids, cfg, image_grid_thw=torch.tensor([[1, 4, 6]])).position_ids
    broadcast = torch.arange(ids.shape[1]).expand(3, 1, -1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    ours = mrope_frequencies(true_3d, inv_freq, [2, 1, 1])[:, 0, 0]  # [S, D]
    wrong = mrope_frequencies(broadcast, inv_freq, [2, 1, 1])[:, 0, 0]
    differs = (ours != wrong).any(-1)
    assert differs[4:9].all()  # every image token but the first (t = h = w = 3 there, as in 1D)
    assert not differs[:4].any()  # text before the image: 1D and 3D agree
    assert differs[9:].all()  # text after the image resumes at 3 + max(2, 3), not at 9
    text_only = torch.tensor([[5, 6, 7]])
    assert torch.equal(get_rope_index(text_only, cfg).position_ids, torch.arange(3).expand(3, 1, -1))


@pytest.mark.parametrize("interleaved, section", [(False, [2, 3, 3]), (True, [3, 3, 2]), (True, [4, 2, 2])])
def test_sections_against_the_formula_frequency_by_frequency(interleaved, section):
    """Frequency i uses axis a(i): contiguous -> the block of `section` that holds i; interleaved ->
    i % 3 while that axis still has sections (i < 3 * section[i % 3]), else t."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    positions = torch.randint(0, 99, (3, 2, 5))
    bounds = torch.cumsum(torch.tensor(section), 0).tolist()
    ours = mrope_frequencies(positions, inv_freq, section, interleaved=interleaved)  # [S, B, 1, 16]
    for i in range(8):
        if interleaved:
            axis = i % 3 if i % 3 and i < 3 * section[i % 3] else 0
        else:
            axis = next(a for a, bound in enumerate(bounds) if i < bound)
        expected = positions[axis].float() * inv_freq[i]  # [B, S]
        assert torch.equal(ours[:, :, 0, i], expected.T) and torch.equal(ours[:, :, 0, 8 + i], expected.T)
