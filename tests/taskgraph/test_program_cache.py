"""The on-disk program cache (mpk_dist/taskgraph/program_cache.py): a hit returns exactly what a compile
returns, every compile argument is in the key, a broken entry is compiled again, and the switch turns it off."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph import program_cache
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.program_cache import cache_dir, compile_rank_programs_cached


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MPK_TASKGRAPH_CACHE", raising=False)


def _same(a, b):
    assert sorted(a.arrays) == sorted(b.arrays) and sorted(a.consts) == sorted(b.consts)
    for k in a.arrays:
        assert a.arrays[k].dtype == b.arrays[k].dtype and np.array_equal(a.arrays[k], b.arrays[k]), k
    for k in a.consts:
        assert np.array_equal(a.consts[k], b.consts[k]), k
    assert a.meta == b.meta


@pytest.mark.parametrize("kw", [dict(tp=1, batch=1, fuse=True, attn_splits="auto"),
                                dict(tp=2, batch=4, fuse=False, attn_splits=1, nucleus=True)])
def test_hit_equals_a_fresh_compile(kw):
    cfg = get_preset("tiny")
    first, cached1 = compile_rank_programs_cached(cfg, max_seq_len=64, **kw)
    second, cached2 = compile_rank_programs_cached(cfg, max_seq_len=64, **kw)
    assert (cached1, cached2) == (False, True)
    fresh = compile_rank_programs(cfg, max_seq_len=64, **kw)
    assert len(second) == len(fresh) == kw["tp"]
    for got, want in zip(second, fresh):
        _same(got, want)


def test_every_argument_and_the_config_are_in_the_key():
    cfg = get_preset("tiny")
    base = dict(tp=1, batch=1, max_seq_len=64, fuse=True, attn_splits="auto")
    compile_rank_programs_cached(cfg, **base)
    for change in (dict(batch=2), dict(max_seq_len=128), dict(fuse=False), dict(attn_splits=1), dict(sms=64),
                   dict(nucleus=True), dict(tp=2, ranks=[1])):
        _, cached = compile_rank_programs_cached(cfg, **{**base, **change})
        assert not cached, f"{change} hit an entry of other arguments"
    other = dataclasses.replace(cfg, rms_norm_eps=cfg.rms_norm_eps * 2)
    _, cached = compile_rank_programs_cached(other, **base)
    assert not cached, "a different config hit the cache"
    _, cached = compile_rank_programs_cached(cfg, **base)
    assert cached


def test_code_change_is_a_miss(monkeypatch):
    cfg = get_preset("tiny")
    compile_rank_programs_cached(cfg, tp=1, max_seq_len=64)
    monkeypatch.setattr(program_cache, "package_source_digest", lambda: "another version of the code")
    _, cached = compile_rank_programs_cached(cfg, tp=1, max_seq_len=64)
    assert not cached


def test_a_broken_entry_is_compiled_again():
    cfg = get_preset("tiny")
    compile_rank_programs_cached(cfg, tp=1, max_seq_len=64)
    (entry,) = [p for p in cache_dir().iterdir() if not p.name.startswith(".")]
    (entry / "rank0" / "tasks.npy").unlink()
    got, cached = compile_rank_programs_cached(cfg, tp=1, max_seq_len=64)
    assert not cached
    _same(got[0], compile_rank_programs(cfg, tp=1, max_seq_len=64)[0])
    _, cached = compile_rank_programs_cached(cfg, tp=1, max_seq_len=64)
    assert cached, "the recompiled entry was not stored again"


def test_switch_off_writes_nothing(monkeypatch):
    monkeypatch.setenv("MPK_TASKGRAPH_CACHE", "0")
    cfg = get_preset("tiny")
    for _ in range(2):
        _, cached = compile_rank_programs_cached(cfg, tp=1, max_seq_len=64)
        assert not cached
    assert not cache_dir().exists()
