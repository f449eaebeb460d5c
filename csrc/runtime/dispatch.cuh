// Task dispatch: opcode -> task body (csrc/tasks/<kind>.cuh). Arguments and parameters are read
// through the generated ABI constants (<KIND>_ARG_<NAME>, <KIND>_PARAM_<NAME>), so this file names
// each field once and never repeats a column number or an argument position.
// Every run_* is __noinline__: the kernel is one function, and inlined bodies share one register
// allocation, so the attention kinds' per-lane arrays made ptxas spill ~1.7 KB in the worker loop
// itself (128 registers at 512 threads). As separate functions each body spills (or not) on its own.
#pragma once
#include "task_view.cuh"
#include "watchdog.cuh"  // raise_error: flag_gather's timeout
#include "trace_marks.cuh"
#include "step_begin.cuh"
#include "embedding.cuh"
#include "rms_norm.cuh"
#include "linear.cuh"
#include "qkv_prep.cuh"
#include "attention.cuh"
#include "silu_mul.cuh"
#include "add.cuh"
#include "allreduce_push.cuh"
#include "allreduce_reduce.cuh"
#include "argmax_partial.cuh"
#include "argmax_reduce.cuh"
#include "allgather_push.cuh"
#include "argmax_select.cuh"
#include "argmax_nucleus_hist.cuh"
#include "argmax_nucleus_cut.cuh"
#include "norm_linear.cuh"
#include "linear_residual.cuh"
#include "silu_linear.cuh"
// silu_mul as the gate|up projection's epilogue (opt-in fusion 'silu_epi'; docs/TASKGRAPH.md)
#include "norm_linear_silu.cuh"
// Superoptimized bodies (mpk_dist.runtime.superopt_tasks): MPK_SUPEROPT comes from the generated .cu
// (KernelShape.superopt); a kind whose search found no lowerable µGraph is built with
// -DMPK_SUPEROPT_<KIND>=0 and runs its hand-written body. "generated/<kind>.cuh" resolves to the
// build's per-µGraph folder (first on the include path), else to csrc/tasks/generated.
#ifndef MPK_SUPEROPT
#define MPK_SUPEROPT 0
#endif
#ifndef MPK_SUPEROPT_NORM_LINEAR
#define MPK_SUPEROPT_NORM_LINEAR MPK_SUPEROPT
#endif
#ifndef MPK_SUPEROPT_SILU_LINEAR
#define MPK_SUPEROPT_SILU_LINEAR MPK_SUPEROPT
#endif
#if MPK_SUPEROPT_NORM_LINEAR
#include "generated/norm_linear.cuh"
#endif
#if MPK_SUPEROPT_SILU_LINEAR
#include "generated/silu_linear.cuh"
#endif
#include "attention_split.cuh"
#include "attention_merge.cuh"
// paged KV cache (opt-in serving graphs; docs/SERVING.md)
#include "qkv_prep_paged.cuh"
#include "paged_attention.cuh"
#include "gather_rows.cuh"
#include "page_alloc.cuh"
// qkv_prep folded into the attention tiles (opt-in fusion 'attn_prep'; docs/TASKGRAPH.md)
#include "attention_prep.cuh"
#include "attention_split_prep.cuh"

