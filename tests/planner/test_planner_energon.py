"""The Energon hooks against a hostile buffer: every sample packed exactly once, or a ValueError naming it."""

import numpy as np
import pytest

from megatron_vlm_packing.data.synthetic import SyntheticVLMConfig, collate, synthetic_samples
from megatron_vlm_packing.planner import BinLayout, CostModel, EnergonPackingHooks, PlannedPackingMixin
from tests.planner.synthetic_metadata import CFG, metadata

PACK = {"label_style": "hf", "image_token_id": SyntheticVLMConfig().image_token_id}


@pytest.fixture(scope="module")
def samples():
    return synthetic_samples(30, seed=11, cfg=CFG)


def _hooks(**kw):
    return EnergonPackingHooks(**{"metadata": metadata, "collate": collate, "layout": BinLayout(capacity=96),
                                  "pack_kwargs": PACK, **kw})


def test_every_sample_of_any_buffer_lands_in_exactly_one_group(samples):
    """Energon drops what select_samples_to_pack does not return: nothing may be left out or doubled."""
    hooks = _hooks(layout=BinLayout(capacity=64, oversize="own_bin"))
    for buffer in (samples[:1], samples[:2], samples, samples[::-1], samples[:7] * 2):
        groups = hooks.select_samples_to_pack(list(buffer))
        assert sorted(map(id, (s for g in groups for s in g))) == sorted(map(id, buffer))
        assert all(groups)
        assert hooks.select_samples_to_pack(list(buffer)) == groups  # every worker, every rank: the same
    assert hooks.select_samples_to_pack([]) == []


def test_an_oversize_sample_is_named_or_packed_alone(samples):
    tokens = [len(s["input_ids"]) for s in samples]
    long = int(np.argmax(tokens))
    with pytest.raises(ValueError, match=rf"sample {long} \({tokens[long]} slots\)"):
        _hooks(layout=BinLayout(capacity=32)).select_samples_to_pack(samples)
    hooks = _hooks(layout=BinLayout(capacity=32, oversize="own_bin"))
    groups = hooks.select_samples_to_pack(samples)
    alone = [g for g in groups if g[0] is samples[long]]
    assert alone == [[samples[long]]]
    assert hooks.pack_selected_samples(alone[0]).input_ids.shape[1] >= tokens[long]  # never truncated


def test_metadata_that_is_no_sample_metadata_is_named(samples):
    """A metadata hook returning a dict (or None) failed with AttributeError deep in SampleTable."""
    bad = _hooks(metadata=lambda s: {"text_tokens": len(s["input_ids"])})
    with pytest.raises(ValueError, match=r"metadata returned dict for sample 0 of the buffer; expected SampleMetadata"):
        bad.select_samples_to_pack(samples[:3])


def test_expanded_tokens_must_give_one_count_per_sample(samples):
    """A hook giving one count too few raised IndexError; one too many was silently ignored."""
    for cut in (slice(1, None), slice(None, None)):
        def tokens(table, cut=cut):
            counts = np.asarray(table.text_tokens[cut] + 8)
            return counts if cut.start else np.append(counts, 5)
        with pytest.raises(ValueError, match=r"expanded_tokens returned (2|4) counts for a buffer of 3 samples"):
            _hooks(expanded_tokens=tokens).select_samples_to_pack(samples[:3])
    with pytest.raises(ValueError, match="expanded_tokens must hold whole numbers"):
        _hooks(expanded_tokens=lambda t: t.text_tokens + 0.5).select_samples_to_pack(samples[:3])


@pytest.mark.parametrize("field, value, message", [
    ("cost_model", None, r"cost_model must be a CostModel \(or have extra_costs, lm_linear and bin_cost\), "
                          r"got NoneType"),
    ("cost_model", CostModel, r"cost_model must be a CostModel .*got type"),
    ("layout", 96, r"layout must be a BinLayout, got int"),
    ("metadata", "input_ids", r"metadata must be callable, got str"),
    ("collate", None, r"collate must be callable, got NoneType"),
    ("expanded_tokens", 4, r"expanded_tokens must be callable, got int"),
])
def test_hooks_of_the_wrong_type_fail_at_construction(field, value, message):
    """A cost_model of the wrong type failed only in the first buffer, where Energon's error handler logs
    the error and drops the buffer (up to its failure tolerance)."""
    with pytest.raises(ValueError, match=message):
        _hooks(**{field: value})


