"""Serving dynamic workloads: paged KV cache, continuous batching, the Python API and serve-bench.

``Server`` (server.py) is the entry point; ``PagePool`` (pages.py) the array-based page/slot
allocator; ``Scheduler`` (scheduler.py) retires/admits between passes and lays out ragged batches;
``TorchPagedBackend`` (torch_paged.py) runs a pass; metrics.py and workload.py serve the benchmark.
Design and the GPU plan: docs/SERVING.md.
"""

from __future__ import annotations

__all__ = ["Server", "PagePool", "Scheduler", "RequestOutput"]


def __getattr__(name: str):
    # Lazy, so `import mpk_dist.serving.pages` does not pull torch-heavy modules.
    if name == "Server":
        from mpk_dist.serving.server import Server
        return Server
    if name == "PagePool":
        from mpk_dist.serving.pages import PagePool
        return PagePool
    if name == "Scheduler":
        from mpk_dist.serving.scheduler import Scheduler
        return Scheduler
    if name == "RequestOutput":
        from mpk_dist.serving.request import RequestOutput
        return RequestOutput
    raise AttributeError(name)
