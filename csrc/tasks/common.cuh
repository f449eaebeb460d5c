// Shared helpers of the task bodies: bf16 conversions, 16-byte loads, warp reductions.
// Task bodies run on the worker threads of one block (blockDim.x may hold an extra scheduler warp
// that never enters a task); `nt` is always the worker thread count and `tid` < nt.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include "sync.cuh"

// MPK_SILU_DOWN 1: the program folds its down projections into the gate|up tiles (fusion 'silu_down'; the host
// defines it for such programs only, runtime.kernel): csrc/tasks/down_partial.cuh and the copy output of
// linear_residual. 0: none of that code is compiled.
#ifndef MPK_SILU_DOWN
#define MPK_SILU_DOWN 0
#endif

namespace mpk {

typedef __nv_bfloat16 bf16;

// Bytes of dynamic shared memory of this launch (the host sizes it from the task graph).
__device__ __forceinline__ uint32_t launch_smem_bytes() {
  uint32_t r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}

__device__ __forceinline__ float bf2f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 f2bf(float v) { return __float2bfloat16_rn(v); }
// Round a float to the nearest bf16 and back: reproduces torch's bf16 intermediate results.
__device__ __forceinline__ float round_bf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// Output stores for the two output dtypes the graph uses (bf16 activations; fp32 logits and the
// fp32 residual stream), and the matching loads.
__device__ __forceinline__ void store_out(bf16* p, float v) { *p = f2bf(v); }
__device__ __forceinline__ void store_out(float* p, float v) { *p = v; }
__device__ __forceinline__ float load_f(const bf16* p) { return bf2f(*p); }
__device__ __forceinline__ float load_f(const float* p) { return *p; }

// 16-byte streaming load of read-only data (weights): never written during the kernel, so the
// non-coherent path is legal; no L1 allocation since each byte is used once per step.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// MPK_WEIGHT_EVICT_FIRST 1: the linear tiles' weight streams (ld_weight_v4) mark their L2 lines first to go.
// Why: a step streams every weight byte once (qwen3-8b: ~420 MB a layer through a 60 MB L2), so a weight line
// is never read again in the step, yet at normal priority it evicts what is: the task code (fetched cold every
// layer: ncu's "no instruction" stalls of the prep), the cache rows prefetched before an attention tile's
// wait, the norm weights, the activations. A hint only: the same bytes arrive, so the same bits.
#ifndef MPK_WEIGHT_EVICT_FIRST
#define MPK_WEIGHT_EVICT_FIRST 0
#endif

// The L2 policy "evict first" for the whole access (the fraction 1.0): a 64-bit descriptor the loads carry.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}

// 16-byte load of a linear tile's weights: ld_stream_v4, with the L2 policy above under MPK_WEIGHT_EVICT_FIRST.
// (sm_90 takes an L2 eviction priority on a 16-byte load only as a cache-hint policy operand.)
__device__ __forceinline__ uint4 ld_weight_v4(const void* p) {
#if MPK_WEIGHT_EVICT_FIRST
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(l2_policy_evict_first()));
  return r;
#else
  return ld_stream_v4(p);
#endif
}

// 16-byte load of an activation written earlier in this kernel by another block. A plain (weak,
// coherent-path) load: visibility comes from the acquire the block performed before the task.
__device__ __forceinline__ uint4 ld_act_v4(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// Unpack 8 bf16 held in a uint4 into floats.
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

// Dot product of 8 bf16 pairs in fp32.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  float fa[8], fb[8];
  unpack8(a, fa);
  unpack8(b, fb);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(fa[i], fb[i], s);
  return s;
}

constexpr unsigned kFullWarp = 0xffffffffu;  // every lane of a warp (shuffle masks)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullWarp, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullWarp, v, o));
  return v;
}

// MPK_ROPE_SINCOS 1: a rope angle's cosine and sine from one sincosf (one argument reduction, one copy of its
// rarely taken large-argument path, which inlined per call holds local-memory tables and double-precision code)
// instead of cosf and sinf. Why: the prep bodies are straight-line code fetched cold every layer (see below), and
// each trig call inlines that slow path. CUDA's sincosf gives the values of sinf and cosf; the GPU test
// (tests/runtime/test_code_variants_gpu.py, -DMPK_ROPE_SINCOS=0) checks the logits bit for bit.
#ifndef MPK_ROPE_SINCOS
#define MPK_ROPE_SINCOS 1
#endif
// MPK_ROPE_FAST 1 (an experiment, off; not exact): the hardware's approximate __sincosf, which has no slow path at
// all, to measure what the trig code costs the prep bodies before replacing it with an exact table.
#ifndef MPK_ROPE_FAST
#define MPK_ROPE_FAST 0
#endif
// MPK_ROPE_NEAR 1 (a measurement variant, off; the same bits): sincosf inlined only for angles up to
// kRopeNearAngle, told to the compiler with __builtin_assume so that its large-argument path (local-memory tables,
// double precision) drops out of the inlined copy; larger angles (positions past 65,536 at the highest frequency)
// call the whole sincosf in one non-inlined function. CUDA's sincosf takes its fast path on both sides of the bound
// (the assume folds its test away), so every angle gets the value it had. Why: each inlined sincosf is ~100 SASS
// instructions of which the fast path is ~45 (4 calls: 416 -> 186 plus one 118-instruction copy, nvdisasm), and the
// prep bodies are straight-line code fetched cold every layer (see below; v0.20's approximate __sincosf stand-in
// measured what the trig code costs them: -0.5 to -1.4%).
#ifndef MPK_ROPE_NEAR
#define MPK_ROPE_NEAR 0
#endif
constexpr float kRopeNearAngle = 65536.0f;  // within sincosf's fast-path range

