// argmax_nucleus_cut: the step's top-p cut per sequence (one task per rank).
// Sums the world gathered histograms (`hist_all`: int32 words [world, B, 2 * kNucleusBins], one
// uint64 per bin) bin by bin, finds the last bin k whose mass above it, C_k, is < top_p * total
// (compared in double, as numpy), writes cut[b] = (M, k), then zeroes this rank's histogram `hist`
// for the next step. Greedy or top_p = 1: cut = (M, last bin). Each thread owns a contiguous chunk of
// bins; C_k comes from a block-wide exclusive scan of the chunk sums (smem: nt / 32 uint64).
#pragma once
#include "common.cuh"
#include "sampling_rng.cuh"

namespace mpk {

// Exclusive prefix of v over the block's threads in tid order, and the block total.
__device__ void block_scan_u64(unsigned long long v, unsigned long long& before, unsigned long long& total,
                               unsigned long long* sm, int tid, int nt) {
  const int lane = tid & 31, warp = tid >> 5;
  unsigned long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) sm[warp] = inc;
  worker_barrier(nt);
  unsigned long long base = 0, tot = 0;
  for (int w = 0; w < (nt >> 5); ++w) {
    const unsigned long long s = sm[w];
    if (w < warp) base += s;
    tot += s;
  }
  worker_barrier(nt);  // sm is reused right after
  before = base + inc - v;
  total = tot;
}

__device__ int block_min_int(int v, int* sm, int tid, int nt) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((tid & 31) == 0) sm[tid >> 5] = v;
  worker_barrier(nt);
  int r = sm[0];
  for (int w = 1; w < (nt >> 5); ++w) r = min(r, sm[w]);
  worker_barrier(nt);
  return r;
}

// Mass of bin k of sequence b summed over the ranks.
__device__ __forceinline__ unsigned long long bin_mass(const unsigned long long* all, int b, int k, int B, int world) {
  unsigned long long s = 0;
  for (int r = 0; r < world; ++r) s += all[((size_t)r * B + b) * kNucleusBins + k];
  return s;
}

// The last bin k with C_k < top_p * total (C_0 = 0 always qualifies: the top token is always kept).
__device__ int nucleus_last_bin(const unsigned long long* all, int b, int B, int world, float top_p, float* smem,
                                int tid, int nt) {
  const int per = (kNucleusBins + nt - 1) / nt;
  const int k0 = min(tid * per, kNucleusBins), k1 = min(k0 + per, kNucleusBins);
  unsigned long long mine = 0, before, total;
  for (int k = k0; k < k1; ++k) mine += bin_mass(all, b, k, B, world);
  block_scan_u64(mine, before, total, reinterpret_cast<unsigned long long*>(smem), tid, nt);
  const double target = (double)top_p * (double)total;
  int first_out = kNucleusBins;  // first k with C_k >= target
  for (int k = k0; k < k1; ++k) {
    if ((double)before >= target) { first_out = k; break; }
    before += bin_mass(all, b, k, B, world);
  }
  return block_min_int(first_out, reinterpret_cast<int*>(smem), tid, nt) - 1;
}

__device__ void argmax_nucleus_cut(const int32_t* hist_all, const float* maxes, const int32_t* sampling, float* cut,
                                   int32_t* hist, int B, int world, float* smem, int tid, int nt) {
  const SamplingState st = load_sampling(sampling);
  const unsigned long long* all = reinterpret_cast<const unsigned long long*>(hist_all);
  for (int b = 0; b < B; ++b) {
    const int last = nucleus_active(st) ? nucleus_last_bin(all, b, B, world, st.top_p, smem, tid, nt)
                                        : kNucleusBins - 1;
    if (tid == 0) {
      cut[2 * b] = gathered_max(maxes, b, B, world);
      cut[2 * b + 1] = (float)last;
    }
  }
  for (int i = tid; i < B * 2 * kNucleusBins; i += nt) hist[i] = 0;  // the next step's adds start from 0
}

}  // namespace mpk