namespace mpk {

constexpr int kMaxWorld = 8;

__device__ __noinline__ void run_linear(const TaskView& t, int tid, int nt) {
  const int B = t.param(LINEAR_PARAM_BATCH), K = t.param(LINEAR_PARAM_K), n = t.param(LINEAR_PARAM_N_TILE);
  const int xs = t.param(LINEAR_PARAM_X_STRIDE), ys = t.param(LINEAR_PARAM_Y_STRIDE);
  const bf16* x = t.arg<const bf16>(LINEAR_ARG_X);
  const bf16* w = t.arg<const bf16>(LINEAR_ARG_W);
  if (t.dtype(LINEAR_ARG_Y) == DTYPE_F32)  // logits: the fp32 accumulation, unrounded (as the reference)
    linear<float>(B, x, xs, w, t.arg<float>(LINEAR_ARG_Y), ys, K, n, false, tid, nt);
  else
    linear<bf16>(B, x, xs, w, t.arg<bf16>(LINEAR_ARG_Y), ys, K, n, false, tid, nt);
}

__device__ __noinline__ void run_qkv_prep(const TaskView& t, int tid, int nt) {
  qkv_prep(t.arg<const bf16>(QKV_PREP_ARG_QKV), t.arg<const int32_t>(QKV_PREP_ARG_POSITIONS),
           t.arg<const bf16>(QKV_PREP_ARG_NORM_W), t.arg<const float>(QKV_PREP_ARG_INV_FREQ),
           t.arg<bf16>(QKV_PREP_ARG_DST), t.arg<bf16>(QKV_PREP_ARG_DST_V), t.param(QKV_PREP_PARAM_BATCH),
           t.param(QKV_PREP_PARAM_HEAD_DIM), t.param(QKV_PREP_PARAM_QKV_STRIDE), t.param(QKV_PREP_PARAM_V_OFFSET),
           t.param(QKV_PREP_PARAM_DST_BATCH_STRIDE), t.param(QKV_PREP_PARAM_DST_POS_STRIDE),
           t.param(QKV_PREP_PARAM_IS_KV), t.fparam(QKV_PREP_PARAM_EPS), tid, nt);
}

__device__ __noinline__ void run_attention(const TaskView& t, float* smem, int tid, int nt) {
  attention(t.arg<const bf16>(ATTENTION_ARG_Q), t.arg<const bf16>(ATTENTION_ARG_K_CACHE),
            t.arg<const bf16>(ATTENTION_ARG_V_CACHE), t.arg<const int32_t>(ATTENTION_ARG_POSITIONS),
            t.arg<bf16>(ATTENTION_ARG_OUT), t.param(ATTENTION_PARAM_BATCH), t.param(ATTENTION_PARAM_HEAD_DIM),
            t.param(ATTENTION_PARAM_GROUP), t.param(ATTENTION_PARAM_Q_STRIDE), t.param(ATTENTION_PARAM_KV_POS_STRIDE),
            t.param(ATTENTION_PARAM_KV_BATCH_STRIDE), t.fparam(ATTENTION_PARAM_SCALE), smem, tid, nt);
}

template <typename T>
__device__ void push_partial(const TaskView& t, int world, int tid, int nt) {
  T* dst[kMaxWorld];
  for (int r = 0; r < world; ++r) dst[r] = t.peer_arg<T>(ALLREDUCE_PUSH_ARG_DST, r);
  allreduce_push(t.arg<const T>(ALLREDUCE_PUSH_ARG_SRC), dst, world, t.param(ALLREDUCE_PUSH_PARAM_BATCH),
                 t.param(ALLREDUCE_PUSH_PARAM_COLS), t.param(ALLREDUCE_PUSH_PARAM_SRC_STRIDE),
                 t.param(ALLREDUCE_PUSH_PARAM_DST_STRIDE), tid, nt);
}

// The residual stream is fp32 (models/llama.py); q/k norms and all-bf16 graphs are bf16. These
// helpers pick the template instance from the buffers' dtypes.
template <typename OutT>
__device__ __noinline__ void run_embedding_as(const TaskView& t, int tid, int nt) {
  embedding(t.arg<const int32_t>(EMBEDDING_ARG_TOKENS), t.arg<const bf16>(EMBEDDING_ARG_TABLE),
            t.arg<OutT>(EMBEDDING_ARG_OUT), t.param(EMBEDDING_PARAM_BATCH), t.param(EMBEDDING_PARAM_COLS),
            t.param(EMBEDDING_PARAM_TABLE_STRIDE), t.param(EMBEDDING_PARAM_OUT_STRIDE),
            t.param(EMBEDDING_PARAM_VOCAB_START), t.param(EMBEDDING_PARAM_VOCAB_ROWS), tid, nt);
}

__device__ __noinline__ void run_rms_norm(const TaskView& t, float* smem, int tid, int nt) {
  const bf16* w = t.arg<const bf16>(RMS_NORM_ARG_W);
  bf16* y = t.arg<bf16>(RMS_NORM_ARG_Y);
  const int n = t.param(RMS_NORM_PARAM_N);
  const float eps = t.fparam(RMS_NORM_PARAM_EPS);
  if (t.dtype(RMS_NORM_ARG_X) == DTYPE_F32) rms_norm(t.arg<const float>(RMS_NORM_ARG_X), w, y, n, eps, smem, tid, nt);
  else rms_norm(t.arg<const bf16>(RMS_NORM_ARG_X), w, y, n, eps, smem, tid, nt);
}

template <typename XT, typename YT, typename OutT>
__device__ __noinline__ void run_add_as(const TaskView& t, int tid, int nt) {
  add(t.arg<const XT>(ADD_ARG_X), t.arg<const YT>(ADD_ARG_Y), t.arg<OutT>(ADD_ARG_OUT), t.param(ADD_PARAM_BATCH),
      t.param(ADD_PARAM_COLS), t.param(ADD_PARAM_STRIDE), tid, nt);
}

__device__ __noinline__ void run_add(const TaskView& t, int tid, int nt) {
  // fp32 residual graphs: bf16 partial + fp32 residual -> fp32; otherwise all bf16.
  if (t.dtype(ADD_ARG_OUT) == DTYPE_F32) {
    if (t.dtype(ADD_ARG_X) == DTYPE_F32) run_add_as<float, float, float>(t, tid, nt);
    else run_add_as<bf16, float, float>(t, tid, nt);
  } else {
    run_add_as<bf16, bf16, bf16>(t, tid, nt);
  }
}

template <typename RecvT, typename OutT>
__device__ __noinline__ void run_reduce_as(const TaskView& t, int tid, int nt) {
  const int B = t.param(ALLREDUCE_REDUCE_PARAM_BATCH), cols = t.param(ALLREDUCE_REDUCE_PARAM_COLS);
  const int world = t.param(ALLREDUCE_REDUCE_PARAM_WORLD), slots = t.param(ALLREDUCE_REDUCE_PARAM_SLOT_STRIDE);
  const int stride = t.param(ALLREDUCE_REDUCE_PARAM_STRIDE);
  const RecvT* recv = t.arg<const RecvT>(ALLREDUCE_REDUCE_ARG_RECV);
  OutT* out = t.arg<OutT>(ALLREDUCE_REDUCE_ARG_OUT);
  if (t.dtype(ALLREDUCE_REDUCE_ARG_RESIDUAL) == DTYPE_BF16)
    allreduce_reduce(recv, t.arg<const bf16>(ALLREDUCE_REDUCE_ARG_RESIDUAL), out, B, cols, world, slots, stride, tid, nt);
  else  // fp32 residual, or none (nullptr)
    allreduce_reduce(recv, t.arg<const float>(ALLREDUCE_REDUCE_ARG_RESIDUAL), out, B, cols, world, slots, stride, tid, nt);
}

__device__ __noinline__ void run_allreduce_reduce(const TaskView& t, int tid, int nt) {
  const bool recv32 = t.dtype(ALLREDUCE_REDUCE_ARG_RECV) == DTYPE_F32;
  if (t.dtype(ALLREDUCE_REDUCE_ARG_OUT) == DTYPE_F32) {
    if (recv32) run_reduce_as<float, float>(t, tid, nt);
    else run_reduce_as<bf16, float>(t, tid, nt);
  } else {
    run_reduce_as<bf16, bf16>(t, tid, nt);
  }
}

__device__ __noinline__ void run_comm_push(const TaskView& t, int opcode, int tid, int nt) {
  const int world = t.p.world;
  if (opcode == OP_ALLGATHER_PUSH) {
    float* dst[kMaxWorld];
    for (int r = 0; r < world; ++r) dst[r] = t.peer_arg<float>(ALLGATHER_PUSH_ARG_DST, r);
    allgather_push(t.arg<const float>(ALLGATHER_PUSH_ARG_SRC), dst, world, t.param(ALLGATHER_PUSH_PARAM_COUNT), tid, nt);
  } else if (t.dtype(ALLREDUCE_PUSH_ARG_SRC) == DTYPE_F32) {
    push_partial<float>(t, world, tid, nt);
  } else {
    push_partial<bf16>(t, world, tid, nt);
  }
}

// ---- flagged words (opt-in: MPK_FLAG_WORDS, mpk_dist/taskgraph/flag_words.py; csrc/tasks/flag_words.cuh) ----
// The step reaches the bodies that read or write flagged words as an extra argument (MPK_FLAG_STEP_*), so a build
// without them keeps its functions' signatures.
#if MPK_FLAG_WORDS
#define MPK_FLAG_STEP_PARAM , int step
#define MPK_FLAG_STEP_ARG , step
#else
#define MPK_FLAG_STEP_PARAM
#define MPK_FLAG_STEP_ARG
#endif

#if MPK_FLAG_WORDS
// One input of a polling tile as flagged words: `rows` rows of `cols` words, row r at words + r * ld, gathered into
// shared memory as 32-bit values (an fp32 value, or a pair of bf16: the word's low half) at dst + r * cols.
struct FlagRegion {
  const uint64_t* words = nullptr;
  int rows = 0, cols = 0, ld = 0;
  uint32_t* dst = nullptr;
  __device__ __forceinline__ int count() const { return words == nullptr ? 0 : rows * cols; }
};

// Gather regions a and b (b may be empty), polling every word until its tag is step `step`'s; all worker threads
// take words tid, tid + nt, ... of the two regions together (their loads in flight at once). False when a word kept
// another tag for the launch's timeout (the watchdog's record names the task, the word's index and both tags) or
// another block halted the grid. Ends in a barrier: the values are in shared memory for every thread.
__device__ __noinline__ bool flag_gather(const TaskView& t, const FlagRegion& a, const FlagRegion& b, int step,
                                         int tid, int nt) {
  const uint32_t tag = flag_tag_of_step(step);
  const int na = a.count(), total = na + b.count();
  const auto src = [&](int i) {
    const FlagRegion& r = i < na ? a : b;
    const int j = i < na ? i : i - na;
    return r.words + (size_t)(j / r.cols) * r.ld + j % r.cols;
  };
  bool failed = false;
  uint64_t t0 = 0;
  for (int base = tid; base < total && !failed; base += nt * kFlagPollWords) {
    uint64_t w[kFlagPollWords];
#pragma unroll
    for (int u = 0; u < kFlagPollWords; ++u) w[u] = 0;  // tag 0: no step's
    for (int round = 1;; ++round) {
#pragma unroll
      for (int u = 0; u < kFlagPollWords; ++u) {  // every word not yet the step's, in flight together
        const int i = base + u * nt;
        if (i < total && flag_tag(w[u]) != tag) w[u] = ld_relaxed_gpu_u64(src(i));
      }
      int late = -1;
#pragma unroll
      for (int u = 0; u < kFlagPollWords; ++u)
        if (late < 0 && base + u * nt < total && flag_tag(w[u]) != tag) late = u;
      if (late < 0) break;
      if (round % MPK_SPIN_CHECK == 0) {  // now and then: the clock and the abort flag
        const uint64_t now = globaltimer_ns();
        if (t0 == 0) t0 = now;
        if (now - t0 > t.p.timeout_ns) {
          raise_error(t.p.error, t.p.halt, kErrFlagWait, t.task(), base + late * nt, step, t.p.rank, flag_tag(w[late]),
                      tag, now - t0);
          failed = true;
          break;
        }
        if (ld_relaxed_gpu(t.p.halt) != 0) { failed = true; break; }
      }
      if (MPK_FLAG_POLL_SLEEP_NS > 0) __nanosleep(MPK_FLAG_POLL_SLEEP_NS);
    }
    if (failed) break;
#pragma unroll
    for (int u = 0; u < kFlagPollWords; ++u) {
      const int i = base + u * nt;
      if (i < total) (i < na ? a.dst[i] : b.dst[i - na]) = (uint32_t)w[u];
    }
  }
  return !worker_barrier_or(nt, failed);
}

// A norm tile's B fp32 input rows of K from their flagged words (row b at words + b * ld) into shared memory at the
// top of the launch's dynamic share, above the `below` bytes its body uses. The rows (stride K), or nullptr: too
// little shared memory (a bad task, nothing raised) or a failed gather (raised there).
__device__ __forceinline__ const float* flag_gather_rows(const TaskView& t, const uint64_t* words, int B, int K, int ld,
                                                         uint32_t below, int step, float* smem, int tid, int nt) {
  const uint32_t bytes = (uint32_t)B * (uint32_t)K * (uint32_t)sizeof(float), top = smem_below_ring();
  if (bytes > top || ((top - bytes) & ~15u) < below) return nullptr;
  FlagRegion x;
  x.words = words, x.rows = B, x.cols = K, x.ld = ld;
  x.dst = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(smem) + ((top - bytes) & ~15u));
  return flag_gather(t, x, FlagRegion(), step, tid, nt) ? reinterpret_cast<const float*>(x.dst) : nullptr;
}
#endif

// ---- fused linears (opt-in: compile_rank_programs(fuse=...); docs/TASKGRAPH.md 'Fused linears') ----
// Only the dtype combinations the fused graphs produce are instantiated (bf16 models: fp32
// residual stream, bf16 activations, fp32 logits); any other combination returns false, which the
// worker reports as a bad task instead of computing something wrong.
// The gate|up projection with its silu epilogue: norm_linear's body (generated or hand-written) on the tile's
// gate and up rows, then silu(gate) * up into the activation.
__device__ __noinline__ bool run_norm_linear_silu(const TaskView& t, float* smem, int tid, int nt MPK_FLAG_STEP_PARAM) {
  if (t.dtype(NORM_LINEAR_SILU_ARG_X) != DTYPE_F32 || t.dtype(NORM_LINEAR_SILU_ARG_Y) != DTYPE_BF16) return false;
  const float* x = t.arg<const float>(NORM_LINEAR_SILU_ARG_X);
  int xs = t.param(NORM_LINEAR_SILU_PARAM_X_STRIDE);
#if MPK_FLAG_WORDS
  if (const uint64_t* xf = t.arg<const uint64_t>(NORM_LINEAR_SILU_ARG_X_FLAGS)) {  // the input as flagged words
    const int B = t.param(NORM_LINEAR_SILU_PARAM_BATCH), K = t.param(NORM_LINEAR_SILU_PARAM_K);
    const uint32_t sums = (uint32_t)B * (uint32_t)t.param(NORM_LINEAR_SILU_PARAM_N_TILE) * (uint32_t)sizeof(bf16);
    x = flag_gather_rows(t, xf, B, K, xs, (staged_bytes(B, K) + kPairAlign - 1) / kPairAlign * kPairAlign + sums,
                         step, smem, tid, nt);
    if (x == nullptr) return false;
    xs = K;
  }
#endif
  const auto body = [](int B, const float* x, int ldx, const bf16* nw, const bf16* w, const Epi& epi, int K,
                       int n_tile, float eps, float* sm, int tid_, int nt_) {
#if MPK_SUPEROPT_NORM_LINEAR
    gen::norm_linear(B, x, ldx, nw, w, epi, K, n_tile, eps, sm, tid_, nt_);  // generated from the chosen µGraph
#else
    norm_linear(B, x, ldx, nw, w, epi, K, n_tile, eps, sm, tid_, nt_);
#endif
  };
#if MPK_SILU_DOWN
  DownArgs down;  // fusion 'silu_down': the down projection's partial of the tile (down_partial.cuh)
  down.wd = t.arg<const bf16>(NORM_LINEAR_SILU_ARG_WD);
  down.ldw = t.param(NORM_LINEAR_SILU_PARAM_WD_STRIDE), down.H = t.param(NORM_LINEAR_SILU_PARAM_H);
  down.xo = t.arg<float>(NORM_LINEAR_SILU_ARG_XO), down.ldxo = t.param(NORM_LINEAR_SILU_PARAM_XO_STRIDE);
  if (down.wd != nullptr && (down.xo == nullptr || t.dtype(NORM_LINEAR_SILU_ARG_XO) != DTYPE_F32)) return false;
#endif
  return norm_linear_silu(t.param(NORM_LINEAR_SILU_PARAM_BATCH), x, xs, t.arg<const bf16>(NORM_LINEAR_SILU_ARG_NORM_W),
                          t.arg<const bf16>(NORM_LINEAR_SILU_ARG_W), t.param(NORM_LINEAR_SILU_PARAM_UP_ROWS),
                          t.arg<bf16>(NORM_LINEAR_SILU_ARG_Y), t.param(NORM_LINEAR_SILU_PARAM_Y_STRIDE),
                          t.param(NORM_LINEAR_SILU_PARAM_K), t.param(NORM_LINEAR_SILU_PARAM_N_TILE),
                          t.fparam(NORM_LINEAR_SILU_PARAM_EPS), smem, tid, nt, body
#if MPK_SILU_DOWN
                          , down
#endif
#if MPK_FLAG_WORDS
                          , t.arg<uint64_t>(NORM_LINEAR_SILU_ARG_Y_FLAGS), flag_tag_of_step(step)
#endif
  );
}

