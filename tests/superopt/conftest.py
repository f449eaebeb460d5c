"""Shared search results for the superopt tests (each search runs once per session)."""

from __future__ import annotations

import pytest

from mpk_dist.superopt import superoptimize
from mpk_dist.superopt.patterns import build

# Small shapes and bounds: the whole directory must stay well under two minutes on 2 cores.
SMALL = {
    "rmsnorm_linear": ({"M": 4, "K": 512, "N": 256}, dict(max_kernel_ops=2, max_block_ops=6)),
    "silu_mul_linear": ({"M": 2, "I": 256, "N": 64}, dict(max_kernel_ops=2, max_block_ops=3)),
    "attention_decode": ({"H": 4, "D": 128, "S": 4096}, dict(max_kernel_ops=2, max_block_ops=4)),
}


@pytest.fixture(scope="session")
def results():
    """{pattern: (graph, SearchResult)}, computed lazily and shared by all tests."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            shape, bounds = SMALL[name]
            g = build(name, shape)
            cache[name] = (g, superoptimize(g, timeout_s=120, cache=False, processes=2,
                                            **bounds))
        return cache[name]

    return get


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)`` replaces ``module.name`` with a wrapper that counts its calls for the rest of
    the test and returns (the one-element count list, the real function)."""

    def wrap(module, name):
        calls, real = [0], getattr(module, name)

        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls, real

    return wrap


@pytest.fixture
def t0_signature():
    """``t0_signature(name, shape)``: (target, input infos plus a made first-op output t0 = mul(x, x) of the first
    input, the unpruned search config at 2 kernel ops / 4 block ops, its context): the setup of the sieve tests'
    last-op signatures."""
    import time

    from mpk_dist.superopt.bounds import input_infos
    from mpk_dist.superopt.context import Context, SearchConfig
    from mpk_dist.superopt.target import analyze
    from mpk_dist.superopt.ugraph import TensorInfo

    def make(name: str, shape: dict):
        target = analyze(build(name, shape))
        infos = dict(input_infos(target))
        first = next(iter(infos))
        infos["t0"] = TensorInfo(infos[first].shape, infos[first].syms, ("mul", (infos[first].expr, infos[first].expr)))
        config = SearchConfig(max_kernel_ops=2, max_block_ops=4, prune=False)
        return target, infos, config, Context(target, config, time.monotonic() + 120)

    return make
