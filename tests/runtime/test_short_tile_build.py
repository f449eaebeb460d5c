"""The short tiles' loads a round (-DMPK_SHORT_TILE_LOADS=U, csrc/tasks/fused_gemv.cuh gemv_rows; off by default):
with nvcc, the batch-1 kernel at unroll 4 gets a one-row GEMV instance of U loads a row instead of the unroll's
one-row instance, and ptxas spills nothing in it at 256 threads (255 registers) nor at 512 (128 registers, U = 12);
without the define, or at an unroll as wide as U, there is no such instance. Speed and sums measured on the GPU
(docs/PERF.md v0.38, tests/runtime/test_code_variants_gpu.py)."""

from __future__ import annotations

import re

import pytest

from tests.runtime.test_attn_prep_build import _spills, needs_nvcc

# gemv_tile<1, R, XRows, Epi, UR> as ptxas names it: _ZN3mpk9gemv_tileILi1ELi<R>ENS_5XRowsENS_3EpiELi<UR>EEEv...
_INSTANCE = re.compile(r"_ZN3mpk9gemv_tileILi1ELi(\d+)ENS_5XRowsENS_3EpiELi(\d+)E")


def _gemv_instances(extra: str, threads: int, unroll: int, tmp_path, monkeypatch) -> dict[tuple[int, int], tuple[int, int]]:
    """{(R, UR): (spill stores, spill loads)} of every gemv_tile<1, R, XRows, Epi, UR> instance of the batch-1 build."""
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", f"-Xptxas -v {extra}".strip())
    _, res = build_kernel(KernelShape(batch=1, worker_threads=threads, schedule="aot", linear_unroll=unroll),
                          compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    return {(int(m.group(1)), int(m.group(2))): v for k, v in _spills(res.log).items() if (m := _INSTANCE.match(k))}


@needs_nvcc
@pytest.mark.parametrize("threads, loads", [(256, 16), (512, 12)])
def test_short_tile_loads_replace_the_one_row_instance_without_spills(threads, loads, tmp_path, monkeypatch):
    found = _gemv_instances(f"-DMPK_SHORT_TILE_LOADS={loads}", threads, 4, tmp_path, monkeypatch)
    assert (1, loads) in found, f"no gemv_tile<1, 1, ..., {loads}> in the log: {sorted(found)}"
    assert (1, 0) not in found, f"the unroll's one-row instance is still built: {sorted(found)}"
    assert found[(1, loads)] == (0, 0), f"gemv_tile<1, 1, ..., {loads}> spills (stores, loads) = {found[(1, loads)]}"


@needs_nvcc
def test_default_and_wide_unroll_builds_keep_the_unrolls_one_row_instance(tmp_path, monkeypatch):
    default = _gemv_instances("", 256, 4, tmp_path / "default", monkeypatch)
    assert (1, 0) in default and not any(r == 1 and u > 0 for r, u in default), sorted(default)
    # unroll 16 already issues 16 loads a round: the define adds nothing there
    wide = _gemv_instances("-DMPK_SHORT_TILE_LOADS=16", 256, 16, tmp_path / "u16", monkeypatch)
    assert (1, 0) in wide and (1, 16) not in wide, sorted(wide)
