// The decode attention walk on tensor cores (MPK_ATTN_MMA_WALK for attention_seq, default on; MPK_ATTN_SPLIT_MMA_WALK
// for attention_split_seq, default off): one warp takes its positions 16 at a time. The block's scores are one
// m16n8k16 tile chain S^T = K q^T (rows = the block's 16 positions, cols = the group's heads, k = head dims), its
// values one m16n8k16 tile per 16 dims, O^T += V^T P^T (rows = dims, cols = heads, k = the 16 positions). Used
// when the shape allows it (attn_mma_walk_ok), else attn_warp_step (or, built with MPK_ATTN_MMA_WALK=0, the
// scalar block walk of attention_block_walk.cuh).
//
// Why: a batch-8 trace (docs/PERF.md v0.27) put the unsplit tile's scalar block walk at ~19 us of a ~26 us tile
// while it moved only 256 KB: its loop is instruction bound, ~1,000 instructions per warp and 8 positions
// (scalar FMAs, bf16 -> fp32 conversions repeated per head, shuffles) times 16 warps an SM. This loop is ~330
// instructions per warp and 16 positions (16 mmas, 16 vector loads, 2 movmatrix, 32 byte permutes).
//
// Operands (mma_ops.cuh has the fragment layouts; lane = 4 g + t):
//  * scores: A = K (row g = position b0 + g, row g + 8 = position b0 + g + 8), B = q^T (col g = head g; heads
//    g >= G read head 0 and are never stored). The k index (head dims) is permuted as in linear_mma.cuh: for
//    chunk c of 32 dims, lane (g, t) holds dims c*32 + 8t .. +7 of its rows in one 16-byte load, elements 0-3
//    feed one mma and 4-7 the next; A and B use the same order, so each dot product is unchanged. Products of
//    bf16 are exact in the tensor core and summed in fp32. No operand register is padding.
//  * softmax: lane (g, t) holds heads 2t and 2t + 1 at positions g and g + 8; a head's block max and sum are
//    three shuffles each over the 8 lanes of one t, so m and l of heads 2t, 2t + 1 sit in exactly the lanes
//    whose accumulators hold those heads (no shuffle for the rescale).
//  * values: B = P^T, the probabilities rounded to bf16 (as flash attention feeds them), each 8 x 8 half of the
//    score tile transposed across the warp with movmatrix; A = V^T: row g / g + 8 of tile i = dims g*D/8 + 2i
//    and + 1, k = positions 2t, 2t + 1, 2t + 8, 2t + 9 of the block, paired from the lane's 16-byte loads of
//    those four rows with byte permutes. Accumulators: tile i, d0..d3 = (dim g*D/8 + 2i, heads 2t, 2t + 1) and
//    (dim + 1, same).
// Another summation order than the scalar walks and bf16 probabilities, so compared with torch, not bit for bit.
//
// Measured on an H200 (docs/PERF.md v0.27, one process, alternating): qwen3-8b batch 8 (unsplit tiles)
// 5.918 / 5.917 ms vs 6.266 / 6.248 with the scalar block walk, the walk-done mark 11.1-12.7 us after the
// tile's inputs instead of 21.8-22.9; forced logits vs torch (qwen3-0.6b, 257 steps) 0.0195 at batch 16 with
// it, argmax 100%. The split tiles of batch 1 (2-3 positions a warp: one block mostly empty) gain nothing:
// qwen3-0.6b 1.100 / 1.096 ms vs 1.091 / 1.090 (forced logits with it 0.0198 at b1, 0.0185 at b4), so
// MPK_ATTN_SPLIT_MMA_WALK stays off.
// Registers: at 512 threads the walk fits 128 without spills (tests/runtime/test_attn_prep_build.py checks it) with
// its row offsets as ints and its value loads after the score mmas (MPK_ATTN_MMA_WALK_INT_ROWS, default 1). With
// 64-bit row addresses and the value loads first (=0) the D = 128 instances spilled ~100 B (loop invariants
// refilled each block) and the kernel entry's frame grew 592 -> 608 B; the numbers above are with that spill.
// Without it (docs/PERF.md v0.28, one process): qwen3-8b batch 8 5.735 / 5.738 ms vs 5.823 / 5.832, same tokens.
#pragma once
#include "common.cuh"
#include "mma_ops.cuh"
#include "trace_marks.cuh"

