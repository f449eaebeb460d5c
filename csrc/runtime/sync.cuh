// Memory-ordering helpers of the mega-kernel: the ONLY place where atomics, fences and spin-waits
// are written. Every other header calls these, so every ordering decision is visible here.
//
// Conventions (PTX memory model):
//  * "gpu" scope orders against other blocks of this kernel (events between SMs of one GPU).
//  * "sys" scope orders against the host (mapped pinned memory) and peer GPUs (symmetric buffers).
//  * A producer block writes its outputs with ordinary stores, joins a block barrier, then ONE
//    thread publishes with a release (fence + atomic add). A consumer's ONE thread spins with an
//    acquire load, then the block barrier hands the acquired view to every thread of the block.
#pragma once
#include <stdint.h>

namespace mpk {

// ---- timers --------------------------------------------------------------------------------
// %globaltimer: nanoseconds, same clock on every SM (coarse ticks, ~1 us on some parts); used for
// timeouts and trace timestamps. Not an ordering operation.
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t smid() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// ---- loads ---------------------------------------------------------------------------------
// Acquire load at gpu scope: later loads of this thread see every write that happened before the
// matching gpu-scope release (an event increment by another block).
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Acquire load at system scope: as above, against releases by the host or peer GPUs.
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Relaxed load at gpu scope: a fresh (not L1-stale) value with no ordering; for polling the abort
// flag, where only "eventually seen" matters.
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_relaxed_gpu(const int32_t* p) {
  return (int32_t)ld_relaxed_gpu((const uint32_t*)p);
}

// Relaxed load at system scope: a fresh value of a word that a peer GPU (or another process on
// this GPU) writes; no ordering. Used only by the watchdog to read peers' signal tallies.
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- stores --------------------------------------------------------------------------------
// Release store at gpu scope: every earlier write of this thread is visible to a block that
// acquires this word (queue tails, slot publication).
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Release store at system scope: earlier writes (tokens, error record) are visible to the host
// (or a peer GPU) once it reads this word.
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Relaxed store at gpu scope: resetting a ticket word (ticket_last) whose next users are ordered after
// this block through the event chain, so no release is needed.
__device__ __forceinline__ void st_relaxed_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Relaxed store at system scope: a single word that the host polls; ordered by a later release.
__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Four fp32 adds into [p, p + 4) (16-byte aligned) as one relaxed gpu-scope vector reduction (sm_90): the value is not
// returned, so the SM does not wait for it; the task's release (fence + signal) orders it like its stores.
__device__ __forceinline__ void red_add_v4_f32(float* p, float4 v) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w) : "memory");
}

