// The scalar decode attention walk, 8 positions of a warp at a time (MPK_ATTN_BLOCK_WALK for attention_seq, only
// in builds with MPK_ATTN_MMA_WALK=0: the tensor-core walk of attention_mma_walk.cuh replaced it there;
// MPK_ATTN_SPLIT_BLOCK_WALK for attention_split_seq): used by attention, attention_prep, attention_split and
// attention_split_prep when their shapes allow it (attn_block_walk_ok), else attn_warp_step per position.
//
// Why: attn_warp_step spends one memory round trip and ~250 instructions per position and head group (each
// lane loads 2-byte elements, then G warp sums of 5 dependent shuffles, 2G expf, the rescale of every
// accumulator), one position after another. At batch 8 (unsplit, 32 positions a warp at context 512) that is
// ~0.9 us a position and ~30 us of a ~175 us layer (docs/PERF.md v0.13). Here a block of 8 positions costs:
//  * scores: 4 lanes per position (kWalkLanesPerPos), 8 positions a block; a lane loads ME 16-byte pieces of
//    its row and sums its 8 * ME elements against q, read from shared memory (lanes of one quarter read one
//    address: a broadcast); two shuffles finish each score;
//  * one online-softmax update per block and head (a max and a sum over the 8 slots: 3 shuffles each);
//  * values: lanes over d as in attn_warp_step (ME contiguous elements, one vector load per row; the block's
//    8 rows are loaded with its k rows), each position's weight taken from its slot by one shuffle per head.
// The sums are the same mathematics in another order (fp32 throughout), so results differ from attn_warp_step's
// in the last bits; they are compared with the torch reference, not bit for bit.
//
// Measured on an H200 (docs/PERF.md v0.26, `bench --prompt-len 480 --output-len 64 --max-seq-len 576`, one
// process each, alternating):
//  * MPK_ATTN_BLOCK_WALK (the unsplit attention of programs above 4 sequences, and --attn-splits 1), default 1:
//    qwen3-8b batch 8 6.327 / 6.339 ms vs 6.450 / 6.448 with attn_warp_step (-1.9%). Far less than the walk's
//    share above predicted: with it a batch-8 attention tile still runs 25-28 us (the v0.26 trace), so most of
//    that tile's time is not the per-position chain. v0.27's marks: the walk was ~19 us of it, bound by its
//    ~1,000 instructions per warp and block, not by memory (value rows loaded unpredicated and raw, all 12
//    loads of a block in flight together instead of in two waves: no change, 6.286 / 6.309 ms); the
//    tensor-core walk took its place (5.92 ms).
//  * MPK_ATTN_SPLIT_BLOCK_WALK (the split tiles of batch 1-4 programs, 2-3 positions a warp at context 512),
//    default 0: qwen3-0.6b 1.111 / 1.116 vs 1.091 / 1.093, qwen3-8b 4.891 vs 4.811 (+1.7-1.9%): one block
//    with 5-6 of its 8 slots empty costs more (and is more code to fetch cold) than 2-3 short steps.
//    Again with the raw value loads (v0.27): qwen3-0.6b 1.100 / 1.099 vs 1.097 / 1.093, qwen3-8b 4.834 / 4.829 vs
//    4.752 / 4.757.
#pragma once
#include "common.cuh"

#ifndef MPK_ATTN_BLOCK_WALK
#define MPK_ATTN_BLOCK_WALK 1
#endif
#ifndef MPK_ATTN_SPLIT_BLOCK_WALK
#define MPK_ATTN_SPLIT_BLOCK_WALK 0
#endif