// norm_linear_silu tasks come here too. NOTE: a kernel that can reach both run_norm_linear_silu and
// run_silu_linear has an entry stack frame of 608 bytes instead of 592 (ptxas -v, batch 1), though no function
// either adds has a frame or spills, and it ran 0.3-0.7% slower (docs/PERF.md v0.20). A program runs one of the
// two (fusion 'silu_epi' or 'silu'), so the build leaves out the kind its program does not run
// (MPK_SILU_EPI_KIND / MPK_SILU_LINEAR_KIND = 0, kernel.kind_defines); such a task is reported as a bad task.
#ifndef MPK_SILU_EPI_KIND
#define MPK_SILU_EPI_KIND 1
#endif
#ifndef MPK_SILU_LINEAR_KIND
#define MPK_SILU_LINEAR_KIND 1
#endif
__device__ __noinline__ bool run_norm_linear(const TaskView& t, float* smem, int tid, int nt MPK_FLAG_STEP_PARAM) {
  if (t.opcode() == OP_NORM_LINEAR_SILU) return MPK_SILU_EPI_KIND && run_norm_linear_silu(t, smem, tid, nt MPK_FLAG_STEP_ARG);
  if (t.dtype(NORM_LINEAR_ARG_X) != DTYPE_F32) return false;
  const int B = t.param(NORM_LINEAR_PARAM_BATCH), K = t.param(NORM_LINEAR_PARAM_K);
  const int n = t.param(NORM_LINEAR_PARAM_N_TILE);
  int xs = t.param(NORM_LINEAR_PARAM_X_STRIDE);
  const int ys = t.param(NORM_LINEAR_PARAM_Y_STRIDE);
  const float eps = t.fparam(NORM_LINEAR_PARAM_EPS);
  const float* x = t.arg<const float>(NORM_LINEAR_ARG_X);
#if MPK_FLAG_WORDS
  if (const uint64_t* xf = t.arg<const uint64_t>(NORM_LINEAR_ARG_X_FLAGS)) {  // the input as flagged words
    x = flag_gather_rows(t, xf, B, K, xs, staged_bytes(B, K), step, smem, tid, nt);
    if (x == nullptr) return false;
    xs = K;
  }
#endif
  const bf16* nw = t.arg<const bf16>(NORM_LINEAR_ARG_NORM_W);
  const bf16* w = t.arg<const bf16>(NORM_LINEAR_ARG_W);
  const int y_dt = t.dtype(NORM_LINEAR_ARG_Y);  // fp32: the lm_head's logits, unrounded
  const Epi epi{t.arg<void>(NORM_LINEAR_ARG_Y), nullptr, ys, y_dt == DTYPE_F32 ? kEpiF32 : kEpiBf16};
#if MPK_SUPEROPT_NORM_LINEAR
  gen::norm_linear(B, x, xs, nw, w, epi, K, n, eps, smem, tid, nt);  // generated from the chosen µGraph
#else
  norm_linear(B, x, xs, nw, w, epi, K, n, eps, smem, tid, nt);
#endif
  return true;
}

__device__ __noinline__ bool run_linear_residual(const TaskView& t, float* smem, int tid, int nt MPK_FLAG_STEP_PARAM) {
  if (t.dtype(LINEAR_RESIDUAL_ARG_Y) != DTYPE_F32 || t.dtype(LINEAR_RESIDUAL_ARG_RESIDUAL) != DTYPE_F32) return false;
#if MPK_FLAG_WORDS
  if (const uint64_t* xf = t.arg<const uint64_t>(LINEAR_RESIDUAL_ARG_X_FLAGS)) {
    // x (bf16 pairs) and the residual slice both as flagged words, polled instead of the waits: x into the staged
    // rows, the residual after them (row stride N_TILE)
    const int B = t.param(LINEAR_RESIDUAL_PARAM_BATCH), K = t.param(LINEAR_RESIDUAL_PARAM_K);
    const int n = t.param(LINEAR_RESIDUAL_PARAM_N_TILE), ys = t.param(LINEAR_RESIDUAL_PARAM_Y_STRIDE);
    const uint64_t* rf = t.arg<const uint64_t>(LINEAR_RESIDUAL_ARG_RESIDUAL_FLAGS);
    const uint32_t res_at = (staged_bytes(B, K) + 15u) & ~15u;
    if (rf == nullptr || K % 2 || res_at + (uint32_t)(B * n) * (uint32_t)sizeof(float) > smem_below_ring())
      return false;
    FlagRegion xr, rr;
    xr.words = xf, xr.rows = B, xr.cols = K / 2, xr.ld = t.param(LINEAR_RESIDUAL_PARAM_X_STRIDE) / 2;
    xr.dst = reinterpret_cast<uint32_t*>(stage_base(smem));
    rr.words = rf, rr.rows = B, rr.cols = n, rr.ld = ys;
    rr.dst = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(smem) + res_at);
    if (!flag_gather(t, xr, rr, step, tid, nt)) return false;
    linear_residual_staged(B, stage_base(smem), t.arg<const bf16>(LINEAR_RESIDUAL_ARG_W),
                           reinterpret_cast<const float*>(rr.dst), t.arg<float>(LINEAR_RESIDUAL_ARG_Y), ys, K, n,
                           t.arg<uint64_t>(LINEAR_RESIDUAL_ARG_Y_FLAGS), flag_tag_of_step(step), tid, nt);
    return true;
  }
#endif
  linear_residual(t.param(LINEAR_RESIDUAL_PARAM_BATCH), t.arg<const bf16>(LINEAR_RESIDUAL_ARG_X),
                  t.param(LINEAR_RESIDUAL_PARAM_X_STRIDE), t.arg<const bf16>(LINEAR_RESIDUAL_ARG_W),
                  t.arg<const float>(LINEAR_RESIDUAL_ARG_RESIDUAL), t.arg<float>(LINEAR_RESIDUAL_ARG_Y),
                  t.param(LINEAR_RESIDUAL_PARAM_Y_STRIDE), t.param(LINEAR_RESIDUAL_PARAM_K),
                  t.param(LINEAR_RESIDUAL_PARAM_N_TILE), smem, tid, nt
#if MPK_SILU_DOWN
                  , t.arg<float>(LINEAR_RESIDUAL_ARG_COPY)
#endif
#if MPK_FLAG_WORDS
                  , t.arg<uint64_t>(LINEAR_RESIDUAL_ARG_Y_FLAGS),
                  t.arg<const uint64_t>(LINEAR_RESIDUAL_ARG_RESIDUAL_FLAGS), flag_tag_of_step(step)
#endif
  );
  return true;
}

__device__ __noinline__ bool run_silu_linear(const TaskView& t, float* smem, int tid, int nt) {
  const int B = t.param(SILU_LINEAR_PARAM_BATCH), K = t.param(SILU_LINEAR_PARAM_K);
  const int n = t.param(SILU_LINEAR_PARAM_N_TILE), gs = t.param(SILU_LINEAR_PARAM_GU_STRIDE);
  const int up = t.param(SILU_LINEAR_PARAM_UP_OFFSET), ys = t.param(SILU_LINEAR_PARAM_Y_STRIDE);
  const bf16* gu = t.arg<const bf16>(SILU_LINEAR_ARG_GU);
  const bf16* w = t.arg<const bf16>(SILU_LINEAR_ARG_W);
  const int res_dt = t.dtype(SILU_LINEAR_ARG_RESIDUAL), y_dt = t.dtype(SILU_LINEAR_ARG_Y);
  // tp 1: the residual add as epilogue (fp32 stream); tp > 1: the bf16 partial the all-reduce pushes
  const bool residual = res_dt == DTYPE_F32 && y_dt == DTYPE_F32;
  if (!residual && !(res_dt < 0 && y_dt == DTYPE_BF16)) return false;
  const Epi epi{t.arg<void>(SILU_LINEAR_ARG_Y), t.arg<const float>(SILU_LINEAR_ARG_RESIDUAL), ys,
                residual ? kEpiResidual : kEpiBf16};
#if MPK_SUPEROPT_SILU_LINEAR
  gen::silu_linear(B, gu, gs, up, w, epi, K, n, smem, tid, nt);  // generated from the chosen µGraph
#else
  silu_linear(B, gu, gs, up, w, epi, K, n, smem, tid, nt);
#endif
  return true;
}

