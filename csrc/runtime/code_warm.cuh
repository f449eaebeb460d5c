// Code warm-up (record flag REC_FLAG_WARM_CODE; mpk_dist/runtime/task_records.py, switch MPK_WARM_CODE): while
// an aot worker waits for a split-KV prep tile's inputs, its block runs the same task body once on a scratch
// copy of the task (a "dry" record: two cache positions of one sequence, every pointer it writes redirected to
// this block's scratch slot), so the body's instructions are in the SM's instruction caches when the real run
// starts. Why: an SM runs one such tile a layer, between ~100 us of linear tiles, and the tile's phases take
// 3-4 us each for a few hundred instructions of arithmetic (docs/PERF.md v0.17: prep 3, walk 4.3 us; v0.10's
// ncu: the prep's lines 40-56% "no instruction"). If the code is fetched cold, the dry run pays that fetch
// during the wait instead of on the level's critical path.
// The dry run reads only constants (norm weights, rope frequencies) and the scratch slot, and writes only the
// slot (q in shared memory, which the real run rewrites); its ticket has a group of one, so it also runs the
// head-merge code. Garbage values are harmless: nothing reads the slot's results.
// REC_FLAG_WARM_PROBE: thread 0 first looks (relaxed loads, no wait) whether the task's inputs are ready, and
// the block skips the dry run when they are (it would only delay the task).
// MPK_WARM_CODE 0 (the default binary) leaves all of it out: the dry run's second call site of the prep body made
// ptxas spill in the fused linear bodies (tests/runtime/test_attn_prep_build.py).
#pragma once
#ifndef MPK_WARM_CODE
#define MPK_WARM_CODE 0
#endif
#include "dispatch.cuh"
#include "params.cuh"
#include "sync.cuh"
#include "task_record.cuh"