// A flagged word (value, step tag: csrc/tasks/flag_words.cuh) at gpu scope: one 64-bit relaxed store, so a reader's
// 64-bit relaxed load (below) sees the whole word or none of it (single-copy atomicity of an aligned 8-byte access).
// No fence: the word carries its own readiness, and no other data is published through it.
__device__ __forceinline__ void st_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The matching load: a fresh (not L1-stale) 64-bit word, no ordering.
__device__ __forceinline__ uint64_t ld_relaxed_gpu_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ---- atomics -------------------------------------------------------------------------------
// Release add at gpu scope, returning the old value: publishes this thread's earlier writes (and,
// through the preceding block barrier, the whole block's) to whoever acquires the counter.
__device__ __forceinline__ uint32_t atom_add_release_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Release add at system scope: as above, visible to peer GPUs and the host.
__device__ __forceinline__ uint32_t atom_add_release_sys(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.release.sys.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Acquire-release add at gpu scope: publishes like the release add AND acquires what earlier adds
// to the same counter published; jit mode uses it so the block that completes an event (and then
// hands it to a scheduler) carries every producer's writes along the chain.
__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Relaxed add at gpu scope: claiming a slot (queue head) where ordering comes from a later release.
__device__ __forceinline__ uint32_t atom_add_relaxed_gpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.relaxed.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// Relaxed reductions (no return value): after a fence.acq_rel of the same scope they are a release
// pattern (PTX memory model), so a signal needs no second fence inside the add and the signalling
// thread does not wait for the add's round trip (the aot worker's event signals).
__device__ __forceinline__ void red_add_relaxed_gpu(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Relaxed reduction (no return value) at system scope: the aot worker's system-scope signals (after a
// fence.acq_rel.sys, as above), and a diagnostic tally that peers read after a
// timeout (watchdog), so only "eventually visible" matters; it orders nothing.
__device__ __forceinline__ void red_add_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Compare-and-swap with acq_rel at system scope: the first writer of the error record wins; the
// host reads the record after seeing the code word.
__device__ __forceinline__ uint32_t atom_cas_acq_rel_sys(uint32_t* p, uint32_t cmp, uint32_t v) {
  uint32_t old;
  asm volatile("atom.cas.acq_rel.sys.global.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(v) : "memory");
  return old;
}

// Minimum into a shared-memory word (block scope): the threads of one block agree on one value (the
// first bad entry page_alloc found) without a barrier per write; the block barrier after the phase
// orders it before anyone reads the word. No ordering of other memory.
__device__ __forceinline__ void atom_min_shared(int* p, int v) { atomicMin(p, v); }

// ---- fences --------------------------------------------------------------------------------
// Full acq_rel fence at gpu scope: after a block barrier, makes the block's writes (seen by this
// thread through the barrier) cumulative into the following release; after an acquire, orders the
// block's following reads.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// The same at system scope (host-visible data, peer GPUs).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---- tickets -------------------------------------------------------------------------------
// Ticket of a group of `group` blocks (called by thread 0 after a block barrier): fence (the block's
// writes, seen through the barrier, become cumulative) + acquire-release add. True for the block whose
// add completes the group: it has acquired every earlier member's writes, and it resets the word for
// the next use (that next use is ordered after this block's signals by the event chain: relaxed store).
__device__ __forceinline__ bool ticket_last(uint32_t* word, uint32_t group) {
  fence_acq_rel_gpu();
  if (atom_add_acq_rel_gpu(word, 1u) + 1u != group) return false;
  st_relaxed_gpu(word, 0u);
  return true;
}

// Block barrier among the worker threads only (named barrier 1): the scheduler warp of a block in
// jit mode never joins it. Orders shared- and global-memory accesses of the participating threads.
__device__ __forceinline__ void worker_barrier(int num_threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(num_threads) : "memory");
}

// The same barrier, returning whether any participating thread passed `v` true (bar.red.or).
__device__ __forceinline__ bool worker_barrier_or(int num_threads, bool v) {
  uint32_t r;
  asm volatile("{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, 1, %2, p;\n selp.u32 %0, 1, 0, q;\n}"
               : "=r"(r) : "r"((uint32_t)v), "r"(num_threads) : "memory");
  return r != 0;
}

// ---- bounded spin-wait ---------------------------------------------------------------------
// Wait until *counter >= target (unsigned, counters only grow), at gpu scope with acquire.
// Returns 0 when satisfied, 1 on timeout, 2 when another block raised the abort flag. Never spins
// forever: every MPK_SPIN_CHECK polls it reads the clock and the abort flag.
#ifndef MPK_SPIN_CHECK
#define MPK_SPIN_CHECK 64
#endif
// Sleep between polls: starts at MPK_SPIN_SLEEP_NS and doubles up to MPK_SPIN_SLEEP_MAX_NS (equal by
// default: a flat 32 ns). A longer cap thins the polling of a hot counter (every waiting SM polls the
// same event) at the price of a later wake-up; an experiment knob (-D through MPK_NVCC_EXTRA_FLAGS). 0 issues no
// __nanosleep at all (a 0 ns sleep still costs the instruction): csrc/bench/event_wake.cu measured acquire loads back
// to back waking the last waiter 1.54 us after the signal under HBM load vs 2.30 us with the 32 ns sleep.
#ifndef MPK_SPIN_SLEEP_NS
#define MPK_SPIN_SLEEP_NS 32
#endif
#ifndef MPK_SPIN_SLEEP_MAX_NS
#define MPK_SPIN_SLEEP_MAX_NS MPK_SPIN_SLEEP_NS
#endif
// MPK_SPIN_INFLIGHT K > 1 (a measurement variant, off): K relaxed polls of the counter in flight, first issued
// kSpinStaggerCycles / K apart, each tested when it is back and reissued (so they stay apart); the one that sees the
// target is followed by fence.acq_rel.gpu (a relaxed load that observed the release, then the fence: the PTX acquire
// pattern). Why: one acquire load at a time leaves a poll every memory round trip, so the SMs waiting on one event
// see its last signal up to a round trip apart (a level's tiles start 0.7-0.8 us apart, docs/PERF.md v0.31); K
// staggered polls sample K times as often. csrc/bench/event_wake.cu measures both (and the fence) alone.
#ifndef MPK_SPIN_INFLIGHT
#define MPK_SPIN_INFLIGHT 1
#endif
constexpr long long kSpinStaggerCycles = 1024;  // ~0.5 us at 1.98 GHz: about a loaded L2 round trip

// Slots J.. of the polls: the first that saw `target` ends it (true, *seen = its value); each other slot, once its
// load is back, is reissued. Recursion over a constant J keeps every slot in a register: a loop over j with the
// early exit was not unrolled, and its slots went to local memory (42 STL in the kernel entry, nvdisasm).
template <int J, int K>
__device__ __forceinline__ bool poll_slots(uint32_t (&v)[K], const uint32_t* counter, uint32_t target, uint32_t* seen) {
  if ((int32_t)(v[J] - target) >= 0) {
    *seen = v[J];
    return true;
  }
  v[J] = ld_relaxed_gpu(counter);
  if constexpr (J + 1 < K) return poll_slots<J + 1, K>(v, counter, target, seen);
  return false;
}

// The first issue of slots J..: kSpinStaggerCycles / K apart.
template <int J, int K>
__device__ __forceinline__ void issue_slots(uint32_t (&v)[K], const uint32_t* counter) {
  v[J] = ld_relaxed_gpu(counter);
  if constexpr (J + 1 < K) {
    const long long c = clock64();
    while (clock64() - c < kSpinStaggerCycles / K) {}
    issue_slots<J + 1, K>(v, counter);
  }
}

template <int K>
__device__ __forceinline__ int spin_wait_geq_gpu_inflight(const uint32_t* counter, uint32_t target,
                                                          uint64_t timeout_ns, const uint32_t* halt, uint32_t* seen) {
  const uint64_t start = globaltimer_ns();
  uint32_t v[K];
  issue_slots<0, K>(v, counter);
  for (uint32_t iter = 1;; ++iter) {
    if (poll_slots<0, K>(v, counter, target, seen)) {
      fence_acq_rel_gpu();  // with the relaxed load that saw the count: acquire
      return 0;
    }
    if ((iter % MPK_SPIN_CHECK) == 0) {
      if (globaltimer_ns() - start > timeout_ns) { *seen = v[0]; return 1; }
      if (ld_relaxed_gpu(halt) != 0) { *seen = v[0]; return 2; }
    }
  }
}

__device__ __forceinline__ int spin_wait_geq_gpu(const uint32_t* counter, uint32_t target, uint64_t timeout_ns,
                                                 const uint32_t* halt, uint32_t* seen) {
  if constexpr (MPK_SPIN_INFLIGHT > 1)
    return spin_wait_geq_gpu_inflight<MPK_SPIN_INFLIGHT>(counter, target, timeout_ns, halt, seen);
  uint64_t start = 0;
  uint32_t sleep_ns = MPK_SPIN_SLEEP_NS;
  for (uint32_t iter = 0;; ++iter) {
    uint32_t v = ld_acquire_gpu(counter);  // acquire: pairs with the producers' release add
    if ((int32_t)(v - target) >= 0) { *seen = v; return 0; }
    if ((iter % MPK_SPIN_CHECK) == 0) {
      uint64_t now = globaltimer_ns();
      if (iter == 0) start = now;
      else if (now - start > timeout_ns) { *seen = v; return 1; }
      if (ld_relaxed_gpu(halt) != 0) { *seen = v; return 2; }
    }
    if constexpr (MPK_SPIN_SLEEP_NS > 0) {  // 0: the next acquire load straight away (no sleep instruction)
      __nanosleep(sleep_ns);
      if (sleep_ns < MPK_SPIN_SLEEP_MAX_NS) sleep_ns *= 2;
    }
  }
}

// The same against a system-scope producer (a peer GPU's release add on a symmetric buffer).
__device__ __forceinline__ int spin_wait_geq_sys(const uint32_t* counter, uint32_t target, uint64_t timeout_ns,
                                                 const uint32_t* halt, uint32_t* seen) {
  uint64_t start = 0;
  for (uint32_t iter = 0;; ++iter) {
    uint32_t v = ld_acquire_sys(counter);  // acquire: pairs with the peer's system-scope release
    if ((int32_t)(v - target) >= 0) { *seen = v; return 0; }
    if ((iter % MPK_SPIN_CHECK) == 0) {
      uint64_t now = globaltimer_ns();
      if (iter == 0) start = now;
      else if (now - start > timeout_ns) { *seen = v; return 1; }
      if (ld_relaxed_gpu(halt) != 0) { *seen = v; return 2; }
    }
    __nanosleep(64);
  }
}

// Busy-wait (no sleep, no abort flag) until *counter >= target, acquire at system scope: for
// latency measurements (csrc/bench/), where __nanosleep would add to the figure being measured.
// Still bounded: the clock is read every MPK_SPIN_CHECK polls. Returns 0 when satisfied, 1 on
// timeout; *seen gets the last value read.
__device__ __forceinline__ int spin_wait_geq_sys_busy(const uint32_t* counter, uint32_t target, uint64_t timeout_ns,
                                                      uint32_t* seen) {
  uint64_t start = 0;
  for (uint32_t iter = 0;; ++iter) {
    uint32_t v = ld_acquire_sys(counter);  // acquire: pairs with the peer's system-scope release
    if ((int32_t)(v - target) >= 0) { *seen = v; return 0; }
    if ((iter % MPK_SPIN_CHECK) == 0) {
      uint64_t now = globaltimer_ns();
      if (iter == 0) start = now;
      else if (now - start > timeout_ns) { *seen = v; return 1; }
    }
  }
}

// ---- shared-memory barriers and bulk copies (Hopper; the weight stream, weight_stream.cuh) ----------
// An mbarrier is a 64-bit word in shared memory. A bulk copy (cp.async.bulk, the TMA engine's 1-D form)
// moves a contiguous global range into shared memory and signals completion on an mbarrier as
// "transaction bytes"; the waiting side acquires that data with mbarrier.try_wait (cta scope).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without registers (cp.async, L2 only): the task-record copy. The copying
// thread's cp_async_wait_all() makes the bytes visible to it; a block barrier after that hands them on.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem_dst)), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes mbarrier.init visible to the async proxy (the bulk-copy engine) before any copy uses it.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also announces `bytes` of transactions the phase must see before it completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One arrival with release semantics (cta scope): this thread's reads of the slot happen before.
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Block-local flags in shared memory (cta scope): the writer's earlier operations, barrier waits
// included, happen before any read that sees the value.
__device__ __forceinline__ void st_release_cta_shared(int32_t* p, int32_t v) {
  asm volatile("st.release.cta.shared::cta.b32 [%0], %1;" ::"r"(smem_addr(p)), "r"(v) : "memory");
}

__device__ __forceinline__ int32_t ld_acquire_cta_shared(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.cta.shared::cta.b32 %0, [%1];" : "=r"(v) : "r"(smem_addr(p)) : "memory");
  return v;
}

// True once the phase with parity `parity` has completed (acquire, cta scope). A parity names one of
// only two phases: a waiter must know the barrier has reached the phase before the one it wants (or
// the wait returns at once for the phase before that), see weight_stream.cuh's armed tags.
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Bounded wait for a phase of a block-local barrier: the bytes it waits for come from this SM's own
// bulk copies (or its own warps), never from another block, so the bound only catches a bug; on
// expiry the block traps with a message naming the wait (the host reports the launch failure).
constexpr uint64_t kMbarWaitLimitNs = 2000000000ull;  // 2 s
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, const char* what) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = globaltimer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (globaltimer_ns() - t0 > kMbarWaitLimitNs) {
      printf("mpk: block %d thread %d: shared-memory barrier wait (%s, parity %u) timed out\n", (int)blockIdx.x,
             (int)threadIdx.x, what, parity);
      __trap();
    }
  }
}

// Bounded wait until a block-local shared-memory flag holds `value` (acquire, cta scope).
__device__ __forceinline__ void smem_wait_eq(const int32_t* flag, int32_t value, const char* what) {
  if (ld_acquire_cta_shared(flag) == value) return;
  const uint64_t t0 = globaltimer_ns();
  while (ld_acquire_cta_shared(flag) != value) {
    if (globaltimer_ns() - t0 > kMbarWaitLimitNs) {
      printf("mpk: block %d thread %d: shared-memory flag wait (%s == %d, saw %d) timed out\n", (int)blockIdx.x,
             (int)threadIdx.x, what, value, ld_acquire_cta_shared(flag));
      __trap();
    }
  }
}

// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into this
// block's shared memory, completing as transactions on `bar`.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

}  // namespace mpk