// ---- split-KV attention (opt-in: compile_rank_programs(attn_splits=...); docs/TASKGRAPH.md) ----
// The scratch is fp32 and the output bf16 (bf16 graphs); anything else is reported as a bad task.
__device__ __noinline__ bool run_attention_split(const TaskView& t, float* smem, int tid, int nt MPK_FLAG_STEP_PARAM) {
  if (t.dtype(ATTENTION_SPLIT_ARG_OUT) != DTYPE_F32) return false;
  attention_split(t.arg<const bf16>(ATTENTION_SPLIT_ARG_Q), t.arg<const bf16>(ATTENTION_SPLIT_ARG_K_CACHE),
                  t.arg<const bf16>(ATTENTION_SPLIT_ARG_V_CACHE), t.arg<const int32_t>(ATTENTION_SPLIT_ARG_POSITIONS),
                  t.arg<float>(ATTENTION_SPLIT_ARG_OUT), t.param(ATTENTION_SPLIT_PARAM_BATCH),
                  t.param(ATTENTION_SPLIT_PARAM_HEAD_DIM), t.param(ATTENTION_SPLIT_PARAM_GROUP),
                  t.param(ATTENTION_SPLIT_PARAM_Q_STRIDE), t.param(ATTENTION_SPLIT_PARAM_KV_POS_STRIDE),
                  t.param(ATTENTION_SPLIT_PARAM_KV_BATCH_STRIDE), t.param(ATTENTION_SPLIT_PARAM_POS_BEGIN),
                  t.param(ATTENTION_SPLIT_PARAM_POS_END), t.param(ATTENTION_SPLIT_PARAM_OUT_STRIDE),
                  t.fparam(ATTENTION_SPLIT_PARAM_SCALE), smem, tid, nt, t.flag(REC_FLAG_STAGE_KV));
  if (t.dtype(ATTENTION_SPLIT_ARG_TICKET) >= 0)  // fusion 'attn_merge': the head's last range merges it
    attention_merge_last(t.arg<uint32_t>(ATTENTION_SPLIT_ARG_TICKET),
                         split_head_partials(t.arg<const float>(ATTENTION_SPLIT_ARG_OUT),
                                             t.param(ATTENTION_SPLIT_PARAM_SPLIT_INDEX),
                                             t.param(ATTENTION_SPLIT_PARAM_GROUP), t.param(ATTENTION_SPLIT_PARAM_HEAD_DIM)),
                         t.arg<bf16>(ATTENTION_SPLIT_ARG_MERGED), t.param(ATTENTION_SPLIT_PARAM_BATCH),
                         t.param(ATTENTION_SPLIT_PARAM_HEAD_DIM), t.param(ATTENTION_SPLIT_PARAM_GROUP),
                         split_count(t.param(ATTENTION_SPLIT_PARAM_OUT_STRIDE), t.param(ATTENTION_SPLIT_PARAM_GROUP),
                                     t.param(ATTENTION_SPLIT_PARAM_HEAD_DIM)),
                         t.param(ATTENTION_SPLIT_PARAM_OUT_STRIDE), t.param(ATTENTION_SPLIT_PARAM_Q_STRIDE), tid, nt
#if MPK_FLAG_WORDS
                         , t.arg<uint64_t>(ATTENTION_SPLIT_ARG_MERGED_FLAGS), flag_tag_of_step(step)
#endif
    );
  return true;
}

__device__ __noinline__ bool run_attention_merge(const TaskView& t, int tid, int nt) {
  if (t.dtype(ATTENTION_MERGE_ARG_PARTIAL) != DTYPE_F32 || t.dtype(ATTENTION_MERGE_ARG_OUT) != DTYPE_BF16) return false;
  attention_merge(t.arg<const float>(ATTENTION_MERGE_ARG_PARTIAL), t.arg<bf16>(ATTENTION_MERGE_ARG_OUT),
                  t.param(ATTENTION_MERGE_PARAM_HEAD_DIM), t.param(ATTENTION_MERGE_PARAM_GROUP),
                  t.param(ATTENTION_MERGE_PARAM_SPLITS), tid, nt);
  return true;
}

// ---- paged KV cache (opt-in serving graphs: compile_paged_programs; docs/SERVING.md) ----
// bf16 activations and pools only; anything else, or a bad page-table entry, is reported as a
// bad task (kErrBadTask) instead of computing something wrong.
__device__ __noinline__ bool run_qkv_prep_paged(const TaskView& t, int tid, int nt) {
  if (t.dtype(QKV_PREP_PAGED_ARG_QKV) != DTYPE_BF16 || t.dtype(QKV_PREP_PAGED_ARG_DST) != DTYPE_BF16) return false;
  const PagedKv kv{t.arg<const int32_t>(QKV_PREP_PAGED_ARG_PAGE_TABLE),
                   t.arg_row(QKV_PREP_PAGED_ARG_PAGE_TABLE)[ARG_COL_COUNT], t.param(QKV_PREP_PAGED_PARAM_PAGE_SIZE),
                   t.param(QKV_PREP_PAGED_PARAM_PAGE_STRIDE), t.param(QKV_PREP_PAGED_PARAM_POS_STRIDE),
                   t.param(QKV_PREP_PAGED_PARAM_MAX_PAGES), t.param(QKV_PREP_PAGED_PARAM_NUM_PAGES)};
  return qkv_prep_paged(t.arg<const bf16>(QKV_PREP_PAGED_ARG_QKV), t.arg<const int32_t>(QKV_PREP_PAGED_ARG_POSITIONS),
                        t.arg<const int32_t>(QKV_PREP_PAGED_ARG_SLOTS), kv, t.arg<const bf16>(QKV_PREP_PAGED_ARG_NORM_W),
                        t.arg<const float>(QKV_PREP_PAGED_ARG_INV_FREQ), t.arg<bf16>(QKV_PREP_PAGED_ARG_DST),
                        t.arg<bf16>(QKV_PREP_PAGED_ARG_DST_V), t.param(QKV_PREP_PAGED_PARAM_BATCH),
                        t.param(QKV_PREP_PAGED_PARAM_HEAD_DIM), t.param(QKV_PREP_PAGED_PARAM_QKV_STRIDE),
                        t.param(QKV_PREP_PAGED_PARAM_V_OFFSET), t.param(QKV_PREP_PAGED_PARAM_Q_STRIDE),
                        t.param(QKV_PREP_PAGED_PARAM_IS_KV), t.fparam(QKV_PREP_PAGED_PARAM_EPS), tid, nt);
}

__device__ __noinline__ bool run_paged_attention(const TaskView& t, int tid, int nt) {
  if (t.dtype(PAGED_ATTENTION_ARG_Q) != DTYPE_BF16 || t.dtype(PAGED_ATTENTION_ARG_K_PAGES) != DTYPE_BF16 ||
      t.dtype(PAGED_ATTENTION_ARG_OUT) != DTYPE_BF16)
    return false;
  const PagedKv kv{t.arg<const int32_t>(PAGED_ATTENTION_ARG_PAGE_TABLE),
                   t.arg_row(PAGED_ATTENTION_ARG_PAGE_TABLE)[ARG_COL_COUNT], t.param(PAGED_ATTENTION_PARAM_PAGE_SIZE),
                   t.param(PAGED_ATTENTION_PARAM_PAGE_STRIDE), t.param(PAGED_ATTENTION_PARAM_POS_STRIDE),
                   t.param(PAGED_ATTENTION_PARAM_MAX_PAGES), t.param(PAGED_ATTENTION_PARAM_NUM_PAGES)};
  return paged_attention(t.arg<const bf16>(PAGED_ATTENTION_ARG_Q), t.arg<const bf16>(PAGED_ATTENTION_ARG_K_PAGES),
                         t.arg<const bf16>(PAGED_ATTENTION_ARG_V_PAGES), t.arg<const int32_t>(PAGED_ATTENTION_ARG_POSITIONS),
                         t.arg<const int32_t>(PAGED_ATTENTION_ARG_SLOTS), kv, t.arg<bf16>(PAGED_ATTENTION_ARG_OUT),
                         t.param(PAGED_ATTENTION_PARAM_BATCH), t.param(PAGED_ATTENTION_PARAM_HEAD_DIM),
                         t.param(PAGED_ATTENTION_PARAM_GROUP), t.param(PAGED_ATTENTION_PARAM_Q_STRIDE),
                         t.fparam(PAGED_ATTENTION_PARAM_SCALE), tid, nt);
}

// gather_rows (the paged head over sequences): fp32 or bf16 rows into fp32 or bf16 rows.
template <typename XT, typename OutT>
__device__ __noinline__ bool run_gather_rows_as(const TaskView& t, int tid, int nt) {
  return gather_rows(t.arg<const XT>(GATHER_ROWS_ARG_X), t.arg<const int32_t>(GATHER_ROWS_ARG_ROWS),
                     t.arg<OutT>(GATHER_ROWS_ARG_OUT), t.param(GATHER_ROWS_PARAM_BATCH), t.param(GATHER_ROWS_PARAM_COLS),
                     t.param(GATHER_ROWS_PARAM_X_STRIDE), t.param(GATHER_ROWS_PARAM_OUT_STRIDE),
                     t.param(GATHER_ROWS_PARAM_X_ROWS), tid, nt);
}

