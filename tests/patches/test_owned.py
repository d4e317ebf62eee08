"""patches.owned on small hand-made owners: what counts as the owner's own value, what errors name,
and that a refused restore changes nothing. The real patches are tests/patches/test_stack_safe_undo.py."""

import functools
import types

import pytest

from megatron_vlm_packing.patches.owned import OwnedAttributes, check_restorable, describe_value


class Base:
    def forward(self):
        return "base"


class Child(Base):
    pass


def later_plugin(wrapped):
    @functools.wraps(wrapped)  # as a real plugin would: its __qualname__ is now the wrapped one's
    def foreign_wrapper(*args, **kwargs):
        return wrapped(*args, **kwargs)

    return foreign_wrapper


def test_restores_module_class_and_object_attributes_and_deletes_what_was_not_their_own():
    module = types.ModuleType("holder")
    module.fn = original_fn = lambda: "original"
    obj, func = Child(), lambda a=1: a
    owned = OwnedAttributes("test")
    owned.set(module, "fn", lambda: "ours")
    owned.set(Child, "forward", lambda self: "ours")  # inherited from Base: not Child's own
    owned.set(obj, "forward", lambda: "ours-instance")  # the class's method: not the object's own
    owned.set(func, "__defaults__", (2,))  # a data descriptor: its value is the function's own
    owned.set(module, "added", None)
    assert (module.fn(), Child().forward(), obj.forward(), func()) == ("ours", "ours", "ours-instance", 2)
    owned.restore()
    assert module.fn is original_fn and not hasattr(module, "added") and func() == 1
    assert "forward" not in vars(Child) and "forward" not in vars(obj) and obj.forward() == "base"
    assert not owned
    owned.restore()  # nothing set: a no-op


def test_original_is_what_the_name_gave_before_the_first_replacement_while_set():
    # the patches wrap and call this (their one record; it replaced a second `_ORIGINAL` dict)
    module = types.ModuleType("holder")
    module.fn = original_fn = lambda: "original"
    owned = OwnedAttributes("test")
    assert owned.original("fn") is None
    owned.set(module, "fn", lambda: "ours")
    owned.set(Child, "forward", lambda self: "ours")  # inherited: restore deletes, original is Base's
    owned.set(module, "added", None)  # nothing there before
    assert owned.original("fn") is original_fn and owned.original("forward") is Base.forward
    assert owned.original("added") is None and owned.original("other") is None
    owned.restore()
    assert owned.original("fn") is None and owned.original("forward") is None and module.fn is original_fn


def test_a_later_wrapper_is_named_and_nothing_is_restored():
    first, second = types.ModuleType("first_holder"), types.ModuleType("second_holder")
    first.fn = second.fn = original = lambda: "original"
    ours = lambda: "ours"  # noqa: E731
    owned = OwnedAttributes("megatron_vlm_packing.patches.example")
    owned.set(first, "fn", ours)
    owned.set(second, "fn", ours)
    second.fn = later_plugin(ours)
    with pytest.raises(RuntimeError) as err:
        owned.restore()
    message = str(err.value)
    assert "cannot undo megatron_vlm_packing.patches.example: second_holder.fn now holds" in message
    assert "later_plugin.<locals>.foreign_wrapper" in message  # the code's own qualname, through functools.wraps
    assert "undo that later patch first" in message and "first_holder.fn" not in message
    assert first.fn is ours and owned  # checked before anything was restored
    second.fn = ours  # the later plugin undoes first
    owned.restore()
    assert first.fn is original and second.fn is original


def test_a_deleted_attribute_is_a_conflict_too():
    class Owner:
        pass

    owned = OwnedAttributes("test")
    owned.set(Owner, "forward", lambda self: None)
    del Owner.forward
    with pytest.raises(RuntimeError, match=r"Owner\.forward now holds nothing \(the attribute was deleted\)"):
        owned.restore()


def test_check_restorable_reports_every_patch_before_any_is_undone():
    one, two = types.SimpleNamespace(fn=None), types.ModuleType("two_holder")
    two.fn = None
    first, second = OwnedAttributes("patch_one"), OwnedAttributes("patch_two")
    first.set(one, "fn", ours_one := (lambda: 1))
    second.set(two, "fn", lambda: 2)
    two.fn = later_plugin(two.fn)
    check_restorable(first)
    with pytest.raises(RuntimeError, match="cannot undo patch_two: two_holder.fn now holds"):
        check_restorable(first, second)
    assert one.fn is ours_one and first and second


def test_describe_value_names_functions_methods_and_data():
    assert describe_value(Base.forward) == f"{__name__}.Base.forward"
    assert describe_value(staticmethod(Base.forward)) == f"{__name__}.Base.forward"
    assert describe_value(len) == "builtins.len"
    assert describe_value(None) == "None"


def test_a_torch_modules_submodule_counts_as_its_own_and_a_later_wrapper_is_named_by_class():
    import torch

    model = torch.nn.Module()
    model.rotary = original = torch.nn.Identity()  # kept in model._modules, not in vars(model)
    ours = torch.nn.Identity()
    owned = OwnedAttributes("megatron_vlm_packing.rope.rotary.use_packed_mrope")
    owned.set(model, "rotary", ours)
    assert not owned.conflicts() and model.rotary is ours
    model.rotary = torch.nn.Sequential(ours)
    with pytest.raises(RuntimeError, match=r"a torch\.nn\.modules\.module\.Module object's rotary now holds a "
                                           r"torch\.nn\.modules\.container\.Sequential, not"):
        owned.restore()
    model.rotary = ours
    owned.restore()
    assert model.rotary is original and "rotary" in model._modules


def test_an_earlier_patch_undone_under_ours_is_no_conflict_undo_keeps_its_state_and_ours_reads_inactive():
    # unittest.mock.patch.object (and most plugins) undo by putting back what they saved, not LIFO: an
    # earlier patch's exit puts its original back over ours. Putting our original (that earlier patch)
    # back would reinstall what was undone.
    module = types.ModuleType("holder")
    module.fn = original_fn = lambda: "original"
    module.fn = earlier = later_plugin(original_fn)  # an earlier patch, wrapping the original
    owned = OwnedAttributes("test")
    owned.set(module, "fn", ours := (lambda: "ours"))
    assert owned.active()
    module.fn = original_fn  # the earlier patch's undo
    assert not owned.conflicts() and not owned.active() and owned  # records kept until restored
    owned.restore()
    assert module.fn is original_fn and not owned  # not `earlier`: it was undone
    module.fn = earlier
    owned.set(module, "fn", ours)
    module.fn = earlier  # the very value we replaced put back: restoring it changes nothing
    assert not owned.conflicts() and not owned.active()
    owned.restore()
    assert module.fn is earlier
    owned.set(module, "fn", ours)
    module.fn = later_plugin(ours)  # a later wrapper: ours still runs under it, undo must wait for it
    assert owned.active() and owned.conflicts()
    module.fn = lambda: "replaced"  # a later patch that does not call ours
    assert not owned.active() and owned.conflicts()
