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
    # MPK_SPLIT_PREP_SEQ_OUTLINED follows the register cap (csrc/runtime/dispatch.cuh): outlined at 256 threads
    assert b"split_prep_sequence" in res.cubin, "the split prep's per-sequence function is not a function of its own"
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
def test_kernel_for_tp_programs_compiles_once_for_every_rank(cache):
    """tp 2 and tp 4 programs (tiny: kv_heads 2 < tp 4; qwen3-0.6b shapes) pass the support checks
    and run on the same sm_90a binary: the banner names the rank, the task graph travels as data,
    and the layout asserts cover the peer fields (peer_quota, trace_from, ErrorRecord.peer)."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime import tables
    from mpk_dist.runtime.codegen import tables_hash
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    keys = set()
    for name, tp in (("tiny", 2), ("tiny", 4), ("qwen3-0.6b", 2), ("qwen3-0.6b", 4)):
        cg = compile_rank_programs(get_preset(name), tp=tp, batch=1, sms=132 // tp, max_seq_len=64, ranks=[tp - 1])[0]
        tables.check_supported(cg)
        src, res = build_kernel(KernelShape(batch=1, schedule="aot"), model=name, rank=tp - 1, world=tp,
                                input_hash=tables_hash(cg.arrays), compiler="nvcc")
        assert f"tp rank {tp - 1}/{tp}" in src and res.cubin[:4] == b"\x7fELF"
        for field in ("RuntimeParams, peer_quota", "RuntimeParams, trace_from", "ErrorRecord, peer_expected"):
            assert f"offsetof(mpk::{field})" in src, field
        keys.add(res.key)
    assert len(keys) == 1, "one binary for every rank and tp (only the banner differs)"


@needs_nvcc
def test_compile_error_is_reported(cache):
    """A broken source raises BuildError with the compiler's message."""
    with pytest.raises(build.BuildError, match="nvcc failed"):
        build.compile_source("this is not C++;\n", "broken", compiler="nvcc")


@needs_nvcc
@pytest.mark.parametrize("shape", [KernelShape(batch=1, worker_threads=512, linear_unroll=16),
                                   KernelShape(batch=8, worker_threads=1024, linear_unroll=4, prefetch_kb=64)])
def test_tuned_kernel_variants_compile(cache, shape):
    """The MPK_LINEAR_UNROLL / MPK_WORKER_THREADS variants a GPU sweep may pick build, under their own name."""
    src, res = build_kernel(shape, compiler="nvcc")
    assert f"#define MPK_LINEAR_UNROLL {shape.linear_unroll}" in src and res.cubin[:4] == b"\x7fELF"
    assert f"_t{shape.worker_threads}_" in shape.name()


def test_tuning_knobs_from_env_are_checked():
    """Env overrides reach the kernel shape; a value outside the compiled-for set is one clear error."""
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    assert tuning_from_env(256, {}) == {"linear_unroll": None, "worker_threads": 256, "prefetch_kb": 64}
    assert tuning_from_env(256, {"MPK_LINEAR_UNROLL": "16", "MPK_WORKER_THREADS": "512", "MPK_PREFETCH_KB": "64",
                                 "MPK_ATTN_PREFETCH": "0"}) == \
        {"linear_unroll": 16, "worker_threads": 512, "prefetch_kb": 64, "attn_prefetch": False}
    with pytest.raises(InputError, match="MPK_ATTN_PREFETCH: expected one of 0, 1, got '2'"):
        tuning_from_env(256, {"MPK_ATTN_PREFETCH": "2"})
    with pytest.raises(InputError, match="MPK_PREFETCH_KB"):
        tuning_from_env(256, {"MPK_PREFETCH_KB": "-5"})
    with pytest.raises(InputError, match="MPK_LINEAR_UNROLL: expected one of 4, 8, 16, got '3'"):
        tuning_from_env(256, {"MPK_LINEAR_UNROLL": "3"})
    with pytest.raises(InputError, match="MPK_WORKER_THREADS"):
        tuning_from_env(256, {"MPK_WORKER_THREADS": "many"})
    with pytest.raises(ValueError, match="linear_unroll"):
        render_source(KernelShape(batch=1, linear_unroll=5))
    assert "#define MPK_ATTN_PREFETCH 0" in render_source(KernelShape(batch=1, attn_prefetch=False))
    assert KernelShape(1, attn_prefetch=False).name().endswith("_nap") and "_nap" not in KernelShape(1).name()
    assert "#define MPK_WEIGHT_EVICT_FIRST 1" in render_source(KernelShape(batch=1, weight_evict_first=True))
    assert "#define MPK_WEIGHT_EVICT_FIRST 0" in render_source(KernelShape(batch=1))
    assert KernelShape(1, weight_evict_first=True).name().endswith("_wef") and "_wef" not in KernelShape(1).name()
