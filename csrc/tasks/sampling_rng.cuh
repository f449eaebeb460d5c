// Counter-based random numbers for on-device sampling: the CUDA twin of
// mpk_dist/taskgraph/sampling_rng.py (same 64-bit words, bit for bit; tests compare them).
// A draw is a pure function of (seed, step, sequence b, vocabulary id i), so every vocabulary tile
// of every rank makes its own columns' noise with no state and no communication.
//   key  = mix(mix(mix(seed + G) + G (step + 1)) + G (b + 1)),  bits = mix(key + G (i + 1))
//   u    = (2 (bits >> 41) + 1) * 2^-24   (float32, exact, in (0, 1)),   g = -log(-log(u))
// __host__ __device__ so a host build can check the bits against numpy without a GPU.
#pragma once
#include <stdint.h>
#ifndef __CUDACC_RTC__
#include <math.h>  // logf for host builds (NVRTC has it built in)
#endif

namespace mpk {

constexpr uint64_t kRngGolden = 0x9E3779B97F4A7C15ull;  // splitmix64 increment
constexpr int kRngUBits = 23;                            // random bits per uniform
// Words of the per-launch sampling buffer (int32 [4]): float bits, float bits, seed low, seed high.
constexpr int kSamplingTemperature = 0, kSamplingTopP = 1, kSamplingSeedLo = 2, kSamplingSeedHi = 3;

__host__ __device__ __forceinline__ uint64_t rng_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__host__ __device__ __forceinline__ uint64_t rng_stream_key(uint64_t seed, int step, int b) {
  uint64_t k = rng_mix64(seed + kRngGolden);
  k = rng_mix64(k + kRngGolden * ((uint64_t)(int64_t)step + 1));
  return rng_mix64(k + kRngGolden * ((uint64_t)(int64_t)b + 1));
}

__host__ __device__ __forceinline__ uint64_t rng_bits(uint64_t key, int64_t id) {
  return rng_mix64(key + kRngGolden * ((uint64_t)id + 1));
}

// (2k + 1) * 2^-24 for the top 23 bits k: exact in float32, never 0 or 1.
__host__ __device__ __forceinline__ float rng_uniform(uint64_t bits) {
  const float k = (float)(uint32_t)(bits >> (64 - kRngUBits));
  return (k * 2.0f + 1.0f) * (1.0f / 16777216.0f);
}

__host__ __device__ __forceinline__ float rng_gumbel(float u) { return -logf(-logf(u)); }

// The Gumbel-max score of logit x at inverse temperature inv_t: x * inv_t + g, each operation
// rounded on its own (no fused multiply-add) as numpy does.
__device__ __forceinline__ float gumbel_score(float x, float inv_t, float g) {
  return __fadd_rn(__fmul_rn(x, inv_t), g);
}

// The launch's sampling state from its buffer (nullptr or temperature <= 0: greedy).
struct SamplingState {
  float inv_t;     // 1 / temperature; 0 = greedy
  float top_p;
  uint64_t seed;
};

// ---- top-p (nucleus): bins of z = (M - x) / T and fixed-point masses (sampling_rng.py, the same
// constants; a CPU test reads them from this header) --------------------------------------------------
constexpr int kNucleusBins = 2048;                // bins of the mass histogram
constexpr float kBinsPerUnit = 64.0f;             // bins per unit of z: a power of two (exact products)
constexpr float kZRange = 32.0f;                  // kNucleusBins / kBinsPerUnit
constexpr float kMassScale = 17592186044416.0f;   // 2^44: the top token's mass

__device__ __forceinline__ float nucleus_z(float m, float x, float inv_t) { return __fmul_rn(__fsub_rn(m, x), inv_t); }

// floor(z * 64) below kZRange, else kNucleusBins (also for NaN: the comparison is false).
__device__ __forceinline__ int nucleus_bin(float z) {
  return z < kZRange ? (int)floorf(z * kBinsPerUnit) : kNucleusBins;
}

// rint(exp(-z) * 2^44) below kZRange, else 0.
__device__ __forceinline__ unsigned long long nucleus_mass(float z) {
  return z < kZRange ? __float2ull_rn(__fmul_rn(expf(-z), kMassScale)) : 0ull;
}

// The largest value of gathered [world, B, 2] (value, index) candidates for sequence b: the step's
// max logit M over the whole vocabulary.
__device__ __forceinline__ float gathered_max(const float* maxes, int b, int B, int world) {
  float m = -INFINITY;
  for (int r = 0; r < world; ++r) {
    const float v = maxes[((size_t)r * B + b) * 2];
    m = v > m ? v : m;
  }
  return m;
}

__device__ __forceinline__ SamplingState load_sampling(const int32_t* words) {
  SamplingState s{0.0f, 1.0f, 0};
  if (words == nullptr) return s;
  const float t = __int_as_float(words[kSamplingTemperature]);
  if (t > 0.0f) s.inv_t = 1.0f / t;  // IEEE division, as numpy's float32 1 / T
  s.top_p = __int_as_float(words[kSamplingTopP]);
  s.seed = (uint64_t)(uint32_t)words[kSamplingSeedLo] | ((uint64_t)(uint32_t)words[kSamplingSeedHi] << 32);
  return s;
}

__device__ __forceinline__ bool nucleus_active(const SamplingState& s) { return s.inv_t > 0.0f && s.top_p < 1.0f; }

}  // namespace mpk
