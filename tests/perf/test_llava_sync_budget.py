"""Host syncs of a packed Megatron-Core LLaVAModel forward + backward through `make_forward_step`,
counted per source (testing/sync_counter.py says what counts; tests/llava/llava_workers.py runs it):

- ours (the step, `pack_llava_batch`, the adapter, the boundary patch): 1 when the step packs (the
  lengths, every value check and each row's images / expansion / tiles read back together), 0 when
  `LlavaPackingCollator` packed in the DataLoader (its `LlavaPackPlan` carries the tiles, the leak
  check and the expanded boundaries as host ints), 1 with pack=False (`pad_llava_batch`'s read);
- Megatron-Core's own code (LLaVAModel's image expansion, with data-dependent shapes): exactly what
  its own batched forward does, so packing adds nothing there.

The reference core attention and the CPU stand-in for TE's `thd_get_partitioned_indices` are not
counted: on a GPU they are TE kernels that read nothing back.
"""

import pytest

from tests.llava.llava_workers import launch


@pytest.mark.parametrize("layout", ["CP=2", "TP=2+SP"])
def test_packed_llava_step_syncs_once_in_step_and_never_with_loader_packing(layout):
    row = launch()[f"syncs {layout}"]
    in_step, loader, batched = row["in_step"], row["loader"], row["batched"]
    assert in_step["ours"] == 1, in_step["report"]  # DeferredChecks.read (packing/rows.py) in pack_llava_batch
    assert loader["ours"] == 0, loader["report"]
    assert in_step["upstream"] == loader["upstream"] == batched["upstream"], (in_step["report"], batched["report"])
    assert batched["ours"] == 0, batched["report"]
    # the loader's micro-batch is the same computation as the step's own packing
    assert row["loss_diff"] < 1e-5 and row["grad_diff"] < 1e-6, row


def test_padded_llava_step_syncs_once():
    """make_forward_step(pack=False): `pad_llava_batch`'s one read; Megatron's own as in its batched forward."""
    row = launch()["syncs TP=2+SP"]
    padded, batched = row["padded"], row["batched"]
    assert padded["ours"] == 1 and padded["upstream"] == batched["upstream"], padded["report"]