#ifndef MPK_ATTN_MMA_WALK
#define MPK_ATTN_MMA_WALK 1
#endif
#ifndef MPK_ATTN_MMA_WALK_INT_ROWS
#define MPK_ATTN_MMA_WALK_INT_ROWS 1
#endif
#ifndef MPK_ATTN_SPLIT_MMA_WALK
#define MPK_ATTN_SPLIT_MMA_WALK 0
#endif
// MPK_ATTN_WALK_PREFETCH 1 (off until measured; the same loads and sums, so the same bits): when a block's key loads
// are issued, its value rows and the next block's key rows go into L1 by line prefetches (attn_walk_prefetch), so
// the value loads after the scores and the next block's key loads find their lines there instead of each being a
// round trip of their own: 4 dependent round trips a warp become ~1 at the 8B presets' ~30 positions a warp (two
// blocks). Why: the unsplit batch-1 walk takes 6.0-6.8 us for 248 KB on one SM (docs/PERF.md v0.39, H100), and
// staging the keys alone in shared memory did not shorten it (v0.30: it shrank L1 instead).
#ifndef MPK_ATTN_WALK_PREFETCH
#define MPK_ATTN_WALK_PREFETCH 0
#endif
// MPK_ATTN_WALK_MARKS 1 (a measurement build: two more timer reads): the unsplit walk (attention_seq) stamps trace
// marks 2 and 3 when warp 0 has its first block's scores (its key loads came back) and when that block is summed,
// to split the walk's time between the loads' round trips and the arithmetic (marks 0 and 1 bracket the walk).
#ifndef MPK_ATTN_WALK_MARKS
#define MPK_ATTN_WALK_MARKS 0
#endif

namespace mpk {

constexpr int kMmaWalkBlock = 16;        // positions a block: the m of the score tile
constexpr int kMmaWalkHalf = 8;          // positions of one 8 x 8 half of it (one movmatrix)
constexpr int kMmaWalkMaxHeads = 8;      // heads of a group: the n of the score tile
constexpr int kMmaWalkVec = 8;           // bf16 of one 16-byte load
constexpr int kMmaLaneGroups = 8;        // lane groups g of a warp: each takes D / 8 of the value dims
constexpr int kMmaWalkChunk = 32;        // head dims a lane quad covers with one 16-byte load per lane
constexpr int kMmaWalkDimsPerTile = 16;  // value dims one m16n8k16 tile accumulates
constexpr int kMarkWalkScores = 2;       // trace mark (MPK_ATTN_WALK_MARKS): warp 0's first block has its scores
constexpr int kMarkWalkBlock = 3;        // trace mark (MPK_ATTN_WALK_MARKS): warp 0's first block is summed

// Instances the tensor-core walk compiles for: up to 8 heads, D = 64 or 128 (ME = 2 or 4 elements a lane).
template <int MG, int ME>
constexpr bool kAttnMmaWalkFits = MG <= kMmaWalkMaxHeads && (ME == 2 || ME == 4);

// Whether the walk handles the shape: an instance that fits, D == 32 * ME, G <= MG, rows and q 16-byte aligned,
// and the element offset of row `end` within an int (the walk's row offsets are ints).
template <int MG, int ME>
__device__ __forceinline__ bool attn_mma_walk_ok(const bf16* q, const bf16* kc, const bf16* vc, int D, int G,
                                                 int kv_ps, int end) {
  return kAttnMmaWalkFits<MG, ME> && D == 32 * ME && G >= 1 && G <= MG && kv_ps % kMmaWalkVec == 0 &&
         (long long)end * kv_ps <= INT_MAX &&
         ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc)) &
          15) == 0;
}

