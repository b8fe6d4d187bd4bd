"""gradtx.wrapper.sync: finding data-parallel modules anywhere in a model, and skipping their sync."""

import pytest
import torch

from gradtx.wrapper.sync import data_parallel_modules, no_sync, sum_grad_reduction


class DuckFSDP(torch.nn.Module):
    """A module with FSDP2's sync switch (a framework's own data-parallel module)."""

    def __init__(self):
        super().__init__()
        self.sync = [True]

    def set_requires_gradient_sync(self, sync):
        self.sync.append(sync)


def test_no_sync_turns_every_switch_off_and_back_on():
    inner = DuckFSDP()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), inner)
    assert data_parallel_modules(model) == ([inner], [])
    with no_sync(model, sync=False):
        assert inner.sync[-1] is False
    assert inner.sync[-1] is True
    with no_sync(model, sync=True):
        assert inner.sync == [True, False, True]  # syncing: nothing touched


def test_sum_grad_reduction_refuses_a_model_without_data_parallel_modules():
    with pytest.raises(TypeError, match="sum_grad_reduction: model must be DistributedDataParallel"):
        sum_grad_reduction(torch.nn.Linear(2, 2))
