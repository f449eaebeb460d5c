"""The long tiles (-DMPK_LONG_ROWS=R [-DMPK_LONG_MIN_ROWS=M], csrc/tasks/fused_gemv.cuh; R = 4, M = 4 the default
since v0.32): with nvcc, the batch-1 kernel of qwen3-0.6b's shape (256 worker threads, unroll 4) gets one more GEMV
instance, R rows of the whole unroll each, and ptxas spills nothing in it; -DMPK_LONG_ROWS=1 has no such instance;
a wide unroll caps R (R x unroll <= 16 loads a lane, or -DMPK_LONG_MAX_LOADS). Speed and sums measured on the GPU
(docs/PERF.md v0.32)."""

from __future__ import annotations

import re

import pytest

from tests.runtime.test_attn_prep_build import _spills, needs_nvcc

# gemv_tile<1, R, XRows, Epi, UR> as ptxas names it: _ZN3mpk9gemv_tileILi1ELi<R>ENS_5XRowsENS_3EpiELi<UR>EEEv...
_INSTANCE = re.compile(r"_ZN3mpk9gemv_tileILi1ELi(\d+)ENS_5XRowsENS_3EpiELi(\d+)E")


def _long_instances(extra: str, unroll: int, tmp_path, monkeypatch) -> dict[tuple[int, int], tuple[int, int]]:
    """{(R, UR): (spill stores, spill loads)} of the gemv_tile instances with loads a row set (UR > 0)."""
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", f"-Xptxas -v {extra}".strip())
    _, res = build_kernel(KernelShape(batch=1, worker_threads=256, schedule="aot", linear_unroll=unroll), compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    every = {(int(m.group(1)), int(m.group(2))): v for k, v in _spills(res.log).items() if (m := _INSTANCE.match(k))}
    assert (1, 0) in every, f"no one-row gemv_tile<1, 1, XRows, Epi, 0> in the log: {sorted(every)}"  # the regex reads
    return {k: v for k, v in every.items() if k[1] > 0}


@needs_nvcc
@pytest.mark.parametrize("flags, rows", [("-DMPK_LONG_ROWS=4 -DMPK_LONG_MIN_ROWS=16", 4),
                                         ("-DMPK_LONG_ROWS=4 -DMPK_LONG_MIN_ROWS=4", 4),
                                         ("-DMPK_LONG_ROWS=8 -DMPK_LONG_MAX_LOADS=32", 8)])
def test_long_rows_add_one_spill_free_instance(flags, rows, tmp_path, monkeypatch):
    """lm_head's tiles only (16 rows a warp, the default), or qkv's and the gate|up pair's too (4): one instance
    serves every call site; with the cap raised to 32 loads a lane, 8 rows of 4 loads still fit 256 threads' registers."""
    found = _long_instances(flags, 4, tmp_path, monkeypatch)
    assert set(found) == {(rows, 4)}, f"expected gemv_tile<1, {rows}, ..., 4> only, got {sorted(found)}"
    assert found[(rows, 4)] == (0, 0), f"gemv_tile<1, {rows}, ..., 4> spills (stores, loads) = {found[(rows, 4)]}"


@needs_nvcc
def test_default_build_has_the_long_instance_and_wide_unrolls_cap_the_rows(tmp_path, monkeypatch):
    assert set(_long_instances("", 4, tmp_path / "default", monkeypatch)) == {(4, 4)}  # the default since v0.32
    assert _long_instances("-DMPK_LONG_ROWS=1", 4, tmp_path / "off", monkeypatch) == {}
    # unroll 16 already keeps 16 loads a lane in flight: R is capped to 1 and the variant adds nothing
    assert _long_instances("", 16, tmp_path / "u16", monkeypatch) == {}