def test_a_group_that_does_not_fit_the_layout_is_refused(samples):
    """Energon saves the selected groups in its checkpoint and packs them after a restore: groups selected
    under a larger capacity became packs longer than the static capacity, silently."""
    big, small = _hooks(layout=BinLayout(capacity=192)), _hooks(layout=BinLayout(capacity=64, oversize="own_bin"))
    group = max(big.select_samples_to_pack(samples), key=len)
    slots = sum(len(s["input_ids"]) for s in group)
    assert slots > 64
    with pytest.raises(ValueError, match=rf"a group of {len(group)} samples takes {slots} slots but the "
                                         rf"capacity is 64"):
        small.pack_selected_samples(group)
    with pytest.raises(ValueError, match="a group of 0 samples"):  # was numpy's "zero-size array" error
        small.pack_selected_samples([])


def test_the_mixin_methods_are_marked_stateless():
    """Energon reads `__stateless__` (its @stateless decorator) to decide whether a pack can be restored
    from its restore key; the hooks are pure functions of the samples."""
    for name in ("select_samples_to_pack", "pack_selected_samples"):
        assert getattr(getattr(PlannedPackingMixin, name), "__stateless__", False) is True


@pytest.mark.parametrize("hooks", [None, 3, "hooks"])
def test_the_mixin_without_packing_hooks_is_a_value_error_naming_them(samples, hooks):
    """An encoder that never set packing_hooks was an AttributeError ('... has no attribute packing_hooks')
    at the first buffer, and one set to a non-hooks value an AttributeError on that value."""
    class Encoder(PlannedPackingMixin):
        pass

    if hooks is not None:
        Encoder.packing_hooks = hooks
    for method in (Encoder().select_samples_to_pack, Encoder().pack_selected_samples):
        with pytest.raises(ValueError, match=r"Encoder.packing_hooks must be an EnergonPackingHooks .*got "
                                             + ("nothing" if hooks is None else repr(hooks))):
            method(samples[:2])

    class Good(PlannedPackingMixin):
        packing_hooks = _hooks(layout=BinLayout(capacity=64, oversize="own_bin"))

    assert sum(map(len, Good().select_samples_to_pack(samples[:3]))) == 3


def test_a_restored_oversize_sample_is_refused_under_oversize_error(samples):
    """A group restored from an Energon checkpoint saved under a larger capacity (or oversize='own_bin') may be one
    sample over this capacity: under oversize='error' it became a pack longer than the capacity, silently (only
    groups of several samples were checked); select_samples_to_pack refuses that sample under this layout."""
    tokens = [len(s["input_ids"]) for s in samples]
    long = samples[int(np.argmax(tokens))]
    with pytest.raises(ValueError, match=rf"sample 0 \({max(tokens)} slots\)"):
        _hooks(layout=BinLayout(capacity=32)).select_samples_to_pack([long])
    with pytest.raises(ValueError, match=rf"1 sample\(s\) exceed the bin capacity 32: sample 0 \({max(tokens)} "):
        _hooks(layout=BinLayout(capacity=32)).pack_selected_samples([long])
    packed = _hooks(layout=BinLayout(capacity=32, oversize="own_bin")).pack_selected_samples([long])
    assert packed.plan.real_lengths == (max(tokens),)  # own_bin: alone, never truncated


def test_the_mixin_batch_is_the_one_pack(samples):
    """Energon's batch stage after packing: its default batched the MicroBatch's fields as a generic dataclass
    and failed on every pack (tests/planner/test_planner_energon_real.py runs it through Energon)."""
    class Encoder(PlannedPackingMixin):
        packing_hooks = _hooks(layout=BinLayout(capacity=64, oversize="own_bin"))

    encoder = Encoder()
    packs = [encoder.pack_selected_samples(g) for g in encoder.select_samples_to_pack(samples[:6])]
    assert encoder.batch(packs[:1]) is packs[0]
    with pytest.raises(ValueError, match=r"batch got 2 packs: .* batch_size=1 or batch_size=None"):
        encoder.batch(packs[:2])
    assert Encoder.batch.__stateless__ is True