__device__ __noinline__ bool run_gather_rows(const TaskView& t, int tid, int nt) {
  const bool x32 = t.dtype(GATHER_ROWS_ARG_X) == DTYPE_F32, o32 = t.dtype(GATHER_ROWS_ARG_OUT) == DTYPE_F32;
  if (x32) return o32 ? run_gather_rows_as<float, float>(t, tid, nt) : run_gather_rows_as<float, bf16>(t, tid, nt);
  return o32 ? run_gather_rows_as<bf16, float>(t, tid, nt) : run_gather_rows_as<bf16, bf16>(t, tid, nt);
}

// page_alloc (the device page allocator of the paged programs): a fault is recorded here with its own
// code (kErrPagesExhausted, kErrPageRelease, kErrPageTableFull: the host names it); returning false
// then makes the worker raise kErrBadTask too, which loses the record's CAS to this first code. Too
// little shared memory for the slot arrays (tables.smem_bytes sizes it) is a plain bad task.
__device__ __noinline__ bool run_page_alloc(const RuntimeParams& p, const TaskView& t, int step, float* smem, int tid,
                                            int nt) {
  const int B = t.param(PAGE_ALLOC_PARAM_BATCH), MB = t.param(PAGE_ALLOC_PARAM_MAX_SEQS);
  if ((uint32_t)page_alloc_smem_words(B, MB) * sizeof(int) > launch_smem_bytes()) return false;
  const PageFault f = page_alloc(
      t.arg<const int32_t>(PAGE_ALLOC_ARG_RELEASE), t.arg<const int32_t>(PAGE_ALLOC_ARG_POSITIONS),
      t.arg<const int32_t>(PAGE_ALLOC_ARG_SLOTS), t.arg<int32_t>(PAGE_ALLOC_ARG_FREE_PAGES),
      t.arg<int32_t>(PAGE_ALLOC_ARG_NUM_FREE), t.arg<int32_t>(PAGE_ALLOC_ARG_PAGE_TABLE),
      t.arg<int32_t>(PAGE_ALLOC_ARG_PAGES_USED), t.arg<int32_t>(PAGE_ALLOC_ARG_OWNER), B, MB,
      t.param(PAGE_ALLOC_PARAM_MAX_PAGES), t.param(PAGE_ALLOC_PARAM_NUM_PAGES), t.param(PAGE_ALLOC_PARAM_PAGE_SIZE),
      reinterpret_cast<int*>(smem), tid, nt);
  if (f.code == kErrNone) return true;
  if (tid == 0)
    raise_error(p.error, p.halt, f.code, t.task(), f.slot, step, p.rank, (uint32_t)f.seen, (uint32_t)f.expected, 0);
  return false;
}

// ---- qkv_prep + attention in one tile (opt-in fusion 'attn_prep'; docs/TASKGRAPH.md) ----
// bf16 activations and caches only; anything else, a bad position or too little shared memory is a
// bad task (kErrBadTask) instead of something wrong.
template <int MG, int ME>
__device__ __noinline__ void run_attention_prep_attend(const TaskView& t, int p, float* smem, int tid, int nt) {
  attention_seq<MG, ME>(t.arg<const bf16>(ATTENTION_PREP_ARG_Q), t.arg<const bf16>(ATTENTION_PREP_ARG_K_CACHE),
                        t.arg<const bf16>(ATTENTION_PREP_ARG_V_CACHE), t.arg<bf16>(ATTENTION_PREP_ARG_OUT),
                        t.param(ATTENTION_PREP_PARAM_HEAD_DIM), t.param(ATTENTION_PREP_PARAM_GROUP),
                        t.param(ATTENTION_PREP_PARAM_KV_POS_STRIDE), p + 1, t.fparam(ATTENTION_PREP_PARAM_SCALE), smem,
                        tid, nt);
}

__device__ __noinline__ bool run_attention_prep(const TaskView& t, float* smem, int tid, int nt) {
  if (t.dtype(ATTENTION_PREP_ARG_QKV) != DTYPE_BF16 || t.dtype(ATTENTION_PREP_ARG_Q) != DTYPE_BF16 ||
      t.dtype(ATTENTION_PREP_ARG_K_CACHE) != DTYPE_BF16 || t.dtype(ATTENTION_PREP_ARG_V_CACHE) != DTYPE_BF16 ||
      t.dtype(ATTENTION_PREP_ARG_OUT) != DTYPE_BF16)
    return false;
  const int D = t.param(ATTENTION_PREP_PARAM_HEAD_DIM), G = t.param(ATTENTION_PREP_PARAM_GROUP);
  const int p = *t.arg<const int32_t>(ATTENTION_PREP_ARG_POSITIONS);
  if (!attention_prep_ok(D, G, p, t.param(ATTENTION_PREP_PARAM_MAX_SEQ), nt)) return false;
  trace_mark(4, tid);  // trace: the body started (thread 0), as in run_attention_split_prep
  attention_prep_heads(t.arg<const bf16>(ATTENTION_PREP_ARG_QKV), t.arg<const bf16>(ATTENTION_PREP_ARG_Q_NORM_W),
                       t.arg<const bf16>(ATTENTION_PREP_ARG_K_NORM_W), t.arg<const float>(ATTENTION_PREP_ARG_INV_FREQ),
                       t.arg<bf16>(ATTENTION_PREP_ARG_Q), t.arg<bf16>(ATTENTION_PREP_ARG_K_CACHE),
                       t.arg<bf16>(ATTENTION_PREP_ARG_V_CACHE), t.arg<const int32_t>(ATTENTION_PREP_ARG_POSITIONS), 0,
                       t.param(ATTENTION_PREP_PARAM_MAX_SEQ), D, G, t.param(ATTENTION_PREP_PARAM_K_OFFSET),
                       t.param(ATTENTION_PREP_PARAM_V_OFFSET), t.param(ATTENTION_PREP_PARAM_KV_POS_STRIDE),
                       t.fparam(ATTENTION_PREP_PARAM_EPS), tid, nt);
  trace_mark(5, tid);  // trace: thread 0's warp prepared its q head (before the block barrier)
  worker_barrier(nt);  // the q rows and this position's k, v are written before any warp reads them
  trace_mark(0, tid);  // trace: the prep is done; attention_seq marks 1 when the walk is
  // The attention half, as run_attention's body for one sequence. One call per (MG, ME) instance, each
  // with 5 operands (the wrapper reads the rest from the task): 12 attention_seq call sites here, each
  // with all 12 operands live, made ptxas store 44 bytes to local memory in this function.
  const int epl = (D + 31) / 32;
  MPK_ATTN_BOUNDS(G, epl, (run_attention_prep_attend<kMG, kME>(t, p, smem, tid, nt)));
  return true;
}

// ---- qkv_prep folded into split-KV attention tiles (the 'attn_prep' fusion in a split program) ----
// Same contract as run_attention_prep: bf16 qkv and caches, fp32 partials; a bad shape, position or too
// little shared memory is a bad task. Per sequence: the prep into shared memory (and the append where
// this range holds the position), a block barrier, then attention_split's staged body on that q.
template <int MG, int ME>
__device__ __noinline__ void run_split_prep_attend(const TaskView& t, int b, int e, const bf16* qs, float* smem, int tid,
                                                   int nt, KvStage stage) {
  const size_t bs = (size_t)b * t.param(ATTENTION_SPLIT_PREP_PARAM_KV_BATCH_STRIDE);
  attention_split_seq<MG, ME>(qs, t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_K_CACHE) + bs,
                              t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_V_CACHE) + bs,
                              t.arg<float>(ATTENTION_SPLIT_PREP_ARG_OUT) +
                                  (size_t)b * t.param(ATTENTION_SPLIT_PREP_PARAM_OUT_STRIDE),
                              t.param(ATTENTION_SPLIT_PREP_PARAM_HEAD_DIM), t.param(ATTENTION_SPLIT_PREP_PARAM_GROUP),
                              t.param(ATTENTION_SPLIT_PREP_PARAM_KV_POS_STRIDE),
                              t.param(ATTENTION_SPLIT_PREP_PARAM_POS_BEGIN), e,
                              t.fparam(ATTENTION_SPLIT_PREP_PARAM_SCALE), smem, tid, nt, stage);
}

// MPK_PREP_POS_LATE 0: every position checked before the prep (an extra memory round trip before the prep's
// loads; a GPU test checks the default against it bit for bit, tests/runtime/test_code_variants_gpu.py).
#ifndef MPK_PREP_POS_LATE
#define MPK_PREP_POS_LATE 1
#endif

// MPK_SPLIT_PREP_SEQ_OUTLINED 1: one sequence of a split prep tile is a function of its own (below); 0 inlines it
// into run_attention_split_prep, as the body was before. Measured (docs/PERF.md v0.37, H200, one run each):
// outlined is faster where a thread has all 255 registers (qwen3-0.6b, 256 threads: 1.033 / 1.031 vs 1.049 / 1.048
// ms) and slower where it has 128 (qwen3-1.7b, 512 threads: 1.615 / 1.616 vs 1.605 / 1.601), although the spills
// it removes are only in the 128-register builds; so the default follows the register cap.
#define MPK_FULL_REGISTER_THREADS 256  // the most threads a block whose threads each get 255 registers (65,536 / 256)
// The generated source defines MPK_WORKER_THREADS, and MPK_MIN_BLOCKS_PER_SM where a shape asks for more than one
// block, before any header (codegen.render_source); an undefined one reads as 0 here, i.e. the defaults' side.
#ifndef MPK_SPLIT_PREP_SEQ_OUTLINED
#if MPK_WORKER_THREADS <= MPK_FULL_REGISTER_THREADS && !(MPK_MIN_BLOCKS_PER_SM > 1)
#define MPK_SPLIT_PREP_SEQ_OUTLINED 1
#else
#define MPK_SPLIT_PREP_SEQ_OUTLINED 0
#endif
#endif
#if MPK_SPLIT_PREP_SEQ_OUTLINED
#define MPK_SPLIT_PREP_SEQ_INLINE __noinline__
#else
#define MPK_SPLIT_PREP_SEQ_INLINE __forceinline__
#endif

