"""No stale rotary state between forwards: every call of a real GPTModel uses its own positions."""

from megatron_vlm_packing.testing.distributed import run_distributed
from tests.rope.stale_cases import run_forwards_in_a_row


def test_each_forward_uses_its_own_positions_like_megatron_cores_rotary():
    """Packed micro-batches of another T, a dense forward in between, a packed call with the same T
    but other positions, then the first again: each equals Megatron-Core's own rotary on that call."""
    result = run_distributed(run_forwards_in_a_row, 1)
    assert result["positions_matter"] > 1e-3, result  # the comparison would see a stale table
    assert all(d < 1e-5 for d in result["dlogit"].values()), result
