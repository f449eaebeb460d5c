"""Serving tests run tiny models: one torch thread is fastest, and on a loaded 2-core machine the
intra-op thread pool's spin-waits made the same tests 10-100x slower (measured)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