// One sequence of a split prep tile: its q heads prepared and this position's k / v rows appended, then the
// range walked. Outlined, it reads its parameters from the record (shared memory) again, so that the tile's loop
// keeps few values alive across the calls: in one function, at 128 registers a thread (two blocks an SM, or 512
// threads), the values live across attention_prep_heads and the walk spilled 92 / 212 bytes (now 32 / 44 here
// and 32 / 44 in the caller).
__device__ MPK_SPLIT_PREP_SEQ_INLINE bool split_prep_sequence(const TaskView& t, int b, bool use, float* smem, int tid,
                                                              int nt) {
  const int D = t.param(ATTENTION_SPLIT_PREP_PARAM_HEAD_DIM), G = t.param(ATTENTION_SPLIT_PREP_PARAM_GROUP);
  const int S = t.param(ATTENTION_SPLIT_PREP_PARAM_MAX_SEQ);
  const int s0 = t.param(ATTENTION_SPLIT_PREP_PARAM_POS_BEGIN), s1 = t.param(ATTENTION_SPLIT_PREP_PARAM_POS_END);
  const size_t kbs = (size_t)t.param(ATTENTION_SPLIT_PREP_PARAM_KV_BATCH_STRIDE);
  const int32_t* pos = t.arg<const int32_t>(ATTENTION_SPLIT_PREP_ARG_POSITIONS);
  bf16* qs = split_prep_q(smem, G, D, nt);
  attention_prep_heads(t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_QKV) +
                           (size_t)b * t.param(ATTENTION_SPLIT_PREP_PARAM_QKV_STRIDE),
                       t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_Q_NORM_W),
                       t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_K_NORM_W),
                       t.arg<const float>(ATTENTION_SPLIT_PREP_ARG_INV_FREQ), qs,
                       t.arg<bf16>(ATTENTION_SPLIT_PREP_ARG_K_CACHE) + (size_t)b * kbs,
                       t.arg<bf16>(ATTENTION_SPLIT_PREP_ARG_V_CACHE) + (size_t)b * kbs, pos + b, s0, min(s1, S), D,
                       G, t.param(ATTENTION_SPLIT_PREP_PARAM_K_OFFSET), t.param(ATTENTION_SPLIT_PREP_PARAM_V_OFFSET),
                       t.param(ATTENTION_SPLIT_PREP_PARAM_KV_POS_STRIDE), t.fparam(ATTENTION_SPLIT_PREP_PARAM_EPS),
                       tid, nt);
  const int p = pos[b];
  if (p < 0 || p >= S) return false;  // a bad task: its prep wrote no cache row
  if (b == 0) trace_mark(5, tid);  // trace: thread 0's warp prepared its q head (before the block barrier)
  if (use) cp_async_wait_all();  // this thread's staged rows (all sequences' copies: issued by the caller)
  worker_barrier(nt);  // q in shared memory, this position's k and v, before any warp reads them
  if (b == 0) trace_mark(0, tid);  // trace: the prep is done (sequence 0)
  const int e = min(s1, p + 1);
  bf16* stage = reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + split_prep_stage_at(nt >> 5, G, D));
  const KvStage st = use ? kv_stage_of(stage, b, s1 - s0, D, s0, min(s1, p)) : KvStage();
  // run_split_prep_attend ends in a barrier
  MPK_ATTN_BOUNDS(G, (D + 31) / 32, (run_split_prep_attend<kMG, kME>(t, b, e, qs, smem, tid, nt, st)));
  return true;
}

__device__ __noinline__ bool run_attention_split_prep(const TaskView& t, float* smem, int tid,
                                                      int nt MPK_FLAG_STEP_PARAM) {
  if (t.dtype(ATTENTION_SPLIT_PREP_ARG_QKV) != DTYPE_BF16 || t.dtype(ATTENTION_SPLIT_PREP_ARG_K_CACHE) != DTYPE_BF16 ||
      t.dtype(ATTENTION_SPLIT_PREP_ARG_V_CACHE) != DTYPE_BF16 || t.dtype(ATTENTION_SPLIT_PREP_ARG_OUT) != DTYPE_F32)
    return false;
  const int B = t.param(ATTENTION_SPLIT_PREP_PARAM_BATCH), D = t.param(ATTENTION_SPLIT_PREP_PARAM_HEAD_DIM);
  const int G = t.param(ATTENTION_SPLIT_PREP_PARAM_GROUP), S = t.param(ATTENTION_SPLIT_PREP_PARAM_MAX_SEQ);
  if (!split_prep_ok(D, G, nt)) return false;
  trace_mark(4, tid);  // trace: the body started (thread 0)
  bool use = false;
  {  // a scope: these values are dead before the loop's calls
    const int s0 = t.param(ATTENTION_SPLIT_PREP_PARAM_POS_BEGIN), s1 = t.param(ATTENTION_SPLIT_PREP_PARAM_POS_END);
    const int32_t* pos = t.arg<const int32_t>(ATTENTION_SPLIT_PREP_ARG_POSITIONS);
    // The positions are checked before anything is written when the stage's copies (which use them) go first;
    // otherwise after sequence b's prep, which reads pos[b] beside its loads and appends no row outside [0, S).
    const bool check_first = !MPK_PREP_POS_LATE || t.flag(REC_FLAG_STAGE_KV);
    if (check_first)
      for (int b = 0; b < B; ++b)
        if (pos[b] < 0 || pos[b] >= S) return false;
    // The range's rows below each position (written by earlier steps) fly into shared memory during the prep.
    const int stage_at = split_prep_stage_at(nt >> 5, G, D), kps = t.param(ATTENTION_SPLIT_PREP_PARAM_KV_POS_STRIDE);
    const int kbs = t.param(ATTENTION_SPLIT_PREP_PARAM_KV_BATCH_STRIDE);
    bf16* stage = reinterpret_cast<bf16*>(reinterpret_cast<char*>(smem) + stage_at);
    const bf16* kc = t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_K_CACHE);
    const bf16* vc = t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_V_CACHE);
    use = t.flag(REC_FLAG_STAGE_KV) && kv_stage_ok(kc, vc, D, kps, kbs, stage_at + kv_stage_bytes(B, s1 - s0, D));
    if (use) kv_stage_issue(kc, vc, pos, B, D, kps, kbs, s0, s1, 0, stage, tid, nt);
  }
  for (int b = 0; b < B; ++b)
    if (!split_prep_sequence(t, b, use, smem, tid, nt)) return false;
  trace_mark(2, tid);  // trace: the walk and the block merge are done (the ticket and the head merge follow)
  if (t.dtype(ATTENTION_SPLIT_PREP_ARG_TICKET) >= 0) {  // fusion 'attn_merge': the head's last range merges it
    const int out_stride = t.param(ATTENTION_SPLIT_PREP_PARAM_OUT_STRIDE);
    attention_merge_last(t.arg<uint32_t>(ATTENTION_SPLIT_PREP_ARG_TICKET),
                         split_head_partials(t.arg<const float>(ATTENTION_SPLIT_PREP_ARG_OUT),
                                             t.param(ATTENTION_SPLIT_PREP_PARAM_SPLIT_INDEX), G, D),
                         t.arg<bf16>(ATTENTION_SPLIT_PREP_ARG_MERGED), B, D, G, split_count(out_stride, G, D), out_stride,
                         t.param(ATTENTION_SPLIT_PREP_PARAM_QKV_STRIDE) - 2 * t.param(ATTENTION_SPLIT_PREP_PARAM_V_OFFSET),
                         tid, nt
#if MPK_FLAG_WORDS
                         , t.arg<uint64_t>(ATTENTION_SPLIT_PREP_ARG_MERGED_FLAGS), flag_tag_of_step(step)
#endif
    );
  }
  return true;
}

// MPK_SMALL_KINDS_OUTLINED 1: the kinds whose bodies run_task used to inline (step_begin, silu_mul, the argmax and
// nucleus kinds: each runs once a step, or once a layer only in unfused programs) run in one non-inlined function,
// so the kernel entry, whose worker loop runs every task, holds only the dispatch: 2,450 instead of 6,580 SASS
// instructions, qwen3-0.6b 1.143 / 1.145 vs 1.146 / 1.148 ms, qwen3-8b 4.820 / 4.810 vs 4.832 / 4.833 (docs/PERF.md
// v0.20; bitwise equal). 0: inlined into the entry as before.
#ifndef MPK_SMALL_KINDS_OUTLINED
#define MPK_SMALL_KINDS_OUTLINED 1
#endif
#if MPK_SMALL_KINDS_OUTLINED
#define MPK_SMALL_KINDS_INLINE __noinline__
#else
#define MPK_SMALL_KINDS_INLINE __forceinline__
#endif

