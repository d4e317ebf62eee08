"""Boundaries equal to the plan's but held in new tensors (a transform that rebuilt `packed_seq_params` and
`rope_cu_seqlens`) cost the step its one read of what no packer made, and no more: once that read found them equal,
the micro-batch takes the plan's own tensors, so `localize` builds the CP index from the plan's host ints as for
the packer's boundaries. Before, it built the index from the copies (`parallel.cp.cp_partition_index`: one more
host sync per micro-batch at CP > 1). Two CPU processes (gloo), a real Megatron-Core GPTModel at CP = 2; a count,
not a time (testing/sync_counter.py)."""

import pytest

from megatron_vlm_packing.runtime import run_distributed
from tests.step.cp_boundary_workers import run_copied_boundaries


@pytest.mark.parametrize("cp", [2])
def test_copied_boundaries_cost_one_read_at_cp2_and_train_as_the_packers(cp):
    result = run_distributed(run_copied_boundaries, cp, cp, timeout_s=600)
    packers, copies = result["packers"], result["copies"]
    assert packers[0] == 0, packers[1]  # packed in the DataLoader: no sync in the step
    assert copies[0] == 1, copies[1]  # the shared read of the copies, and nothing else (localize none)
    assert copies[2] == pytest.approx(packers[2])
