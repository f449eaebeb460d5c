// Communication micro-benchmark between GPUs (mpk-dist bench-comm; driver: mpk_dist/bench/comm.py).
//
//  * comm_pingpong: one thread of rank 0 and rank 1 bounces a counter ITERS times. Each rank's flag
//    lives in ITS OWN symmetric buffer (the receiver polls local memory); the sender writes it
//    through the CUDA IPC mapping of the peer's buffer. one-way latency = (end - start) / (2 ITERS).
//  * comm_allreduce: a one-shot all-reduce of N bf16 among WORLD ranks, ITERS times back to back in
//    one launch: every block pushes its column block into slot[rank] of every rank's receive buffer
//    (mega-kernel task allreduce_push with 16-byte elements), publishes a per-(block, source rank)
//    flag with a monotonically growing epoch, waits for every rank's flag of its block and sums the
//    WORLD slots in fp32 in rank order (mega-kernel task allreduce_reduce).
//
// Layout constants (CB_*) come from the driver as -D defines: mpk_dist/bench/comm.py LAYOUT is the
// one place they are written. Every wait is bounded (timeout_ns); the first timeout is recorded in
// `status` (an error record read by the host) and later launches return at once.
#include <stdint.h>
#include "common.cuh"
#include "allreduce_push.cuh"
#include "allreduce_reduce.cuh"

#if !defined(CB_PP_FLAG_OFF) || !defined(CB_AR_FLAG_OFF) || !defined(CB_RECV_OFF) || !defined(CB_MAX_WORLD) || \
    !defined(CB_MAX_BLOCKS) || !defined(CB_ST_TIMES) || !defined(CB_ST_AR_EPOCH) || !defined(CB_ST_PP_EPOCH)
#error "comm_bench.cu: compile through mpk_dist.bench.comm.build_kernel (it passes the CB_* layout defines)"
#endif

namespace {

using mpk::bf16;

// Error codes of status[0] (mpk_dist/bench/comm.py ERROR_CODES names them).
constexpr uint32_t kErrPingpongTimeout = 1;
constexpr uint32_t kErrAllreduceTimeout = 2;

// Error record: [0] code, [1] block, [2] rank whose write was awaited, [3] expected, [4] seen,
// [5] iteration, [6] this rank. The first writer wins; the host reads it after the kernel ends.
__device__ void record_timeout(uint32_t* status, uint32_t code, int block, int peer, uint32_t expected,
                               uint32_t seen, int iter, int rank) {
  // acq_rel CAS at system scope: only the first timeout of any block is kept.
  if (mpk::atom_cas_acq_rel_sys(&status[0], 0u, code) != 0u) return;
  status[1] = (uint32_t)block;
  status[2] = (uint32_t)peer;
  status[3] = expected;
  status[4] = seen;
  status[5] = (uint32_t)iter;
  status[6] = (uint32_t)rank;
}

__device__ __forceinline__ uint32_t* flag_at(const uint64_t* peers, int r, size_t off) {
  return reinterpret_cast<uint32_t*>(peers[r] + off);
}

}  // namespace

// One block, one thread. peers[r]: rank r's symmetric buffer as reachable from here. Round trips
// [timed_from, iters) are timed (the first ones line the two ranks up after their launches).
extern "C" __global__ void comm_pingpong(const uint64_t* peers, int rank, int iters, int timed_from,
                                         uint64_t timeout_ns, uint32_t* status) {
  if (threadIdx.x != 0 || blockIdx.x != 0 || rank > 1) return;
  if (status[0] != 0u) return;  // an earlier launch timed out: the peer is gone, do not wait again
  // Counters only grow across launches, so flags never need a reset: this launch uses base+1..base+iters.
  const uint32_t base = status[CB_ST_PP_EPOCH];
  uint32_t* mine = flag_at(peers, rank, CB_PP_FLAG_OFF);
  uint32_t* theirs = flag_at(peers, 1 - rank, CB_PP_FLAG_OFF);
  uint64_t t0 = 0;
  for (int i = 0; i < iters; ++i) {
    if (i == timed_from) t0 = mpk::globaltimer_ns();
    const uint32_t v = base + (uint32_t)i + 1u;
    uint32_t seen = 0;
    // release store into the peer's memory; the peer's acquire load of its own flag pairs with it
    if (rank == 0) mpk::st_release_sys(theirs, v);
    if (mpk::spin_wait_geq_sys_busy(mine, v, timeout_ns, &seen) != 0) {
      record_timeout(status, kErrPingpongTimeout, 0, 1 - rank, v, seen, i, rank);
      return;
    }
    if (rank == 1) mpk::st_release_sys(theirs, v);
  }
  uint64_t* times = reinterpret_cast<uint64_t*>(status + CB_ST_TIMES);
  times[0] = t0;
  times[1] = mpk::globaltimer_ns();
  status[CB_ST_PP_EPOCH] = base + (uint32_t)iters;
}

