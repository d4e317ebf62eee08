"""Bridge tests (marked `bridge`) skip with the reason where megatron-bridge cannot be used (the floor leg)."""

import pytest

from megatron_vlm_packing.bridge.imports import bridge_unavailable_reason


def pytest_collection_modifyitems(config, items):
    reason = bridge_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("bridge") is not None:
            item.add_marker(skip)
