// argmax_nucleus_hist: one vocabulary tile's top-p mass histogram (nucleus programs only).
// hist[b, bin(z)] += mass(z) for z = (M - x) / T over the tile's logits x of sequence b, M the step's
// max logit over every rank (`maxes`: gathered greedy candidates [world, B, 2]). `hist` holds one
// uint64 per bin (int32 words [B, 2 * kNucleusBins]); the adds are relaxed device-scope atomics:
// integer sums are exact, so the result does not depend on the order of threads or tiles, and the
// task's release signal (worker.cuh) publishes them to the gather push like plain stores.
// Nothing to do unless the launch samples with top_p < 1.
#pragma once
#include "common.cuh"
#include "sampling_rng.cuh"

namespace mpk {

__device__ void argmax_nucleus_hist(const float* logits, const float* maxes, const int32_t* sampling,
                                    int32_t* hist_words, int B, int cols, int logits_stride, int world, int tid,
                                    int nt) {
  const SamplingState st = load_sampling(sampling);
  if (!nucleus_active(st)) return;
  unsigned long long* hist = reinterpret_cast<unsigned long long*>(hist_words);
  for (int b = 0; b < B; ++b) {
    const float m = gathered_max(maxes, b, B, world);
    const float* row = logits + (size_t)b * logits_stride;
    unsigned long long* h = hist + (size_t)b * kNucleusBins;
    for (int c = tid; c < cols; c += nt) {
      const float z = nucleus_z(m, row[c], st.inv_t);
      const unsigned long long q = nucleus_mass(z);
      if (q != 0ull) atomicAdd(h + nucleus_bin(z), q);  // most of a large vocabulary adds nothing
    }
  }
}

}  // namespace mpk