// The kinds without a run_* function of their own; false for an opcode that is none of them.
__device__ MPK_SMALL_KINDS_INLINE bool run_small_kind(const TaskView& t, int op, int step, float* smem, int tid, int nt) {
  switch (op) {
    case OP_STEP_BEGIN:
      step_begin(t.arg<const int32_t>(STEP_BEGIN_ARG_FORCED), t.arg<const int32_t>(STEP_BEGIN_ARG_START_POS),
                 t.arg<const int32_t>(STEP_BEGIN_ARG_NEXT_TOKEN), t.arg<int32_t>(STEP_BEGIN_ARG_TOKENS),
                 t.arg<int32_t>(STEP_BEGIN_ARG_POSITIONS), t.param(STEP_BEGIN_PARAM_BATCH), step, tid, nt);
      return true;
    case OP_SILU_MUL:
      silu_mul(t.arg<const bf16>(SILU_MUL_ARG_GU), t.arg<bf16>(SILU_MUL_ARG_OUT), t.param(SILU_MUL_PARAM_BATCH),
               t.param(SILU_MUL_PARAM_COLS), t.param(SILU_MUL_PARAM_GU_STRIDE), t.param(SILU_MUL_PARAM_UP_OFFSET),
               t.param(SILU_MUL_PARAM_OUT_STRIDE), tid, nt);
      return true;
    case OP_ARGMAX_PARTIAL:
      argmax_partial(t.arg<const float>(ARGMAX_PARTIAL_ARG_LOGITS), t.arg<float>(ARGMAX_PARTIAL_ARG_OUT),
                     t.arg<const int32_t>(ARGMAX_PARTIAL_ARG_SAMPLING), t.arg<const float>(ARGMAX_PARTIAL_ARG_CUT),
                     t.param(ARGMAX_PARTIAL_PARAM_BATCH),
                     t.param(ARGMAX_PARTIAL_PARAM_COLS), t.param(ARGMAX_PARTIAL_PARAM_LOGITS_STRIDE),
                     t.param(ARGMAX_PARTIAL_PARAM_OUT_STRIDE), t.param(ARGMAX_PARTIAL_PARAM_INDEX_BASE), step, smem,
                     tid, nt);
      return true;
    case OP_ARGMAX_REDUCE:
      argmax_reduce(t.arg<const float>(ARGMAX_REDUCE_ARG_PARTIAL), t.arg<float>(ARGMAX_REDUCE_ARG_OUT),
                    t.param(ARGMAX_REDUCE_PARAM_BATCH), t.param(ARGMAX_REDUCE_PARAM_NTILES), smem, tid, nt);
      return true;
    case OP_ARGMAX_SELECT:
      argmax_select(t.arg<const float>(ARGMAX_SELECT_ARG_CANDS), t.arg<int32_t>(ARGMAX_SELECT_ARG_NEXT_TOKEN),
                    t.arg<int32_t>(ARGMAX_SELECT_ARG_TOKEN_OUT), t.param(ARGMAX_SELECT_PARAM_BATCH),
                    t.param(ARGMAX_SELECT_PARAM_WORLD), step, tid, nt);
      return true;
    case OP_ARGMAX_NUCLEUS_HIST:
      argmax_nucleus_hist(t.arg<const float>(ARGMAX_NUCLEUS_HIST_ARG_LOGITS),
                          t.arg<const float>(ARGMAX_NUCLEUS_HIST_ARG_MAXES),
                          t.arg<const int32_t>(ARGMAX_NUCLEUS_HIST_ARG_SAMPLING),
                          t.arg<int32_t>(ARGMAX_NUCLEUS_HIST_ARG_HIST), t.param(ARGMAX_NUCLEUS_HIST_PARAM_BATCH),
                          t.param(ARGMAX_NUCLEUS_HIST_PARAM_COLS), t.param(ARGMAX_NUCLEUS_HIST_PARAM_LOGITS_STRIDE),
                          t.param(ARGMAX_NUCLEUS_HIST_PARAM_WORLD), tid, nt);
      return true;
    case OP_ARGMAX_NUCLEUS_CUT:
      argmax_nucleus_cut(t.arg<const int32_t>(ARGMAX_NUCLEUS_CUT_ARG_HIST_ALL),
                         t.arg<const float>(ARGMAX_NUCLEUS_CUT_ARG_MAXES),
                         t.arg<const int32_t>(ARGMAX_NUCLEUS_CUT_ARG_SAMPLING), t.arg<float>(ARGMAX_NUCLEUS_CUT_ARG_CUT),
                         t.arg<int32_t>(ARGMAX_NUCLEUS_CUT_ARG_HIST), t.param(ARGMAX_NUCLEUS_CUT_PARAM_BATCH),
                         t.param(ARGMAX_NUCLEUS_CUT_PARAM_WORLD), smem, tid, nt);
      return true;
    default: return false;
  }
}

// Run task `task` of step `step` on the worker threads (tid < nt). Returns false for an unknown
// opcode (the caller raises kErrBadTask).
__device__ bool run_task(const RuntimeParams& p, const int32_t* rec, int step, float* smem, int tid, int nt) {
  const TaskView t(p, rec);
  const int op = t.opcode();
  switch (op) {
    case OP_EMBEDDING:
      if (t.dtype(EMBEDDING_ARG_OUT) == DTYPE_F32) run_embedding_as<float>(t, tid, nt);
      else run_embedding_as<bf16>(t, tid, nt);
      return true;
    case OP_RMS_NORM: run_rms_norm(t, smem, tid, nt); return true;
    case OP_LINEAR: run_linear(t, tid, nt); return true;
    case OP_QKV_PREP: run_qkv_prep(t, tid, nt); return true;
    case OP_ATTENTION: run_attention(t, smem, tid, nt); return true;
    case OP_ADD: run_add(t, tid, nt); return true;
    case OP_ALLREDUCE_PUSH:
    case OP_ALLGATHER_PUSH: run_comm_push(t, op, tid, nt); return true;
    case OP_ALLREDUCE_REDUCE: run_allreduce_reduce(t, tid, nt); return true;
    case OP_NORM_LINEAR: return run_norm_linear(t, smem, tid, nt MPK_FLAG_STEP_ARG);
    // the gate|up projection + silu epilogue
    case OP_NORM_LINEAR_SILU: return run_norm_linear(t, smem, tid, nt MPK_FLAG_STEP_ARG);
    case OP_LINEAR_RESIDUAL: return run_linear_residual(t, smem, tid, nt MPK_FLAG_STEP_ARG);
    case OP_SILU_LINEAR: return MPK_SILU_LINEAR_KIND && run_silu_linear(t, smem, tid, nt);
    case OP_ATTENTION_SPLIT: return run_attention_split(t, smem, tid, nt MPK_FLAG_STEP_ARG);
    case OP_ATTENTION_MERGE: return run_attention_merge(t, tid, nt);
    case OP_QKV_PREP_PAGED: return run_qkv_prep_paged(t, tid, nt);
    case OP_PAGED_ATTENTION: return run_paged_attention(t, tid, nt);
    case OP_GATHER_ROWS: return run_gather_rows(t, tid, nt);
    case OP_PAGE_ALLOC: return run_page_alloc(p, t, step, smem, tid, nt);
    case OP_ATTENTION_PREP: return run_attention_prep(t, smem, tid, nt);
    case OP_ATTENTION_SPLIT_PREP: return run_attention_split_prep(t, smem, tid, nt MPK_FLAG_STEP_ARG);
    default: return run_small_kind(t, op, step, smem, tid, nt);
  }
}

// The q/k norm weights and rope frequencies a prep tile reads first (constants: safe before the wait).
__device__ __forceinline__ void prep_constants_prefetch(const bf16* q_norm, const bf16* k_norm, const float* inv_freq,
                                                        int D, int tid, int nt) {
  if (q_norm != nullptr) prefetch_l2(q_norm, (uint64_t)D * sizeof(bf16), tid, nt);
  if (k_norm != nullptr) prefetch_l2(k_norm, (uint64_t)D * sizeof(bf16), tid, nt);
  prefetch_l2(inv_freq, (uint64_t)(D / 2) * sizeof(float), tid, nt);
}

// The cache rows an attention tile will read, into L2 before its wait (attn_prefetch_rows,
// csrc/tasks/attention.cuh), and for the prep tiles their constants. Positions are read now: this step's
// may not be written yet, and a position one short only leaves the newest row to the tile's own load.
__device__ __noinline__ void attention_prefetch(const TaskView& t, bool bulk, int tid, int nt) {
  const int op = t.opcode();
  if (op == OP_ATTENTION_PREP) {  // one tile = (kv head, one sequence)
    prep_constants_prefetch(t.arg<const bf16>(ATTENTION_PREP_ARG_Q_NORM_W), t.arg<const bf16>(ATTENTION_PREP_ARG_K_NORM_W),
                            t.arg<const float>(ATTENTION_PREP_ARG_INV_FREQ), t.param(ATTENTION_PREP_PARAM_HEAD_DIM), tid,
                            nt);
    attn_prefetch_rows(t.arg<const bf16>(ATTENTION_PREP_ARG_K_CACHE), t.arg<const bf16>(ATTENTION_PREP_ARG_V_CACHE),
                       t.param(ATTENTION_PREP_PARAM_HEAD_DIM), (size_t)t.param(ATTENTION_PREP_PARAM_KV_POS_STRIDE), 0,
                       *t.arg<const int32_t>(ATTENTION_PREP_ARG_POSITIONS) + 1, t.param(ATTENTION_PREP_PARAM_MAX_SEQ),
                       bulk, tid, nt);
    return;
  }
  if (op == OP_ATTENTION_SPLIT_PREP) {  // all sequences, one KV range
    prep_constants_prefetch(t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_Q_NORM_W),
                            t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_K_NORM_W),
                            t.arg<const float>(ATTENTION_SPLIT_PREP_ARG_INV_FREQ),
                            t.param(ATTENTION_SPLIT_PREP_PARAM_HEAD_DIM), tid, nt);
    const int B = t.param(ATTENTION_SPLIT_PREP_PARAM_BATCH), ps = t.param(ATTENTION_SPLIT_PREP_PARAM_KV_POS_STRIDE);
    const int bs = t.param(ATTENTION_SPLIT_PREP_PARAM_KV_BATCH_STRIDE);
    const int32_t* pos = t.arg<const int32_t>(ATTENTION_SPLIT_PREP_ARG_POSITIONS);
    for (int b = 0; b < B; ++b)
      attn_prefetch_rows(t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_K_CACHE) + (size_t)b * bs,
                         t.arg<const bf16>(ATTENTION_SPLIT_PREP_ARG_V_CACHE) + (size_t)b * bs,
                         t.param(ATTENTION_SPLIT_PREP_PARAM_HEAD_DIM), (size_t)ps,
                         t.param(ATTENTION_SPLIT_PREP_PARAM_POS_BEGIN),
                         min(t.param(ATTENTION_SPLIT_PREP_PARAM_POS_END), pos[b] + 1),
                         t.param(ATTENTION_SPLIT_PREP_PARAM_MAX_SEQ), bulk, tid, nt);
    return;
  }
  const bool split = op == OP_ATTENTION_SPLIT;
  const bf16* kc = t.arg<const bf16>(split ? ATTENTION_SPLIT_ARG_K_CACHE : ATTENTION_ARG_K_CACHE);
  const bf16* vc = t.arg<const bf16>(split ? ATTENTION_SPLIT_ARG_V_CACHE : ATTENTION_ARG_V_CACHE);
  const int32_t* pos = t.arg<const int32_t>(split ? ATTENTION_SPLIT_ARG_POSITIONS : ATTENTION_ARG_POSITIONS);
  const int B = t.param(split ? ATTENTION_SPLIT_PARAM_BATCH : ATTENTION_PARAM_BATCH);
  const int D = t.param(split ? ATTENTION_SPLIT_PARAM_HEAD_DIM : ATTENTION_PARAM_HEAD_DIM);
  const int ps = t.param(split ? ATTENTION_SPLIT_PARAM_KV_POS_STRIDE : ATTENTION_PARAM_KV_POS_STRIDE);
  const int bs = t.param(split ? ATTENTION_SPLIT_PARAM_KV_BATCH_STRIDE : ATTENTION_PARAM_KV_BATCH_STRIDE);
  const int s0 = split ? t.param(ATTENTION_SPLIT_PARAM_POS_BEGIN) : 0;
  const int s1 = split ? t.param(ATTENTION_SPLIT_PARAM_POS_END) : bs / max(ps, 1);
  for (int b = 0; b < B; ++b)
    attn_prefetch_rows(kc + (size_t)b * bs, vc + (size_t)b * bs, D, (size_t)ps, s0, min(s1, pos[b] + 1),
                       bs / max(ps, 1), bulk, tid, nt);
}

