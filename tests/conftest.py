import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    # The suite runs tiny models on a 2-core machine; intra-op threading only adds overhead there
    # and makes timings erratic when another process competes for the cores.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