// gridDim.x blocks (<= CB_MAX_BLOCKS) split the n elements into equal column blocks (n is a
// multiple of 8 * gridDim.x). Receive buffer of each rank: bf16 [2 parities][world][n] at
// CB_RECV_OFF; flags: uint32 [CB_MAX_BLOCKS][CB_MAX_WORLD] at CB_AR_FLAG_OFF, flag[b][src] = the
// last epoch whose block b rank src has pushed here. All-reduces [timed_from, iters) are timed
// by block 0 (the first ones line the ranks up).
extern "C" __global__ void comm_allreduce(const uint64_t* peers, const bf16* in, bf16* out, int rank, int world,
                                          int n, int iters, int timed_from, uint64_t timeout_ns, uint32_t* status) {
  __shared__ uint4* dst[CB_MAX_WORLD];
  __shared__ uint32_t base_epoch;
  __shared__ int failed;
  const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  const int cols = n / gridDim.x, c0 = b * cols;  // this block's column block (elements)
  if (tid == 0) {
    base_epoch = status[CB_ST_AR_EPOCH + b];  // written by this block in the previous launch
    failed = status[0] != 0u;                 // an earlier launch timed out: do not wait again
  }
  __syncthreads();
  if (failed) return;
  uint64_t t0 = 0;
  for (int it = 0; it < iters; ++it) {
    if (it == timed_from && b == 0 && tid == 0) t0 = mpk::globaltimer_ns();
    const uint32_t epoch = base_epoch + (uint32_t)it + 1u;
    // Parity double-buffers the slots: a peer pushes epoch e+2 only after this block signalled e+1,
    // which it does after its reduction of epoch e has read the slots (see the release below).
    const size_t slots = CB_RECV_OFF + (size_t)(epoch & 1u) * world * n * sizeof(bf16);
    if (tid < world) dst[tid] = reinterpret_cast<uint4*>(peers[tid] + slots + ((size_t)rank * n + c0) * sizeof(bf16));
    __syncthreads();
    // 16-byte stores: 8 bf16 per uint4 (the task body copies elements of any type T).
    mpk::allreduce_push<uint4>(reinterpret_cast<const uint4*>(in + c0), dst, world, 1, cols / 8, 0, 0, tid, nt);
    __syncthreads();
    if (tid < world) {
      // fence after the block barrier: the block's pushes (and the previous reduction's reads of the
      // slots) become cumulative into this thread's release store of the flag in rank tid's memory.
      mpk::fence_acq_rel_sys();
      mpk::st_release_sys(flag_at(peers, tid, CB_AR_FLAG_OFF) + (size_t)b * CB_MAX_WORLD + rank, epoch);
      uint32_t seen = 0;
      // acquire on my flag from rank tid: pairs with its release above, so its pushes are visible.
      const uint32_t* mine = flag_at(peers, rank, CB_AR_FLAG_OFF) + (size_t)b * CB_MAX_WORLD + tid;
      if (mpk::spin_wait_geq_sys_busy(mine, epoch, timeout_ns, &seen) != 0) {
        record_timeout(status, kErrAllreduceTimeout, b, tid, epoch, seen, it, rank);
        failed = 1;
      }
    }
    __syncthreads();  // hands each waiting thread's acquired view to the whole block
    if (failed) return;
    const bf16* recv = reinterpret_cast<const bf16*>(peers[rank] + slots) + c0;
    mpk::allreduce_reduce(recv, static_cast<const float*>(nullptr), out + c0, 1, cols, world, n, 0, tid, nt);
    __syncthreads();  // reads of the slots end before the next iteration's release (see parity)
  }
  if (tid == 0) {
    status[CB_ST_AR_EPOCH + b] = base_epoch + (uint32_t)iters;
    if (b == 0) {
      uint64_t* times = reinterpret_cast<uint64_t*>(status + CB_ST_TIMES);
      times[0] = t0;
      times[1] = mpk::globaltimer_ns();
    }
  }
}
