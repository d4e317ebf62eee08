"""Bridge's leaf model modules import without its TE-importing package chain, and the scope undoes itself."""

import sys

import pytest

from megatron_vlm_packing.bridge.imports import bare_bridge_packages, bridge_unavailable_reason, import_bridge_module

pytestmark = pytest.mark.bridge

PROVIDER = "megatron.bridge.models.qwen_vl.qwen3_vl_provider"


def test_leaf_module_imports_and_the_bare_packages_go_away():
    module = import_bridge_module(PROVIDER)
    assert hasattr(module, "Qwen3VLModelProvider")
    assert sys.modules[PROVIDER] is module
    # The bare parents were removed again: a later `import megatron.bridge` would run the real chain.
    assert "megatron.bridge" not in sys.modules
    assert "megatron.bridge.models.qwen_vl" not in sys.modules
    assert not any(type(f).__name__ == "_BarePackageFinder" for f in sys.meta_path)


def test_scope_serves_bare_packages_only_inside():
    with bare_bridge_packages() as created:
        import megatron.bridge.models.qwen_vl as pkg  # its __init__ (which imports bridges -> TE) does not run

        assert not hasattr(pkg, "Qwen3VLModelProvider") and "megatron.bridge.models.qwen_vl" in created
    assert "megatron.bridge.models.qwen_vl" not in sys.modules


def test_reason_is_none_here():
    assert bridge_unavailable_reason() is None
