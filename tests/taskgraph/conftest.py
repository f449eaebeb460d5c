"""Fixtures shared by the task-graph tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiles are tiny matmuls: with 2 intra-op threads on a loaded 2-core machine they spin ~1000x longer."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