__device__ __noinline__ void rope_cos_sin_far(float ang, float& c, float& s) { sincosf(ang, &s, &c); }

__device__ __forceinline__ void rope_cos_sin(float ang, float& c, float& s) {
#if MPK_ROPE_FAST
  __sincosf(ang, &s, &c);
#elif MPK_ROPE_NEAR
  if (fabsf(ang) <= kRopeNearAngle) {
    __builtin_assume(fabsf(ang) <= kRopeNearAngle);
    sincosf(ang, &s, &c);
  } else {
    rope_cos_sin_far(ang, c, s);
  }
#elif MPK_ROPE_SINCOS
  sincosf(ang, &s, &c);
#else
  c = cosf(ang);
  s = sinf(ang);
#endif
}

// The per-head q/k norm + rope bodies (qkv_prep.cuh, generated/qk_norm_rope.cuh) hold a head's pairs
// (d, d + D/2), d = lane, lane + 32, ... in per-lane arrays of kPairs entries. Why a compile-time count per
// head size: each body is straight-line code executed once per head, fetched cold every layer (ncu: the prep's
// lines stalled on "no instruction" 40-56%), and the 8-pair instance for D <= 512 spans ~2,100 instructions.
// MPK_ROPE_EXACT_PAIRS 0 keeps the single 8-pair instance (the same arithmetic: the guards skip the same pairs).
#ifndef MPK_ROPE_EXACT_PAIRS
#define MPK_ROPE_EXACT_PAIRS 1
#endif
constexpr int kRopeMaxPairs = 8;  // D <= 2 * 32 * 8 = 512
// CALL with kPairs bound to the smallest of 1, 2, 4, 8 pairs a lane covering ceil(D / 64) pairs.
#if MPK_ROPE_EXACT_PAIRS
#define MPK_ROPE_PAIRS(D_, CALL)                                                   \
  do {                                                                             \
    const int rope_pairs_ = ((D_) / 2 + 31) / 32;                                  \
    if (rope_pairs_ <= 1) { constexpr int kPairs = 1; CALL; }                      \
    else if (rope_pairs_ <= 2) { constexpr int kPairs = 2; CALL; }                 \
    else if (rope_pairs_ <= 4) { constexpr int kPairs = 4; CALL; }                 \
    else { constexpr int kPairs = kRopeMaxPairs; CALL; }                           \
  } while (0)
#else
#define MPK_ROPE_PAIRS(D_, CALL)                 \
  do {                                           \
    constexpr int kPairs = kRopeMaxPairs;        \
    CALL;                                        \
  } while (0)
#endif

// Sum of v over the worker threads of the block (smem: nt / 32 floats); every thread gets it.
__device__ float block_sum(float v, float* smem, int tid, int nt) {
  v = warp_sum(v);
  if ((tid & 31) == 0) smem[tid >> 5] = v;
  worker_barrier(nt);
  float s = 0.f;
  for (int i = 0; i < (nt >> 5); ++i) s += smem[i];
  worker_barrier(nt);  // smem may be reused right after
  return s;
}

constexpr int kL2LineBytes = 128;
// Bytes one thread hands to the bulk-copy engine per prefetch: a 256 KB o_proj tile is 16 instructions
// on 16 threads instead of 2048 line prefetches (4 per thread at 512 threads).
constexpr uint32_t kBulkPrefetchChunk = 16384;
constexpr uint32_t kBulkAlign = 16;  // cp.async.bulk: 16-byte aligned address, size a multiple of 16

// Prefetch [p, p + bytes) into L2 (weight tiles before their input event fires). Best effort:
// issues one prefetch per 128-byte line, spread over the worker threads.
__device__ __forceinline__ void prefetch_l2(const void* p, uint64_t bytes, int tid, int nt) {
  const char* c = reinterpret_cast<const char*>(p);
  for (uint64_t off = (uint64_t)tid * kL2LineBytes; off < bytes; off += (uint64_t)nt * kL2LineBytes)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}

// The line holding p into this SM's L1 (and L2): a hint, no register and nothing to wait for; a later plain load
// of the line hits L1 if it arrived and was not evicted.
__device__ __forceinline__ void prefetch_l1_line(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// One bulk prefetch of [p, p + bytes) into L2 (p 16-byte aligned, bytes a multiple of 16).
__device__ __forceinline__ void bulk_prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// prefetch_l2 through the bulk-copy (TMA) engine: each instruction asks for up to kBulkPrefetchChunk bytes
// and returns at once, so the issuing SM's load pipeline stays free (a line prefetch occupies it like a
// load: the v0.4 trace's 3.9 us to issue 256 KB). The unaligned head and the tail below 16 bytes go by
// line prefetches. Best effort, no completion to wait for.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint64_t bytes, int tid, int nt) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t first = (a + kBulkAlign - 1) & ~(uintptr_t)(kBulkAlign - 1);
  const uintptr_t last = (a + bytes) & ~(uintptr_t)(kBulkAlign - 1);
  if (first >= last) {
    prefetch_l2(p, bytes, tid, nt);
    return;
  }
  if (tid == nt - 1) {  // the edges: at most one line each
    if (first > a) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    if (a + bytes > last) asm volatile("prefetch.global.L2 [%0];" ::"l"(last));
  }
  for (uint64_t off = (uint64_t)tid * kBulkPrefetchChunk; first + off < last; off += (uint64_t)nt * kBulkPrefetchChunk) {
    const uint64_t n = min((uint64_t)kBulkPrefetchChunk, (uint64_t)(last - first - off));
    bulk_prefetch_l2(reinterpret_cast<const void*>(first + off), (uint32_t)n);
  }
}

}  // namespace mpk
