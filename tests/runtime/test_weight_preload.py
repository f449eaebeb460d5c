"""CPU test of the weight preload's host side (MPK_WEIGHT_PRELOAD_KB, csrc/tasks/weight_preload.cuh): the knob's
parsing, the kernel shape and its source, the shared-memory room and its limit, and the worker loop's calls."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from mpk_dist.errors import InputError
from mpk_dist.model_source import open_model
from mpk_dist.runtime import session as S
from mpk_dist.runtime import tables
from mpk_dist.runtime.codegen import WEIGHT_PRELOAD_MAX_KB, KernelShape, render_source
from mpk_dist.runtime.megakernel_backend import tuning_from_env
from mpk_dist.taskgraph.compiler import compile_rank_programs

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def test_shape_names_and_defines_the_preload():
    shape = KernelShape(batch=1, worker_threads=512, weight_preload_kb=96)
    assert shape.name().endswith("_wp96")
    assert "#define MPK_WEIGHT_PRELOAD_KB 96" in render_source(shape)
    plain = KernelShape(batch=1, worker_threads=512)
    assert "_wp" not in plain.name() and "#define MPK_WEIGHT_PRELOAD_KB 0" in render_source(plain)


@pytest.mark.parametrize("fields, match", [
    ({"weight_preload_kb": 100}, "multiple of 16"),
    ({"weight_preload_kb": WEIGHT_PRELOAD_MAX_KB + 16}, "multiple of 16"),
    ({"weight_preload_kb": 64, "batch": 2}, "batch-1 kernels only"),
    ({"weight_preload_kb": 64, "linear_tma": True}, "exclude each other"),
])
def test_source_refuses_a_preload_it_cannot_build(fields, match):
    shape = KernelShape(**{"batch": 1, "worker_threads": 512, **fields})
    with pytest.raises(ValueError, match=match):
        render_source(shape)


def test_environment_sets_the_preload_only_when_asked():
    assert "weight_preload_kb" not in tuning_from_env(512, {})
    assert "weight_preload_kb" not in tuning_from_env(512, {"MPK_WEIGHT_PRELOAD_KB": "0"})
    assert tuning_from_env(512, {"MPK_WEIGHT_PRELOAD_KB": "96"})["weight_preload_kb"] == 96
    for bad in ("96k", "100", str(WEIGHT_PRELOAD_MAX_KB + 16)):
        with pytest.raises(InputError, match="MPK_WEIGHT_PRELOAD_KB: expected a multiple of 16"):
            tuning_from_env(512, {"MPK_WEIGHT_PRELOAD_KB": bad})


def _program(batch):
    m = open_model("tiny")
    return compile_rank_programs(m.config, tp=1, batch=batch, sms=4, max_seq_len=16)[0]


def test_kernel_shape_keeps_the_preload_at_batch_1_only():
    assert S.kernel_shape(_program(1), 512, "aot", weight_preload_kb=64).weight_preload_kb == 64
    assert S.kernel_shape(_program(2), 512, "aot", weight_preload_kb=64).weight_preload_kb == 0


def test_shared_memory_adds_the_region_and_refuses_what_does_not_fit():
    cg = _program(1)
    base = tables.smem_bytes(cg, 512)
    assert tables.smem_bytes(cg, 512, preload_bytes=96 * 1024) == base + 96 * 1024
    too_big = tables.HOPPER_MAX_DYNAMIC_SMEM - tables.SMEM_RESERVE - base + 16 * 1024
    with pytest.raises(InputError, match="MPK_WEIGHT_PRELOAD_KB=.*at most"):
        tables.smem_bytes(cg, 512, preload_bytes=too_big)


def test_session_launches_with_the_region(fake_gpu, monkeypatch):
    shapes = []
    monkeypatch.setattr(S, "build_kernel", lambda shape, **k: shapes.append(shape) or (
        "src", types.SimpleNamespace(cubin=b"", cached=True, compiler="fake", path="x")))
    monkeypatch.setenv("MPK_WEIGHT_PRELOAD_KB", "64")
    m = open_model("tiny")
    sess = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16).session(1)
    assert shapes[-1].weight_preload_kb == 64
    assert sess.smem == tables.smem_bytes(sess.cg, sess.block_threads, preload_bytes=64 * 1024)


def test_worker_preloads_only_the_waiting_task_and_settles_after_it():
    loop = (CSRC / "runtime" / "worker.cuh").read_text()
    aot = loop[loop.index("__device__ void worker_loop_aot("):loop.index("__device__ void queue_up_to(")]
    assert "prefetch_task(p, rec, rec[REC_PREFETCH], true, tid, nt)" in aot
    assert "prefetch_task(p, recs[slot ^ 1], rec[REC_PREFETCH_NEXT], false, tid, nt)" in aot
    assert aot.index("run_and_signal<false>") < aot.index("preload_settle();") < aot.index("slot ^= 1;")
    assert "preload_clear(tid)" in (CSRC / "runtime" / "megakernel.cuh").read_text()
    gemv = (CSRC / "tasks" / "fused_gemv.cuh").read_text()
    tile = gemv[gemv.index("__device__ __noinline__ void gemv_tile("):]
    assert tile.index("preload_ready(nt);") < tile.index("stream_fits(K, nt)"), "the barrier before any early return"
