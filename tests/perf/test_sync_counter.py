"""The sync counter counts each kind of host read exactly once, and nothing else."""

import pytest
import torch

from megatron_vlm_packing.testing.sync_counter import classify, count_host_syncs

x = torch.tensor([3, 0, 2])
mask = torch.tensor([True, False, True])

CASES = {
    "item": [lambda: x[0].item()],
    "tolist": [lambda: x.tolist()],
    "bool": [lambda: bool(x[0]), lambda: 1 if x[0] else 0, lambda: not x[1], lambda: torch.is_nonzero(x[:1]),
             lambda: torch.equal(x, x), lambda: torch.allclose(x.float(), x.float())],
    "scalar": [lambda: int(x[0]), lambda: float(x[0]), lambda: range(x[0]), lambda: [0, 1, 2, 3][x[0]],
               lambda: f"{x[0]}", lambda: str(x)],
    "dynamic_shape": [lambda: x.nonzero(), lambda: torch.nonzero(x), lambda: torch.argwhere(x),
                      lambda: torch.where(x), lambda: x.masked_select(mask), lambda: x[mask],
                      lambda: x.clone().__setitem__(mask, torch.tensor([7, 8])), lambda: torch.unique(x), lambda: torch.bincount(x),
                      lambda: torch.repeat_interleave(x, x), lambda: x.repeat_interleave(x),
                      lambda: torch.repeat_interleave(x)],
}

NOT_SYNCS = [
    lambda: x + 1, lambda: x[1:], lambda: x[torch.tensor([0, 2])], lambda: torch.where(mask, x, 0),
    lambda: x.any(), lambda: x.sum(), lambda: torch.repeat_interleave(x, x, output_size=5),
    lambda: x.repeat_interleave(2), lambda: x.repeat_interleave(repeats=2), lambda: x.cpu(), lambda: x.numpy(),
    lambda: x.to("cpu"), lambda: x.shape[0], lambda: x.numel(), lambda: torch.cumsum(x, 0),
    lambda: x.index_select(0, torch.tensor([1])), lambda: torch.tensor([1, 2]),
    lambda: x.clone().__setitem__(mask, 1), lambda: x.clone().__setitem__(mask, torch.tensor(1)),  # masked_fill_
]


@pytest.mark.parametrize("kind,call", [(k, c) for k, calls in CASES.items() for c in calls])
def test_each_sync_counts_once_under_its_kind(kind, call):
    with count_host_syncs() as syncs:
        call()
    assert syncs.total == 1, syncs.report()
    assert syncs.by_kind == {kind: 1}


@pytest.mark.parametrize("call", NOT_SYNCS)
def test_device_side_work_and_host_copies_of_host_data_count_nothing(call):
    with count_host_syncs() as syncs:
        call()
    assert syncs.total == 0, syncs.report()


def test_copies_to_host_count_for_device_tensors():
    on_device = torch.empty(2, device="meta")  # any non-CPU device; meta runs without hardware
    assert classify("cpu", (on_device,), {}) == "to_host"
    assert classify("numpy", (on_device,), {}) == "to_host"
    assert classify("to", (on_device, "cpu"), {}) == "to_host"
    assert classify("to", (on_device,), {"device": torch.device("cpu")}) == "to_host"
    assert classify("to", (on_device, torch.float64), {}) is None


def test_counts_add_up_and_name_the_call_site():
    with count_host_syncs() as syncs:
        for value in x:  # iterating yields 0-d tensors; int() of each is one sync
            int(value)
        x.tolist()
    assert syncs.by_kind == {"scalar": 3, "tolist": 1}
    assert "3 x scalar __int__ at " in syncs.report() and "test_sync_counter.py" in syncs.report()


def test_nothing_is_counted_outside_the_block():
    with count_host_syncs() as syncs:
        pass
    x.tolist()
    assert syncs.total == 0


def test_excluded_modules_are_not_counted_and_the_hooks_go_away():
    class Reads(torch.nn.Module):
        def forward(self, t):
            return t.tolist()

    inner, outer = Reads(), Reads()
    with count_host_syncs(exclude=[inner]) as syncs:
        inner(x)
        outer(x)
    assert syncs.by_kind == {"tolist": 1}
    assert not inner._forward_pre_hooks and not inner._forward_hooks
