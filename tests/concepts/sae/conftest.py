"""Shared fixtures of the SAE tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Run single-threaded: on a shared 2-core machine, two OpenMP threads that wait on
    each other make these tiny steps up to 100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
