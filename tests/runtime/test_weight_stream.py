"""CPU tests of the shared-memory weight stream (csrc/tasks/weight_stream.cuh, MPK_LINEAR_TMA): the
switch puts bulk copies and mbarrier waits into the plain and the fused linear bodies only when on,
the host's ring size equals the CUDA constants at every stage count, the shared-memory budget grows by exactly
the ring, the planned-tiles mode (MPK_LINEAR_TMA=2) flags exactly the tiles behind a narrow op in the task records,
and bench-linear offers the variant (the switch's path to the kernel shape: test_gemv_pipe.py)."""

from __future__ import annotations

import re
import shutil

import pytest

from mpk_dist.bench import linear_alone as LA
from mpk_dist.runtime import tables
from mpk_dist.runtime.build import CSRC
from tests.runtime.test_linear_mma import ptx_of

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
BULK = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
FUSED = """#include "norm_linear.cuh"
extern "C" __global__ void k(const float* x, const mpk::bf16* nw, const mpk::bf16* w, mpk::bf16* y, int K, int n) {
  extern __shared__ float s[];
  mpk::norm_linear(MPK_BATCH, x, K, nw, w, mpk::Epi{y, nullptr, n, mpk::kEpiBf16}, K, n, 1e-6f, s, threadIdx.x,
                   blockDim.x);
}
"""


@needs_nvcc
@pytest.mark.parametrize("tma", [0, 1, 2])
def test_switch_puts_bulk_copies_in_plain_and_fused_linears(tmp_path, tma):
    for source in (LA.HARNESS, FUSED):
        ptx = ptx_of(source, {"MPK_BATCH": 1, "MPK_WORKER_THREADS": 512, "MPK_LINEAR_TMA": tma}, tmp_path)
        assert (BULK in ptx) == bool(tma)
        assert ("mbarrier.try_wait.parity" in ptx) == bool(tma)


def test_worker_primes_before_the_wait_and_drains_after_the_task():
    """The aot worker's prefetch hook starts the ring (stream_prime) for linear tasks, the worker drains an
    unconsumed ring after each task, and the kernel and the bench harness clear the ring state at start."""
    linear = (CSRC / "tasks" / "linear.cuh").read_text()
    prefetch = linear[linear.index("void linear_prefetch("):]
    assert "stream_prime(w, K, n_tile, nt, ring)" in prefetch[:prefetch.index("\n}")]
    worker = (CSRC / "runtime" / "worker.cuh").read_text()
    aot = worker[worker.index("void worker_loop_aot("):worker.index("// ---- just-in-time schedule")]
    assert aot.index("run_and_signal<false>") < aot.index("stream_drain()")
    # MPK_LINEAR_TMA 2: the task's flag is published before its body, on both schedules
    assert aot.index("ring_set_task(") < aot.index("wait_task_events(") < aot.index("run_and_signal<false>")
    jit = worker[worker.index("void worker_loop_jit("):]
    assert jit.index("ring_set_task(") < jit.index("worker_barrier(nt)") < jit.index("run_and_signal<true>")
    assert "stream_reset(tid)" in (CSRC / "runtime" / "megakernel.cuh").read_text()
    assert "stream_reset(threadIdx.x)" in LA.HARNESS


def test_host_ring_size_equals_the_cuda_constants():
    text = (CSRC / "tasks" / "weight_stream.cuh").read_text()
    stages = int(re.search(r"#define MPK_RING_STAGES (\d+)", text).group(1))
    most = int(re.search(r"constexpr int kRingMaxStages = (\d+);", text).group(1))
    kb = int(re.search(r"constexpr uint32_t kRingStageBytes = (\d+) \* 1024;", text).group(1))
    assert (tables.RING_STAGES, tables.RING_STAGE_BYTES, tables.RING_MAX_STAGES) == (stages, kb * 1024, most)
    state = int(re.search(r"constexpr uint32_t kRingStateBytes = (\d+);", text).group(1))
    assert tables.WEIGHT_RING_BYTES == stages * kb * 1024 + 2 * stages * 8 + state
    for n in range(1, most + 1):
        assert tables.weight_ring_bytes(n) == n * kb * 1024 + 2 * n * 8 + state
    for bad in (0, most + 1):
        with pytest.raises(ValueError, match="ring stages"):
            tables.weight_ring_bytes(bad)


@needs_nvcc
def test_kernel_ring_size_follows_mpk_ring_stages(tmp_path):
    """The device's kRingBytes at MPK_RING_STAGES=2 is the host's weight_ring_bytes(2) (a static_assert in a probe)."""
    src = f"""#include "weight_stream.cuh"
static_assert(mpk::kRingBytes == {tables.weight_ring_bytes(2)}u, "ring bytes");
extern "C" __global__ void k() {{}}
"""
    ptx_of(src, {"MPK_BATCH": 1, "MPK_WORKER_THREADS": 512, "MPK_LINEAR_TMA": 2, "MPK_RING_STAGES": 2}, tmp_path)


def test_smem_budget_grows_by_the_ring_and_stays_in_hopper_limits():
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    for name, batch in (("tiny", 4), ("qwen3-0.6b", 16)):
        cg = compile_rank_programs(get_preset(name), tp=1, batch=batch, sms=32, max_seq_len=64, fuse=True)[0]
        off, on = tables.smem_bytes(cg, 512), tables.smem_bytes(cg, 512, weight_ring=True)
        assert on - off <= tables.WEIGHT_RING_BYTES and on <= tables.HOPPER_MAX_DYNAMIC_SMEM
        # the ring sits above everything else: at least its own bytes beyond the reductions' scratch
        assert on >= tables.WEIGHT_RING_BYTES + 2 * 16 * 4