namespace mpk {

constexpr int kWalkLanesPerPos = 4;                    // lanes that share one position's score
constexpr int kWalkSlots = 32 / kWalkLanesPerPos;      // positions a block (one softmax update)
constexpr int kWalkChunk = 8;                          // bf16 a 16-byte load

// Instances with more than kWalkMaxAcc accumulators a lane (MG * ME) or more than kWalkMaxMe elements keep
// attn_warp_step: the block walk's registers (the block's value rows and the k pieces besides acc) spilled
// there at 512 threads (ptxas -v: 84-5,700 B at (2, 8), (4, 8), (8, 4), (8, 8)); no preset model runs them
// (G <= 4, D = 128).
constexpr int kWalkMaxAcc = 16;
constexpr int kWalkMaxMe = 4;

template <int MG, int ME>
constexpr bool kAttnBlockWalkFits = MG * ME <= kWalkMaxAcc && ME <= kWalkMaxMe;

// Whether the block walk handles the shape: an instance that fits, exactly ME elements a lane (D == 32 * ME:
// 64 or 128), 16-byte aligned rows and this warp's merge entries (qs, where the walk keeps q) 16-byte aligned.
template <int MG, int ME>
__device__ __forceinline__ bool attn_block_walk_ok(const bf16* kc, const bf16* vc, int D, int kv_ps, const float* qs) {
  return kAttnBlockWalkFits<MG, ME> && D == 32 * ME && kv_ps % kWalkChunk == 0 &&
         ((reinterpret_cast<uintptr_t>(kc) | reinterpret_cast<uintptr_t>(vc) | reinterpret_cast<uintptr_t>(qs)) & 15) == 0;
}

// The two bf16 of a 32-bit word as floats (the lower address is the low half), exactly as bf2f. Not unpack8
// (common.cuh): its __bfloat1622float2 compiled to ~100 more instructions in attention_seq<4, 4> (a PRMT and an
// IMAD.U32 per pair instead of a shift or a mask; nvdisasm of the batch-8 kernel).
__device__ __forceinline__ void bf16x2_to_f(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// ME (2 or 4) contiguous bf16 of a row part, raw: one 4- or 8-byte load.
template <int ME>
using WalkRawPart = std::conditional_t<ME == 2, uint32_t, uint2>;

template <int ME>
__device__ __forceinline__ WalkRawPart<ME> load_walk_part(const bf16* p) {
  static_assert(ME == 2 || ME == 4, "block walk: 2 or 4 elements a lane (kWalkMaxMe)");
  return *reinterpret_cast<const WalkRawPart<ME>*>(p);
}

// A raw row part as ME floats, exactly as bf2f.
template <int ME>
__device__ __forceinline__ void walk_part_to_f(const WalkRawPart<ME>& w, float (&out)[ME]) {
  if constexpr (ME == 2) {
    bf16x2_to_f(w, out[0], out[1]);
  } else {
    bf16x2_to_f(w.x, out[0], out[1]);
    bf16x2_to_f(w.y, out[2], out[3]);
  }
}

// One warp's online softmax over positions first, first + stride, ... < end (G heads; acc / m / l as
// attn_warp_init left them, qv its q rows), kWalkSlots positions a block. qs: this warp's merge entries
// (G * (D + 2) floats, free until attn_warp_store), which hold q as fp32 [G][D] during the walk for its
// broadcast reads. The caller checked attn_block_walk_ok (false for an instance that does not fit, which
// compiles no walk). Ends with __syncwarp (qs may be overwritten after it). The block loop stays a loop: the
// body is fetched cold once a layer (a fully unrolled 32-position block, ~1,500 instructions, was 4.6-6.5%
// slower on every model measured; docs/PERF.md v0.26).
template <int MG, int ME>
__device__ __forceinline__ void attn_block_walk(const float (&qv)[MG][ME], float* qs, const bf16* kc, const bf16* vc,
                                                int D, int G, int kv_ps, int first, int end, int stride, float scale,
                                                int lane, float (&acc)[MG][ME], float (&m)[MG], float (&l)[MG]) {
  if constexpr (kAttnBlockWalkFits<MG, ME>) {
#pragma unroll
    for (int j = 0; j < MG; ++j)
      if (j < G) {
#pragma unroll
        for (int i = 0; i < ME; ++i) qs[(size_t)j * D + lane * ME + i] = qv[j][i];
      }
    __syncwarp();
    const int slot = lane / kWalkLanesPerPos, quarter = lane % kWalkLanesPerPos;
    const int n = end > first ? (end - first + stride - 1) / stride : 0;  // this warp's positions
#pragma unroll 1
    for (int b0 = 0; b0 < n; b0 += kWalkSlots) {
      // Scores: lane (slot, quarter) holds the score of position b0 + slot: its elements c * 32 + quarter * 8 + e
      // (c < ME, e < 8) summed in order, then the quarters' sums added.
      const int k = b0 + slot;
      const bool valid = k < n;
      const bf16* kr = kc + (size_t)(first + (valid ? k : 0) * stride) * kv_ps;
      uint4 raw[ME];
#pragma unroll
      for (int c = 0; c < ME; ++c) raw[c] = ld_act_v4(kr + (c * kWalkLanesPerPos + quarter) * kWalkChunk);
      // The block's value rows, loaded now so they fly during the scores: lane holds elements lane * ME .. + ME,
      // kept as raw bf16 until the value loop. Every slot loads a row (slots past the warp's last position
      // re-read that position's row; their weight is 0), so the loads carry no predicate: predicated loads
      // converted on arrival made ptxas give all eight one register pair, i.e. eight round trips a block.
      const int cnt = min(kWalkSlots, n - b0);
      WalkRawPart<ME> rv[kWalkSlots];
#pragma unroll
      for (int u = 0; u < kWalkSlots; ++u)
        rv[u] = load_walk_part<ME>(vc + (size_t)(first + (b0 + min(u, cnt - 1)) * stride) * kv_ps + lane * ME);
      float p[MG];
#pragma unroll
      for (int j = 0; j < MG; ++j) {
        float s = 0.f;
        if (j < G) {
#pragma unroll
          for (int c = 0; c < ME; ++c) {
            const float4* qa = reinterpret_cast<const float4*>(qs + (size_t)j * D + c * 32 + quarter * kWalkChunk);
            const float4 x = qa[0], y = qa[1];
            float k0, k1, k2, k3, k4, k5, k6, k7;
            bf16x2_to_f(raw[c].x, k0, k1);
            bf16x2_to_f(raw[c].y, k2, k3);
            bf16x2_to_f(raw[c].z, k4, k5);
            bf16x2_to_f(raw[c].w, k6, k7);
            s = fmaf(x.x, k0, s); s = fmaf(x.y, k1, s); s = fmaf(x.z, k2, s); s = fmaf(x.w, k3, s);
            s = fmaf(y.x, k4, s); s = fmaf(y.y, k5, s); s = fmaf(y.z, k6, s); s = fmaf(y.w, k7, s);
          }
        }
        s += __shfl_xor_sync(kFullWarp, s, 1);
        s += __shfl_xor_sync(kFullWarp, s, 2);
        p[j] = valid ? s * scale : -INFINITY;
      }
      // One softmax update for the block: the slots' max and sum (the lanes of a slot hold equal values).
#pragma unroll
      for (int j = 0; j < MG; ++j) {
        float bm = p[j];
#pragma unroll
        for (int o = kWalkLanesPerPos; o < 32; o <<= 1) bm = fmaxf(bm, __shfl_xor_sync(kFullWarp, bm, o));
        const float mn = fmaxf(m[j], bm);  // finite: position b0 (slot 0) is in every block
        const float corr = expf(m[j] - mn);
        p[j] = expf(p[j] - mn);  // -inf (no position): 0
        float ps = p[j];
#pragma unroll
        for (int o = kWalkLanesPerPos; o < 32; o <<= 1) ps += __shfl_xor_sync(kFullWarp, ps, o);
        l[j] = l[j] * corr + ps;
#pragma unroll
        for (int i = 0; i < ME; ++i) acc[j][i] *= corr;
        m[j] = mn;
      }
      // Values: each position's weight from its slot (one shuffle a head); rows past cnt are 0 with weight 0.
#pragma unroll
      for (int u = 0; u < kWalkSlots; ++u)
#pragma unroll
        for (int j = 0; j < MG; ++j)
          if (j < G) {
            const float w = __shfl_sync(kFullWarp, p[j], u * kWalkLanesPerPos);
            float vv[ME];
            walk_part_to_f<ME>(rv[u], vv);
#pragma unroll
            for (int i = 0; i < ME; ++i) acc[j][i] = fmaf(w, vv[i], acc[j][i]);
          }
    }
    __syncwarp();
  }
}

}  // namespace mpk