// Issued before a task waits on its events: start streaming the bytes that do not depend on them
// (a linear tile's weights, an attention tile's older cache rows) into L2, and prime the weight ring
// (MPK_LINEAR_TMA). planned: the linear tiles' byte count (the host's plan, prefetch_plan.py, or -1: the
// MPK_PREFETCH_KB cap); the aot worker also calls it for its NEXT task with REC_PREFETCH_NEXT.
// MPK_PREFETCH_ONE_SITE 1: the linear kinds pick their weight block and the prefetch is issued from one place (a
// second block for norm_linear_silu's up rows); 0: each kind's branch inlines its own copy of the prefetch loops
// (the former code: four, then five copies in the kernel entry, whose worker loop this function is part of).
#ifndef MPK_PREFETCH_ONE_SITE
#define MPK_PREFETCH_ONE_SITE 1
#endif
// MPK_PREFETCH_NORM_W 1: the norm_linear kinds also put their norm weights (K bf16) in L2 before the wait, so the
// prologue's second read (the normalised row needs them right after the row statistic) is an L2 hit instead of a
// trip to HBM under the previous level's stream (the norm weights of ~1 GB of layers do not stay in L2 from one step
// to the next). Measured (docs/PERF.md v0.31, one process each, 64 tokens at context ~512): qwen3-0.6b batch 1
// 1.099 / 1.096 ms vs 1.105 / 1.104 without, qwen3-1.7b 1.665 / 1.666 vs 1.673 / 1.677, qwen3-8b 4.614 / 4.619 vs
// 4.613 / 4.617; qwen3-8b batch 8 (v0.29) 5.762 / 5.730 vs 5.714 / 5.722, so batch-1 kernels only by default (at
// batch 8 the prologue is not where the level waits). A hint only: the values read do not change.
#ifndef MPK_PREFETCH_NORM_W
#if defined(MPK_BATCH) && MPK_BATCH == 1
#define MPK_PREFETCH_NORM_W 1
#else
#define MPK_PREFETCH_NORM_W 0
#endif
#endif
__device__ void prefetch_task(const RuntimeParams& p, const int32_t* rec, int planned, int tid, int nt) {
  const TaskView t(p, rec);
  const bool bulk = (rec[REC_FLAGS] & REC_FLAG_BULK_PREFETCH) != 0;
#if MPK_PREFETCH_ONE_SITE
  const int op = t.opcode();
  const bf16* w = nullptr;  // the weight block of a linear kind (its first when it has two)
  int K = 0, n_tile = 0;
  long long second = 0;  // elements from the first block to the second (norm_linear_silu's up rows), 0: one block
  const bf16* norm_w = nullptr;  // the norm_linear kinds' norm weights (MPK_PREFETCH_NORM_W)
  if (op == OP_LINEAR) {
    w = t.arg<const bf16>(LINEAR_ARG_W), K = t.param(LINEAR_PARAM_K), n_tile = t.param(LINEAR_PARAM_N_TILE);
  } else if (op == OP_NORM_LINEAR) {  // fused linears: the weight block is independent of the waits too
    w = t.arg<const bf16>(NORM_LINEAR_ARG_W), K = t.param(NORM_LINEAR_PARAM_K), n_tile = t.param(NORM_LINEAR_PARAM_N_TILE);
    norm_w = t.arg<const bf16>(NORM_LINEAR_ARG_NORM_W);
  } else if (op == OP_LINEAR_RESIDUAL) {
    w = t.arg<const bf16>(LINEAR_RESIDUAL_ARG_W), K = t.param(LINEAR_RESIDUAL_PARAM_K);
    n_tile = t.param(LINEAR_RESIDUAL_PARAM_N_TILE);
  } else if (op == OP_SILU_LINEAR) {
    w = t.arg<const bf16>(SILU_LINEAR_ARG_W), K = t.param(SILU_LINEAR_PARAM_K), n_tile = t.param(SILU_LINEAR_PARAM_N_TILE);
  } else if (op == OP_NORM_LINEAR_SILU) {  // half of the planned bytes from each weight block
    w = t.arg<const bf16>(NORM_LINEAR_SILU_ARG_W), K = t.param(NORM_LINEAR_SILU_PARAM_K);
    n_tile = t.param(NORM_LINEAR_SILU_PARAM_N_TILE);
    second = (long long)t.param(NORM_LINEAR_SILU_PARAM_UP_ROWS) * K;
    norm_w = t.arg<const bf16>(NORM_LINEAR_SILU_ARG_NORM_W);
  }
  if (MPK_PREFETCH_NORM_W && norm_w != nullptr) prefetch_l2(norm_w, (uint64_t)K * sizeof(bf16), tid, nt);
#if MPK_SILU_DOWN
  if (op == OP_NORM_LINEAR_SILU && t.arg<const bf16>(NORM_LINEAR_SILU_ARG_WD) != nullptr)  // the folded down's columns
    down_partial_prefetch(t.arg<const bf16>(NORM_LINEAR_SILU_ARG_WD), t.param(NORM_LINEAR_SILU_PARAM_N_TILE) / 2,
                          t.param(NORM_LINEAR_SILU_PARAM_WD_STRIDE), t.param(NORM_LINEAR_SILU_PARAM_H), tid, nt);
#endif
  if (w != nullptr) {
    linear_blocks_prefetch(w, K, n_tile, second, planned, bulk, tid, nt);
    return;
  }
#else
  if (t.opcode() == OP_LINEAR)
    linear_prefetch(t.arg<const bf16>(LINEAR_ARG_W), t.param(LINEAR_PARAM_K), t.param(LINEAR_PARAM_N_TILE), planned,
                    bulk, tid, nt);
  else if (t.opcode() == OP_NORM_LINEAR)  // fused linears: the weight block is independent of the waits too
    linear_prefetch(t.arg<const bf16>(NORM_LINEAR_ARG_W), t.param(NORM_LINEAR_PARAM_K),
                    t.param(NORM_LINEAR_PARAM_N_TILE), planned, bulk, tid, nt);
  else if (t.opcode() == OP_NORM_LINEAR_SILU)  // half of the planned bytes from each weight block
    linear_blocks_prefetch(t.arg<const bf16>(NORM_LINEAR_SILU_ARG_W), t.param(NORM_LINEAR_SILU_PARAM_K),
                           t.param(NORM_LINEAR_SILU_PARAM_N_TILE),
                           (long long)t.param(NORM_LINEAR_SILU_PARAM_UP_ROWS) * t.param(NORM_LINEAR_SILU_PARAM_K),
                           planned, bulk, tid, nt);
  else if (t.opcode() == OP_LINEAR_RESIDUAL)
    linear_prefetch(t.arg<const bf16>(LINEAR_RESIDUAL_ARG_W), t.param(LINEAR_RESIDUAL_PARAM_K),
                    t.param(LINEAR_RESIDUAL_PARAM_N_TILE), planned, bulk, tid, nt);
  else if (t.opcode() == OP_SILU_LINEAR)
    linear_prefetch(t.arg<const bf16>(SILU_LINEAR_ARG_W), t.param(SILU_LINEAR_PARAM_K),
                    t.param(SILU_LINEAR_PARAM_N_TILE), planned, bulk, tid, nt);
#endif
#if MPK_ATTN_PREFETCH
  if (t.opcode() == OP_ATTENTION || t.opcode() == OP_ATTENTION_SPLIT || t.opcode() == OP_ATTENTION_PREP ||
      t.opcode() == OP_ATTENTION_SPLIT_PREP)
    attention_prefetch(t, bulk, tid, nt);
#endif
}

}  // namespace mpk