def test_bench_linear_offers_the_streamed_variant_at_every_batch():
    opts = LA.BenchOptions(batches=[1, 8], variants=["scalar", "mma", "tma"])
    assert LA.cases(opts) == [(1, "scalar"), (1, "tma"), (8, "scalar"), (8, "mma"), (8, "tma")]


def test_planned_mode_flags_exactly_the_tiles_behind_a_narrow_op():
    """MPK_LINEAR_TMA=2: ring_tiles marks every tile of the linear ops that wait on a narrow op (o_proj behind
    batch-2 attention; at batch 1 only with MPK_PLAN_BEHIND_ATTENTION), the tiles whose worker runs the attention
    first included, and build_records puts FLAG_STREAM_RING on exactly those records."""
    import numpy as np

    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.prefetch_plan import _narrow_tiles, prefetch_plan, ring_tiles
    from mpk_dist.runtime.task_records import FLAG_STREAM_RING, REC_FLAGS, REC_TASK, build_records
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.compiler import compile_rank_programs
    from mpk_dist.taskgraph.tasks import BY_OPCODE

    for batch, behind, want in ((2, False, True), (1, False, False), (1, True, True)):
        cg = compile_rank_programs(get_preset("qwen3-0.6b"), tp=1, batch=batch, sms=132, max_seq_len=64, fuse=True)[0]
        ring = ring_tiles(cg, 132, behind_attention=behind)
        tasks = cg.arrays["tasks"]
        names = {cg.meta["ops"][int(tasks[t, TASK_COLS["OP_INDEX"]])]["name"].split(".")[-1] for t in np.flatnonzero(ring)}
        assert names == ({"o_proj"} if want else set()), (batch, behind, names)
        if not want:
            continue
        assert set(np.flatnonzero(ring).tolist()) == set(_narrow_tiles(cg, 132, 50 << 20, behind))
        kinds = {BY_OPCODE[int(tasks[t, TASK_COLS["OPCODE"]])].name for t in np.flatnonzero(ring)}
        assert kinds == {"linear_residual"}
        plan = prefetch_plan(cg, 132, 50 << 20, behind_attention=behind)
        assert (plan[ring] == 0).any(), "the tiles whose worker runs the attention first stream too"
        addr = np.zeros(cg.arrays["args"].shape[0], np.uint64)
        rec, _ = build_records(cg, addr, stream_ring=ring)
        flagged = (rec[:, REC_FLAGS] & FLAG_STREAM_RING) != 0
        assert set(rec[flagged, REC_TASK].tolist()) == set(np.flatnonzero(ring).tolist())
        plain, _ = build_records(cg, addr)
        assert not ((plain[:, REC_FLAGS] & FLAG_STREAM_RING) != 0).any()
        with pytest.raises(Exception, match="stream_ring"):
            build_records(cg, addr, stream_ring=ring[:-1])


def test_env_selects_the_mode_and_the_stages_and_refuses_bad_values():
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.codegen import KernelShape, render_source
    from mpk_dist.runtime.megakernel_backend import tuning_from_env

    assert "linear_tma" not in tuning_from_env(512, {}) and "linear_tma" not in tuning_from_env(512, {"MPK_LINEAR_TMA": "0"})
    got = tuning_from_env(512, {"MPK_LINEAR_TMA": "2", "MPK_RING_STAGES": "2"})
    assert (got["linear_tma"], got["ring_stages"]) == (2, 2)
    assert tuning_from_env(512, {"MPK_LINEAR_TMA": "1"})["linear_tma"] == 1
    for env in ({"MPK_LINEAR_TMA": "3"}, {"MPK_LINEAR_TMA": "x"}, {"MPK_LINEAR_TMA": "2", "MPK_RING_STAGES": "5"},
                {"MPK_LINEAR_TMA": "2", "MPK_RING_STAGES": "0"}, {"MPK_RING_STAGES": "2"}):
        with pytest.raises(InputError, match="MPK_LINEAR_TMA|MPK_RING_STAGES"):
            tuning_from_env(512, env)
    shape = KernelShape(1, 512, linear_tma=2, ring_stages=2)
    assert shape.name().endswith("_tma2_rs2")
    src = render_source(shape)
    assert "#define MPK_LINEAR_TMA 2" in src and "#define MPK_RING_STAGES 2" in src
    assert "MPK_RING_STAGES" not in render_source(KernelShape(1, 512, linear_tma=1))  # the default stays out of the key
    with pytest.raises(ValueError, match="linear_tma"):
        render_source(KernelShape(1, 512, linear_tma=3))


def test_smem_grows_by_the_ring_of_the_chosen_stages():
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cg = compile_rank_programs(get_preset("qwen3-0.6b"), tp=1, batch=1, sms=32, max_seq_len=64, fuse=True)[0]
    off = tables.smem_bytes(cg, 512)
    for n in (1, 2, 4):
        assert tables.smem_bytes(cg, 512, weight_ring=True, ring_stages=n) == off + tables.weight_ring_bytes(n)
