import itertools

import pytest
import torch

from megatron_vlm_packing.patches.thd_rotary import apply_thd_rotary, thd_rotary_applied, undo_thd_rotary
from megatron_vlm_packing.rope import PackedMultimodalRotaryEmbedding, mrope_frequencies, use_packed_mrope
from megatron_vlm_packing.rope.megatron_thd import CpLocalFreqs, _RankOf, thd_rope_host_syncs
from megatron_vlm_packing.testing import apply_cpu_shims, cpu_shims_applied, undo_cpu_shims


@pytest.fixture(autouse=True)
def thd_patch_left_as_found():
    """use_packed_mrope applies patches.thd_rotary process-wide: undo it after each test that did."""
    was_on = thd_rotary_applied()
    yield
    if not was_on:
        undo_thd_rotary()


def upstream_thd():
    """Megatron-Core's own `_apply_rotary_pos_emb_thd`, whether or not the patch is on."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron_vlm_packing.patches import thd_rotary

    return thd_rotary._OWNED.original("_apply_rotary_pos_emb_thd") or rope_utils._apply_rotary_pos_emb_thd


def random_pack(cp: int, generator: torch.Generator):
    """Boundaries of 5 documents, each a multiple of 2*cp (as pack plans make them)."""
    lengths = [2 * cp * int(n) for n in torch.randint(1, 6, (5,), generator=generator)]
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32), max(lengths)


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
    if hasattr(Qwen3VLTextRotaryEmbedding, "recomposition_frequencies"):  # newer transformers (5.24.0)
        expected = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(owner, freqs.clone())  # [B, S, 2F]
    else:  # 5.12.1 and before (Megatron-Bridge 0.6.2's range): the same layout, before the halves are joined
        half = Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope(owner, freqs.clone(), owner.mrope_section)  # [B, S, F]
        expected = torch.cat((half, half), dim=-1)
    ours = mrope_frequencies(positions, inv_freq, [3, 3, 2], interleaved=True)  # [S, B, 1, 2F]
    assert torch.equal(ours[:, :, 0].transpose(0, 1), expected)


def test_sections_must_cover_the_frequencies():
    with pytest.raises(ValueError, match=r"that sum to 8 rotary frequencies"):
        mrope_frequencies(torch.zeros(3, 1, 2), torch.ones(8), [2, 2, 2])


def test_thd_mode_returns_this_ranks_table_and_dense_mode_slices_for_cp():
    from megatron.core.packed_seq_params import PackedSeqParams

    rotary = PackedMultimodalRotaryEmbedding(torch.ones(2), cp_group=_RankOf(2, 1))
    positions = torch.arange(12).expand(3, 1, 12)
    rotary.is_thd_format = True
    rotary.thd_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, 4, 12]))
    undo_thd_rotary()
    assert rotary(positions, [1, 1, 0]).shape[0] == 12  # upstream's THD rope picks the rows itself
    apply_thd_rotary()
    local = rotary(positions, [1, 1, 0])  # this rank's rows, once: documents [0, 4) and [4, 12) zigzagged
    assert isinstance(local, CpLocalFreqs) and local[:, 0, 0, 0].tolist() == [1.0, 2.0, 6.0, 7.0, 8.0, 9.0]
    rotary.is_thd_format, rotary.thd_params = False, None
    dense = rotary(positions[..., :8], [1, 1, 0])
    assert dense[:, 0, 0, 0].tolist() == [2.0, 3.0, 4.0, 5.0]  # chunks 1 and 2 of 4 (the zigzag)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("rotary_interleaved", [False, True])
def test_loop_free_thd_rope_equals_megatron_core_bit_for_bit(cp_size, rotary_interleaved):
    """Every table Megatron-Core's THD rope takes: 1D rope's [max_seqlen] (and longer), and a
    whole-pack [T] table; every CP rank."""
    from megatron.core.models.common.embeddings import rope_utils

    upstream = upstream_thd()
    apply_thd_rotary()
    ours = rope_utils._apply_rotary_pos_emb_thd
    generator = torch.Generator().manual_seed(cp_size)
    cu, longest = random_pack(cp_size, generator)
    total = int(cu[-1])
    for table_rows in (longest, longest + 5, total):
        freqs = torch.randn(table_rows, 1, 1, 8, generator=generator)
        for rank in range(cp_size):
            tokens = torch.randn(total // cp_size, 3, 10, generator=generator)  # [Tl, H, D], D > rotary dim
            kwargs = dict(rotary_interleaved=rotary_interleaved, cp_group=_RankOf(cp_size, rank))
            assert torch.equal(ours(tokens, cu, freqs, **kwargs), upstream(tokens, cu, freqs, **kwargs))


@pytest.mark.parametrize("cp_size", [1, 2])
@pytest.mark.parametrize("interleaved, section", [(False, [1, 1, 2]), (True, [2, 1, 1])])
def test_cp_local_mrope_table_equals_megatron_cores_whole_pack_path(cp_size, interleaved, section):
    """Ours: this rank's table gathered once, applied as one op. Megatron-Core: the whole-pack
    table, each document's rows picked per layer. Same rotated queries."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.packed_seq_params import PackedSeqParams

    upstream = upstream_thd()
    apply_thd_rotary()
    generator = torch.Generator().manual_seed(7)
    cu, _ = random_pack(cp_size, generator)
    positions = torch.randint(0, 40, (3, 1, int(cu[-1])), generator=generator)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    whole = mrope_frequencies(positions, inv_freq, section, interleaved=interleaved)  # [T, 1, 1, 8]
    for rank in range(cp_size):
        rotary = PackedMultimodalRotaryEmbedding(inv_freq, interleaved=interleaved, cp_group=_RankOf(cp_size, rank))
        rotary.is_thd_format = True
        rotary.thd_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=cu)
        local = rotary(positions, section)
        tokens = torch.randn(int(cu[-1]) // cp_size, 2, 8, generator=generator)
        expected = upstream(tokens, cu, whole, cp_group=_RankOf(cp_size, rank))
        got = rope_utils._apply_rotary_pos_emb_thd(tokens, cu, local, cp_group=_RankOf(cp_size, rank))
        assert torch.equal(got, expected)


def test_thd_patch_detects_the_loop_is_idempotent_and_undone():
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_vlm_packing.patches.thd_rotary import upstream_thd_rope_syncs

    undo_thd_rotary()
    upstream = rope_utils._apply_rotary_pos_emb_thd
    assert thd_rope_host_syncs() >= 3  # .tolist(), then per document (3 here): the defect the patch detects
    assert apply_thd_rotary() and apply_thd_rotary()
    patched = rope_utils._apply_rotary_pos_emb_thd
    assert patched is not upstream and thd_rope_host_syncs() == 0
    assert upstream_thd_rope_syncs() >= 3  # still counted on the original while patched
    undo_thd_rotary()
    assert rope_utils._apply_rotary_pos_emb_thd is upstream and not thd_rotary_applied()


def test_the_cp_local_mark_survives_recompute_and_a_wrong_length_fails_loudly():
    from megatron.core.models.common.embeddings import rope_utils

    table = CpLocalFreqs.mark(torch.zeros(6, 1, 1, 4))
    assert isinstance(table.detach(), CpLocalFreqs)  # activation recompute detaches its inputs
    apply_thd_rotary()
    with pytest.raises(ValueError, match="6 rows but this rank rotates 12 tokens"):
        rope_utils._apply_rotary_pos_emb_thd(torch.ones(12, 1, 4), torch.tensor([0, 24]), table,
                                             cp_group=_RankOf(2, 0))


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


class ForeignRotaryWrapper(torch.nn.Module):
    """Another plugin's wrapper, installed on `model.rotary_pos_emb` after ours; it calls ours."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):  # the wrapped rotary's attributes (is_thd_format) show through
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def test_undo_refuses_while_a_later_wrapper_holds_the_rotary_and_lifo_undo_restores_exactly():
    from megatron.core.packed_seq_params import PackedSeqParams

    model = TinyMropeModel()
    original = model.rotary_pos_emb
    handle = use_packed_mrope(model)
    ours = model.rotary_pos_emb
    model.rotary_pos_emb = ForeignRotaryWrapper(ours)
    with pytest.raises(RuntimeError, match=r"rotary_pos_emb now holds a tests\.rope\.test_rotary\.ForeignRotaryWrapper"
                                           r".*undo that later patch first.*Nothing was undone"):
        handle.undo()
    # nothing changed: the wrapper still holds ours, our hooks still set the mode per call
    assert isinstance(model.rotary_pos_emb, ForeignRotaryWrapper) and model.rotary_pos_emb.inner is ours
    assert handle.active and use_packed_mrope(model) is handle
    model(None, None, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    model(None, None, None)
    assert model.seen == [True, False] and ours.is_thd_format is False
    model.rotary_pos_emb = ours  # the later plugin undoes first (LIFO) ...
    handle.undo()  # ... then ours restores exactly what the model had
    assert model.rotary_pos_emb is original and "_packed_mrope_handle" not in vars(model)
    assert not model._forward_pre_hooks and not model._forward_hooks and not handle.active
    handle.undo()  # a no-op once undone
    assert model.rotary_pos_emb is original
    again = use_packed_mrope(model)  # and it can be applied afresh
    assert again is not handle and isinstance(model.rotary_pos_emb, PackedMultimodalRotaryEmbedding)
    again.undo()
    assert model.rotary_pos_emb is original


def test_applying_twice_returns_the_handle_and_refuses_another_layout():
    model = TinyMropeModel()
    handle = use_packed_mrope(model, interleaved=True)
    assert use_packed_mrope(model, interleaved=True) is handle
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1  # hooks installed once
    with pytest.raises(ValueError, match=r"already applied .* with interleaved=True, now asked for interleaved=False"):
        use_packed_mrope(model)
    assert model.rotary_pos_emb.interleaved is True
    handle.undo()


@pytest.mark.parametrize("interleaved", ["no", 1, None])
def test_an_interleaved_that_is_no_bool_is_refused(interleaved):
    """'no' / 1 installed the Qwen3 interleaved layout (truthy) and None the contiguous one: silently a layout."""
    model = TinyMropeModel()
    original = model.rotary_pos_emb
    with pytest.raises(ValueError, match=rf"interleaved must be True or False, got {interleaved!r}"):
        use_packed_mrope(model, interleaved=interleaved)
    with pytest.raises(ValueError, match=rf"interleaved must be True or False, got {interleaved!r}"):
        PackedMultimodalRotaryEmbedding(torch.ones(2), interleaved=interleaved)
    assert model.rotary_pos_emb is original


def _thd_rotary(cp_size: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    rotary = PackedMultimodalRotaryEmbedding(torch.ones(2), cp_group=_RankOf(cp_size, 0))
    rotary.is_thd_format = True
    rotary.thd_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, 4, 12]))
    return rotary


@pytest.mark.parametrize("positions, section, cp_size, message", [
    (torch.arange(12).expand(3, 12), [1, 1, 0], 1, r"must be \[3, B, S\] \(t, h, w\), got \(3, 12\): packed positions "
                                                   r"are \[3, 1, T\]"),
    (torch.arange(12).expand(3, 1, 1, 12), [1, 1, 0], 1, r"must be \[3, B, S\] \(t, h, w\), got \(3, 1, 1, 12\)"),
    (torch.arange(12).expand(1, 1, 12), [1, 1, 0], 2, r"must be \[3, B, S\] \(t, h, w\), got \(1, 1, 12\)"),
    (torch.arange(12).expand(3, 2, 12), [1, 1, 0], 2, r"packed \(qkv_format='thd'\) mRoPE position_ids must be "
                                                      r"\[3, 1, T\], got \(3, 2, 12\)"),
    (torch.ones(3, 1, 12, dtype=torch.bool), [1, 1, 0], 1, r"must be integers or real numbers .* got torch\.bool"),
    (torch.ones(3, 1, 12, dtype=torch.complex64), [1, 1, 0], 1, r"must be integers or real numbers .* got "
                                                                r"torch\.complex64"),
    (torch.arange(6).expand(3, 1, 6), [1, 1, 0], 2, r"T=6 tokens, not a multiple of 2 \* context-parallel size 2: "
                                                    r"the rotary needs the full pack's positions"),
    (torch.arange(12).expand(3, 1, 12), [3, -1, 0], 1, r"mrope_section \[3, -1, 0\] must be 3 non-negative ints "
                                                       r"\(t, h, w\) that sum to 2"),
    (torch.arange(12).expand(3, 1, 12), [1, 1], 1, r"mrope_section \[1, 1\] must be 3 non-negative ints"),
])
def test_hostile_positions_and_sections_fail_loudly_in_thd_mode(positions, section, cp_size, message):
    """Before: an IndexError, an opaque RuntimeError, or silently a table of the wrong shape or rows."""
    apply_thd_rotary()
    with pytest.raises(ValueError, match=message):
        _thd_rotary(cp_size)(positions, section)


@pytest.mark.parametrize("interleaved", [False, True])
def test_dense_mode_and_the_pure_function_refuse_the_same(interleaved):
    rotary = PackedMultimodalRotaryEmbedding(torch.ones(2), interleaved=interleaved)
    with pytest.raises(ValueError, match=r"mrope_section \[3, -1, 0\] must be 3 non-negative ints"):
        rotary(torch.zeros(3, 1, 4, dtype=torch.long), [3, -1, 0])  # interleaved used to accept it silently
    with pytest.raises(ValueError, match=r"got \(3, 1, 1, 4\)"):
        rotary(torch.zeros(3, 1, 1, 4, dtype=torch.long), [1, 1, 0])  # used to return a 5-D table
    with pytest.raises(ValueError, match=r"got torch\.bool"):
        mrope_frequencies(torch.zeros(3, 1, 4, dtype=torch.bool), torch.ones(2), [1, 1, 0])


@pytest.mark.parametrize("interleaved", [False, True])
def test_fractional_positions_rotate_as_given(interleaved):
    """Qwen3-Omni's temporal positions are fractional (seconds times tokens per second): the table is
    built from the float values, exactly as from the integer ones they scale."""
    inv_freq = torch.tensor([1.0, 0.5, 0.25])
    integer = torch.arange(8).expand(3, 1, 8)
    halves = integer.double() / 2  # 0, 0.5, 1, ...
    table = mrope_frequencies(halves, inv_freq, [1, 1, 1], interleaved=interleaved)
    scaled = mrope_frequencies(integer, inv_freq / 2, [1, 1, 1], interleaved=interleaved)
    assert torch.allclose(table, scaled)
    assert not torch.equal(table, mrope_frequencies(integer, inv_freq, [1, 1, 1], interleaved=interleaved))


def test_the_checks_read_nothing_back_from_the_device():
    from megatron_vlm_packing.testing.sync_counter import count_host_syncs

    apply_thd_rotary()
    rotary = _thd_rotary(2)
    positions = torch.arange(12).expand(3, 1, 12)
    with count_host_syncs() as syncs:
        rotary(positions, [1, 1, 0])
        rotary.is_thd_format = False
        rotary(positions, [1, 1, 0])
    assert syncs.total == 0, syncs.report()


@pytest.mark.parametrize("thd, cp_size", [(True, 2), (True, 1), (False, 2), (False, 1)])
def test_the_positions_are_checked_once_per_call(monkeypatch, thd, cp_size):
    """forward checked the positions' shape, then mrope_frequencies checked them again: twice per call."""
    from megatron_vlm_packing.rope import rotary as rotary_module

    calls = []
    checked = rotary_module.check_position_ids
    monkeypatch.setattr(rotary_module, "check_position_ids", lambda positions: calls.append(1) or checked(positions))
    apply_thd_rotary()
    rotary = _thd_rotary(cp_size)
    rotary.is_thd_format = thd
    table = rotary(torch.arange(12).expand(3, 1, 12), [1, 1, 0])
    assert table.shape == (12 // cp_size, 1, 1, 4) and len(calls) == 1


class RotaryCallingModel(TinyMropeModel):
    """Calls its rotary like GPTModel does, at CP=2 (a Bridge model calls `language_model.forward(...)`)."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_context=None, packed_seq_params=None):
        return self.rotary_pos_emb(position_ids, [1, 1, 0], cp_group=_RankOf(2, 0))


def test_a_direct_forward_that_skips_the_hooks_is_refused_under_cp():
    """model.forward(...) skips the hooks: a packed call would run as dense and CP-slice the whole
    packed table (bug class 6, silently). Through model(...) both modes work."""
    from megatron.core.packed_seq_params import PackedSeqParams

    model = RotaryCallingModel()
    handle = use_packed_mrope(model)
    positions = torch.arange(12).expand(3, 1, 12)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, 4, 12]))
    with pytest.raises(RuntimeError, match=r"ran at context-parallel size 2 outside its model's __call__"):
        model.forward(None, positions, None, packed_seq_params=thd)
    assert isinstance(model(None, positions, None, packed_seq_params=thd), CpLocalFreqs)
    assert model(None, positions, None).shape[0] == 6  # dense: this rank's half
    assert model.rotary_pos_emb.hooked_calls == 0
    handle.undo()


def test_one_rotary_serves_changing_cp_layouts_and_micro_batches_with_no_leftover_state():
    """Per-call cp_group (GPTModel passes packed_seq_params.cp_group) and per-call boundaries: each call
    equals a fresh rotary's on the same inputs, whatever came before."""
    from megatron.core.packed_seq_params import PackedSeqParams

    apply_thd_rotary()
    generator = torch.Generator().manual_seed(3)
    shared = PackedMultimodalRotaryEmbedding(torch.rand(2), cp_group=_RankOf(2, 0))
    calls = []
    for cp_size, rank, cu in [(2, 0, [0, 4, 12]), (2, 1, [0, 8, 16, 24]), (4, 3, [0, 16, 24]), (1, 0, [0, 5, 7]),
                              (2, 1, [0, 4, 12])]:
        positions = torch.randint(0, 30, (3, 1, cu[-1]), generator=generator)
        calls.append((_RankOf(cp_size, rank), PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=torch.tensor(cu)),
                      positions))
    for group, params, positions in calls + [(_RankOf(2, 1), None, torch.randint(0, 30, (3, 2, 8)))]:
        fresh = PackedMultimodalRotaryEmbedding(shared.inv_freq, cp_group=_RankOf(2, 0))
        for rotary in (shared, fresh):
            rotary.is_thd_format, rotary.thd_params = params is not None, params
        assert torch.equal(shared(positions, [1, 0, 1], cp_group=group), fresh(positions, [1, 0, 1], cp_group=group))


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_module_casts_keep_inv_freq_float32_like_megatron_core(shims, cast):
    """Megatron's Float16Module casts the model (`module.bfloat16()`); Megatron-Core's rotary keeps
    its inv_freq float32 (a plain attribute), so ours must too: a bf16 inv_freq shifted the angles by
    0.39 rad at position 4000 (fp16: 0.1), fractional positions included."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    megatron = MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    ours = getattr(torch.nn.Sequential(PackedMultimodalRotaryEmbedding(megatron.inv_freq)), cast)()[0]
    positions = torch.arange(4000.).view(1, 1, -1).expand(3, 1, -1) + 0.5
    assert ours.inv_freq.dtype == torch.float32
    assert torch.equal(ours(positions, [2, 3, 3]), megatron(positions, [2, 3, 3]))


def test_a_deep_copy_switches_its_own_rotary_and_undoes_only_itself():
    """`copy.deepcopy` copies a module's hook dicts but not the hook functions: hooks that closed over the
    rotary switched the original's rotary while the copy ran. (Megatron-Core's GPTModel holds process
    groups and cannot be deep-copied; a model that can, like this one, must still pack correctly.)"""
    import copy

    from megatron.core.packed_seq_params import PackedSeqParams

    model = TinyMropeModel()
    handle = use_packed_mrope(model)
    twin = copy.deepcopy(model)
    assert twin.rotary_pos_emb is not model.rotary_pos_emb
    thd = PackedSeqParams(qkv_format="thd")
    twin(None, None, None, packed_seq_params=thd)
    twin(None, None, None)
    assert twin.seen == [True, False] and model.seen == []
    assert model.rotary_pos_emb.hooked_calls == 0 and twin.rotary_pos_emb.hooked_calls == 0
    twin._packed_mrope_handle.undo()
    assert not twin._forward_pre_hooks and type(twin.rotary_pos_emb) is type(handle.original)
    model(None, None, None, packed_seq_params=thd)
    assert model.seen == [True]
    handle.undo()
    assert model.rotary_pos_emb is handle.original
