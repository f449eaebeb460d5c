"""CPU tests of the shared-memory weight stream (csrc/tasks/weight_stream.cuh, MPK_LINEAR_TMA): the
switch puts bulk copies and mbarrier waits into the plain and the fused linear bodies only when on,
the host's ring size equals the CUDA constants, the shared-memory budget grows by exactly the ring,
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
@pytest.mark.parametrize("tma", [0, 1])
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
    assert "stream_prime(w, K, n_tile, nt)" in prefetch[:prefetch.index("\n}")]
    worker = (CSRC / "runtime" / "worker.cuh").read_text()
    aot = worker[worker.index("void worker_loop_aot("):worker.index("// ---- just-in-time schedule")]
    assert aot.index("run_and_signal<false>") < aot.index("stream_drain()")
    assert "stream_reset(tid)" in (CSRC / "runtime" / "megakernel.cuh").read_text()
    assert "stream_reset(threadIdx.x)" in LA.HARNESS


def test_host_ring_size_equals_the_cuda_constants():
    text = (CSRC / "tasks" / "weight_stream.cuh").read_text()
    stages = int(re.search(r"constexpr int kRingStages = (\d+);", text).group(1))
    kb = int(re.search(r"constexpr uint32_t kRingStageBytes = (\d+) \* 1024;", text).group(1))
    assert (tables.RING_STAGES, tables.RING_STAGE_BYTES) == (stages, kb * 1024)
    state = int(re.search(r"constexpr uint32_t kRingStateBytes = (\d+);", text).group(1))
    assert tables.WEIGHT_RING_BYTES == stages * kb * 1024 + 2 * stages * 8 + state


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
