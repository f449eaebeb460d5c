"""Disk cache: keyed by graph, shapes, search parameters and version; a hit takes < 1 s."""

import time

from mpk_dist.superopt import superoptimize
from mpk_dist.superopt.context import SearchConfig
from mpk_dist.superopt.patterns import build
from mpk_dist.superopt.search import cache_dir, cache_key


def test_second_call_hits_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    g = build("silu_mul_linear", {"M": 2, "I": 256, "N": 64})
    kw = dict(max_kernel_ops=1, max_block_ops=3, processes=1)
    first = superoptimize(g, **kw)
    assert not first.stats.get("cached")
    assert list(cache_dir().glob("*.pkl"))
    t = time.monotonic()
    second = superoptimize(build("silu_mul_linear", {"M": 2, "I": 256, "N": 64}), **kw)
    assert time.monotonic() - t < 1.0
    assert second.stats["cached"] and second.stats["seconds"] < 1.0
    assert str(second.best) == str(first.best)
    assert cache_dir() == tmp_path / "superopt"


def test_key_covers_shapes_and_parameters():
    g1 = build("silu_mul_linear", {"M": 2, "I": 256, "N": 64})
    g2 = build("silu_mul_linear", {"M": 2, "I": 256, "N": 128})
    c = SearchConfig()
    assert cache_key(g1, c) == cache_key(build("silu_mul_linear", {"M": 2, "I": 256, "N": 64}), c)
    assert cache_key(g1, c) != cache_key(g2, c)
    assert cache_key(g1, c) != cache_key(g1, SearchConfig(max_block_ops=3))
    assert cache_key(g1, c) != cache_key(g1, SearchConfig(prune=False))


def test_unwritable_cache_dir_only_costs_a_search(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MPK_CACHE_DIR", str(blocker))
    res = superoptimize(build("silu_mul_linear", {"M": 2, "I": 64, "N": 32}),
                        max_kernel_ops=1, max_block_ops=3, processes=1)
    assert res.best is not None
