"""CPU tests of the build path: generated sources compile for sm_90a with nvcc (so CUDA build errors
fail CI without a GPU), the cache key follows every included header, cached builds are reused."""

from __future__ import annotations

import shutil

import pytest

from mpk_dist.runtime import build
from mpk_dist.runtime.codegen import KernelShape, render_source, source_for_key
from mpk_dist.runtime.kernel import abi_include_dir, build_kernel

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    return tmp_path


@needs_nvcc
@pytest.mark.parametrize("shape", [KernelShape(batch=1, schedule="aot"), KernelShape(batch=16, schedule="jit")])
def test_generated_kernel_compiles_for_sm90a(cache, shape):
    """The whole mega-kernel (runtime + every task body + layout static_asserts) builds with nvcc."""
    src, res = build_kernel(shape, compiler="nvcc")
    assert not res.cached and res.cubin[:4] == b"\x7fELF", "expected a fresh ELF cubin"
    assert res.path.is_file()
    names = {p.name for p in res.headers}
    for h in ("sync.cuh", "worker.cuh", "dispatch.cuh", "linear.cuh", "attention.cuh", "abi_generated.h"):
        assert h in names, f"{h} missing from the headers hashed into the cache key"
    again_src, again = build_kernel(shape, compiler="nvcc")
    assert again.cached and again.key == res.key and again.cubin == res.cubin


def test_cache_key_covers_headers_flags_and_banner_rules(tmp_path):
    """Editing an included header, a flag or the arch changes the key; the banner does not."""
    hdr_dir = tmp_path / "inc"
    hdr_dir.mkdir()
    (hdr_dir / "a.cuh").write_text('#include "b.cuh"\n')
    (hdr_dir / "b.cuh").write_text("// v1\n")
    src = '#include "a.cuh"\n'
    heads = build.included_headers(src, [hdr_dir])
    assert [p.name for p in heads] == ["a.cuh", "b.cuh"], "transitive includes must be found"
    k1 = build.cache_key(src, heads, ("-O3",), "sm_90a", "nvcc 13.0")
    (hdr_dir / "b.cuh").write_text("// v2\n")
    assert build.cache_key(src, heads, ("-O3",), "sm_90a", "nvcc 13.0") != k1
    assert build.cache_key(src, heads, ("-O2",), "sm_90a", "nvcc 13.0") != build.cache_key(src, heads, ("-O3",), "sm_90a", "nvcc 13.0")
    assert build.cache_key(src, heads, ("-O3",), "sm_90", "nvcc 13.0") != build.cache_key(src, heads, ("-O3",), "sm_90a", "nvcc 13.0")
    a = render_source(KernelShape(1), model="m1", input_hash="x")
    b = render_source(KernelShape(1), model="m2", input_hash="y")
    assert a != b and source_for_key(a) == source_for_key(b)
    assert source_for_key(render_source(KernelShape(2))) != source_for_key(a)


def test_generated_source_is_wiring_and_deterministic():
    """Includes the generated ABI header, fixes the compile-time shape, asserts the host layouts."""
    s1, s2 = render_source(KernelShape(4, 128, "jit")), render_source(KernelShape(4, 128, "jit"))
    assert s1 == s2
    assert '#include "abi_generated.h"' in s1 and "#define MPK_BATCH 4" in s1 and "#define MPK_SCHEDULE_JIT 1" in s1
    assert "static_assert(offsetof(mpk::RuntimeParams, timeout_ns)" in s1
    with pytest.raises(ValueError, match="schedule"):
        render_source(KernelShape(1, 256, "eager"))


def test_abi_header_written_once(cache):
    from mpk_dist.taskgraph.abi import render_cuda_abi_header

    d = abi_include_dir()
    assert (d / "abi_generated.h").read_text() == render_cuda_abi_header()
    assert abi_include_dir() == d


@needs_nvcc
def test_compile_error_is_reported(cache):
    """A broken source raises BuildError with the compiler's message."""
    with pytest.raises(build.BuildError, match="nvcc failed"):
        build.compile_source("this is not C++;\n", "broken", compiler="nvcc")