// MPK_ATTN_WALK_PREFETCH: the L1 line prefetches issued with block b0's key loads (row(base, k): the element
// address of the warp's k-th position's row). This lane's 32-byte piece of each of its four value rows (the pieces of
// lanes g = 0..7 make up a row), and the next block's key rows, one line each for lanes t = 0..3 (rows g and g + 8).
template <typename RowOf>
__device__ __forceinline__ void attn_walk_prefetch(const RowOf& row, const bf16* kc, const bf16* vc, int D, int b0,
                                                   int n, int g, int t, int dims0) {
#pragma unroll
  for (int r = 0; r < 4; ++r) prefetch_l1_line(row(vc, b0 + 2 * t + (r & 1) + (r >> 1) * kMmaWalkHalf) + dims0);
  if (b0 + kMmaWalkBlock < n) {
    const int lines = max(1, D * (int)sizeof(bf16) / kL2LineBytes);  // lines of one key row
    for (int c = t; c < 2 * lines; c += 4)
      prefetch_l1_line(row(kc, b0 + kMmaWalkBlock + g + (c < lines ? 0 : kMmaWalkHalf)) +
                       (c % lines) * (kL2LineBytes / (int)sizeof(bf16)));
  }
}

// Where a walk's final state goes when each head's entry holds it all: G entries of (acc[0..D), m, l), `entry`
// floats apart, at `out` (attn_warp_store's layout: split-KV's partials, the unphased block merge).
struct WalkStoreAt {
  float* out;
  int entry, D;
  template <typename StoreAcc, typename StoreMl>
  __device__ __forceinline__ void operator()(StoreAcc&& store_acc, StoreMl&& store_ml) const {
    store_acc(out, entry);
    store_ml(out + D, entry);
  }
};

