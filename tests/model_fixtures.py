"""Fixtures shared by the tests that run the real model in-process."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The test machines are small and shared: one intra-op thread avoids OpenMP stalls (and is faster here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