namespace mpk {

#if MPK_WARM_CODE
// Scratch slots: one per worker block (blocks beyond kWarmSlots share one: still only garbage).
constexpr int kWarmSlots = 256;
constexpr int kWarmSlotBytes = 24 * 1024;
// Byte offsets in a slot, for the shapes split_prep_ok admits (G <= kAttnMaxG = 8, D <= 256).
constexpr int kWarmQkvAt = 0;                 // (G + 2) D bf16 <= 5,120 B: q heads, k head, v head
constexpr int kWarmKAt = 8 * 1024;            // 2 cache rows of D bf16 <= 1 KB
constexpr int kWarmVAt = 9 * 1024;            // 2 cache rows of D bf16 <= 1 KB
constexpr int kWarmOutAt = 10 * 1024;         // G (D + 2) f32 <= 8,256 B: the range's partial
constexpr int kWarmMergedAt = 19 * 1024;      // G D bf16 <= 4 KB: the merged head
constexpr int kWarmTicketAt = 23 * 1024;      // one ticket word
constexpr int kWarmPositions = 2;             // positions the dry run walks (0 staged or read, 1 appended)

__device__ __align__(128) uint8_t g_warm_scratch[kWarmSlots][kWarmSlotBytes];
__device__ int32_t g_warm_position = kWarmPositions - 1;  // the dry run's pos[0]: the range's last row

__device__ __forceinline__ void rec_set_arg(int32_t* rec, int i, const void* ptr) {
  const uint64_t a = reinterpret_cast<uint64_t>(ptr);
  rec[REC_ARGS + 2 * i] = (int32_t)(uint32_t)a;
  rec[REC_ARGS + 2 * i + 1] = (int32_t)(uint32_t)(a >> 32);
}

// Thread 0: whether every wait of the record is met at step s now (relaxed: the real wait acquires after).
__device__ bool task_events_met_now(const RuntimeParams& p, const int32_t* rec, int s) {
  if (!(rec[REC_FLAGS] & REC_FLAG_WAITS_INLINE)) return false;  // long wait lists: assume not ready
  for (int k = 0; k < rec[REC_NWAITS]; ++k) {
    const int32_t* w = rec + REC_WAITS + k * REC_WAIT_COLS;  // event, step offset, triggers, scope
    const int mult = s + 1 + w[1];
    if (mult <= 0) continue;
    const uint32_t target = (uint32_t)mult * (uint32_t)w[2];
    if ((int32_t)(ld_relaxed_gpu(&p.events[w[0]]) - target) < 0) return false;
  }
  return true;
}

// The dry run of a split-KV prep tile (all worker threads; ends in a block barrier).
__device__ __noinline__ void warm_split_prep(const RuntimeParams& p, const int32_t* rec, float* smem, int tid,
                                             int nt) {
  __shared__ __align__(16) int32_t dry[REC_WORDS];
  const TaskView real(p, rec);
  const int D = real.param(ATTENTION_SPLIT_PREP_PARAM_HEAD_DIM), G = real.param(ATTENTION_SPLIT_PREP_PARAM_GROUP);
  if (!split_prep_ok(D, G, nt) || real.param(ATTENTION_SPLIT_PREP_PARAM_MAX_SEQ) < kWarmPositions) return;
  for (int i = tid; i < REC_WORDS; i += nt) dry[i] = rec[i];
  worker_barrier(nt);
  if (tid == 0) {
    uint8_t* slot = g_warm_scratch[blockIdx.x % kWarmSlots];
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_QKV, slot + kWarmQkvAt);
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_POSITIONS, &g_warm_position);
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_K_CACHE, slot + kWarmKAt);
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_V_CACHE, slot + kWarmVAt);
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_OUT, slot + kWarmOutAt);
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_MERGED, slot + kWarmMergedAt);
    rec_set_arg(dry, ATTENTION_SPLIT_PREP_ARG_TICKET, slot + kWarmTicketAt);  // used only if the real one is
    int32_t* prm = dry + REC_PARAMS;
    prm[ATTENTION_SPLIT_PREP_PARAM_BATCH] = 1;
    prm[ATTENTION_SPLIT_PREP_PARAM_QKV_STRIDE] = (G + 2) * D;
    prm[ATTENTION_SPLIT_PREP_PARAM_K_OFFSET] = G * D;  // the slot's row: q heads, then k, then v
    prm[ATTENTION_SPLIT_PREP_PARAM_V_OFFSET] = D;
    prm[ATTENTION_SPLIT_PREP_PARAM_KV_POS_STRIDE] = D;
    prm[ATTENTION_SPLIT_PREP_PARAM_KV_BATCH_STRIDE] = kWarmPositions * D;
    prm[ATTENTION_SPLIT_PREP_PARAM_POS_BEGIN] = 0;
    prm[ATTENTION_SPLIT_PREP_PARAM_POS_END] = kWarmPositions;
    prm[ATTENTION_SPLIT_PREP_PARAM_OUT_STRIDE] = G * (D + 2);  // one range: the ticket's group is 1
    prm[ATTENTION_SPLIT_PREP_PARAM_SPLIT_INDEX] = 0;
  }
  worker_barrier(nt);
  run_attention_split_prep(TaskView(p, dry), smem, tid, nt);
  worker_barrier(nt);  // the real run reuses the shared memory
}

// Before the wait of an aot task with REC_FLAG_WARM_CODE (all worker threads). `ready` (shared, written by
// thread 0) carries the probe's answer.
__device__ __forceinline__ void warm_task_code(const RuntimeParams& p, const int32_t* rec, int s, int* ready,
                                               float* smem, int tid, int nt) {
  if (!(rec[REC_FLAGS] & REC_FLAG_WARM_CODE) || rec[REC_OPCODE] != OP_ATTENTION_SPLIT_PREP) return;
  if (rec[REC_FLAGS] & REC_FLAG_WARM_PROBE) {
    if (tid == 0) *ready = task_events_met_now(p, rec, s);
    worker_barrier(nt);
    if (*ready) return;
  }
  warm_split_prep(p, rec, smem, tid, nt);
}
#else
__device__ __forceinline__ void warm_task_code(const RuntimeParams&, const int32_t*, int, int*, float*, int, int) {}
#endif  // MPK_WARM_CODE

}  // namespace mpk