// One warp's online softmax over positions first, first + stride, ... < end for the G heads of q ([G][D] bf16),
// handed over as finish(store_acc, store_ml): store_acc(out, entry) stores the G accumulators (head j's dims at
// out[j * entry + d]), store_ml(ml, stride) the G (m, l) pairs (at ml[j * stride], ml[j * stride + 1]), each whenever
// finish calls it (attention_seq's phased merge stores a warp's accumulators only in its phase, so they stay in
// registers until then). The caller checked attn_mma_walk_ok (an instance that does not fit compiles no walk and
// never calls finish). mark_tid: the caller's thread index where it owns trace marks 2 and 3 (attention_seq under
// MPK_ATTN_WALK_MARKS), else -1.
template <int MG, int ME, typename Finish>
__device__ __forceinline__ void attn_mma_walk_then(const bf16* q, const bf16* kc, const bf16* vc, int D, int G,
                                                   int kv_ps, int first, int end, int stride, float scale, int lane,
                                                   Finish&& finish, int mark_tid = -1) {
  if constexpr (kAttnMmaWalkFits<MG, ME>) {
    constexpr int kTiles = 32 * ME / kMmaWalkDimsPerTile;  // value tiles: D / 16
    constexpr int kVecs = ME / 2;                           // 16-byte pieces of a lane's D / 8 value dims
    const int g = lane >> 2, t = lane & 3;
    const int dims0 = g * (D / kMmaLaneGroups);  // this lane's value dims: dims0 .. dims0 + D/8 - 1
    // B operand of the scores: head g, dims c*32 + 8t .. +7, re-read each block (16 bytes a chunk, from L1)
    // instead of held in 4 * ME registers, which the loop is short of (held or re-read, ptxas reported the same
    // spills and frame; the measured build re-reads). Heads g >= G read head 0: their columns are dropped.
    const bf16* qrow = q + (size_t)(g < G ? g : 0) * D + kMmaWalkVec * t;
    float acc[kTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    // Heads 2t and 2t + 1 (this lane's score and accumulator columns): running max and sum, equal in the
    // 8 lanes of one t.
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const int n = end > first ? (end - first + stride - 1) / stride : 0;  // this warp's positions
    const int last = n - 1;
    // Slots past the warp's last position re-read that position's rows (their weight is 0): no predicates.
#if MPK_ATTN_MMA_WALK_INT_ROWS
    // Element offsets as ints (attn_mma_walk_ok checked that they fit): 64-bit addresses for the six rows of a
    // block cost the registers that made ptxas spill (see "Registers" above).
    auto row = [&](const bf16* base, int k) { return base + (first + min(k, last) * stride) * kv_ps; };
#else
    auto row = [&](const bf16* base, int k) { return base + (size_t)(first + min(k, last) * stride) * kv_ps; };
#endif
    // Value rows of positions b0 + 2t, + 1, + 8, + 9 (the k slots of this lane), its dims only. Loaded after the
    // score mmas (with the int row offsets, MPK_ATTN_MMA_WALK_INT_ROWS), so the key rows' registers are free.
    constexpr bool kValuesAfterScores = MPK_ATTN_MMA_WALK_INT_ROWS != 0;
    auto load_values = [&](uint4 (&vw)[4][kVecs], int b0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const bf16* vr = row(vc, b0 + 2 * t + (r & 1) + (r >> 1) * kMmaWalkHalf) + dims0;
#pragma unroll
        for (int c = 0; c < kVecs; ++c) vw[r][c] = ld_act_v4(vr + kMmaWalkVec * c);
      }
    };
#pragma unroll 1
    for (int b0 = 0; b0 < n; b0 += kMmaWalkBlock) {
      const bf16* k_lo = row(kc, b0 + g) + kMmaWalkVec * t;  // score rows g and g + 8: positions b0 + g, + 8
      const bf16* k_hi = row(kc, b0 + g + kMmaWalkHalf) + kMmaWalkVec * t;
      uint4 ka[ME], kb[ME];
#pragma unroll
      for (int c = 0; c < ME; ++c) {
        ka[c] = ld_act_v4(k_lo + c * kMmaWalkChunk);
        kb[c] = ld_act_v4(k_hi + c * kMmaWalkChunk);
      }
      if constexpr (MPK_ATTN_WALK_PREFETCH != 0) attn_walk_prefetch(row, kc, vc, D, b0, n, g, t, dims0);
      uint4 vw[4][kVecs];
      if constexpr (!kValuesAfterScores) load_values(vw, b0);
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int c = 0; c < ME; ++c) {
        const uint4 qb = ld_act_v4(qrow + c * kMmaWalkChunk);
        mma_bf16_16816(s, ka[c].x, kb[c].x, ka[c].y, kb[c].y, qb.x, qb.y);
        mma_bf16_16816(s, ka[c].z, kb[c].z, ka[c].w, kb[c].w, qb.z, qb.w);
      }
      if constexpr (MPK_ATTN_WALK_MARKS != 0)
        if (b0 == 0) trace_mark(kMarkWalkScores, mark_tid);  // tid 0 only: warp 0's key loads are back
      if constexpr (kValuesAfterScores) load_values(vw, b0);
      // s[0], s[1]: position b0 + g, heads 2t, 2t + 1; s[2], s[3]: position b0 + g + 8.
      const bool in_lo = b0 + g < n, in_hi = b0 + g + kMmaWalkHalf < n;
      const float x0 = in_lo ? s[0] * scale : -INFINITY, x1 = in_lo ? s[1] * scale : -INFINITY;
      const float x2 = in_hi ? s[2] * scale : -INFINITY, x3 = in_hi ? s[3] * scale : -INFINITY;
      float bm0 = fmaxf(x0, x2), bm1 = fmaxf(x1, x3);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {  // the 8 lanes of one t
        bm0 = fmaxf(bm0, __shfl_xor_sync(kFullWarp, bm0, o));
        bm1 = fmaxf(bm1, __shfl_xor_sync(kFullWarp, bm1, o));
      }
      const float mn0 = fmaxf(m0, bm0), mn1 = fmaxf(m1, bm1);  // finite: position b0 is in every block
      const float corr0 = expf(m0 - mn0), corr1 = expf(m1 - mn1);
      const float p0 = expf(x0 - mn0), p1 = expf(x1 - mn1), p2 = expf(x2 - mn0), p3 = expf(x3 - mn1);
      float ps0 = p0 + p2, ps1 = p1 + p3;
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {  // the 8 lanes of one t
        ps0 += __shfl_xor_sync(kFullWarp, ps0, o);
        ps1 += __shfl_xor_sync(kFullWarp, ps1, o);
      }
      l0 = l0 * corr0 + ps0;
      l1 = l1 * corr1 + ps1;
      m0 = mn0;
      m1 = mn1;
      // P^T (positions x heads) as the values' B operand: each 8 x 8 half transposed across the warp.
      const uint32_t pb0 = movmatrix_trans(pack_bf16x2(p0, p1));  // positions 0-7 of the block
      const uint32_t pb1 = movmatrix_trans(pack_bf16x2(p2, p3));  // positions 8-15
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        // Word i of each row: dims 2i (low half, A row g) and 2i + 1 (high half, A row g + 8).
        const uint32_t w0 = (&vw[0][i / 4].x)[i % 4], w1 = (&vw[1][i / 4].x)[i % 4];
        const uint32_t w8 = (&vw[2][i / 4].x)[i % 4], w9 = (&vw[3][i / 4].x)[i % 4];
        acc[i][0] *= corr0;
        acc[i][1] *= corr1;
        acc[i][2] *= corr0;
        acc[i][3] *= corr1;
        mma_bf16_16816(acc[i], __byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632), __byte_perm(w8, w9, 0x5410),
                       __byte_perm(w8, w9, 0x7632), pb0, pb1);
      }
      if constexpr (MPK_ATTN_WALK_MARKS != 0)
        if (b0 == 0) trace_mark(kMarkWalkBlock, mark_tid);  // tid 0 only: warp 0's first block is summed
    }
    // The merge entries: acc of heads 2t, 2t + 1 at this lane's dims; m and l from the lanes g == 0.
    auto store_acc = [&](float* out, int entry) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        const int d = dims0 + 2 * i;
        if (2 * t < G) {
          out[(size_t)(2 * t) * entry + d] = acc[i][0];
          out[(size_t)(2 * t) * entry + d + 1] = acc[i][2];
        }
        if (2 * t + 1 < G) {
          out[(size_t)(2 * t + 1) * entry + d] = acc[i][1];
          out[(size_t)(2 * t + 1) * entry + d + 1] = acc[i][3];
        }
      }
    };
    auto store_ml = [&](float* ml, int ml_stride) {
      if (g == 0) {
        if (2 * t < G) {
          ml[(size_t)(2 * t) * ml_stride] = m0;
          ml[(size_t)(2 * t) * ml_stride + 1] = l0;
        }
        if (2 * t + 1 < G) {
          ml[(size_t)(2 * t + 1) * ml_stride] = m1;
          ml[(size_t)(2 * t + 1) * ml_stride + 1] = l1;
        }
      }
    };
    finish(store_acc, store_ml);
    __syncwarp();
  }
}

// attn_mma_walk_then with the whole state stored at once into G entries of (acc[0..D), m, l), `entry` floats apart,
// at `out` (attn_warp_store's layout).
template <int MG, int ME>
__device__ __forceinline__ void attn_mma_walk(const bf16* q, const bf16* kc, const bf16* vc, int D, int G, int kv_ps,
                                              int first, int end, int stride, float scale, int lane, float* out,
                                              int entry, int mark_tid = -1) {
  attn_mma_walk_then<MG, ME>(q, kc, vc, D, G, kv_ps, first, end, stride, scale, lane, WalkStoreAt{out, entry, D},
                             mark_tid);
}

}  // namespace mpk
