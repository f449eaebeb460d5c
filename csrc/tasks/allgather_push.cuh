// allgather_push: copy COUNT fp32 elements of my candidate into slot[my_rank] of EVERY rank's
// symmetric gather buffer (peer pointers). The system-scope release that publishes these remote
// stores is the task's ALL_RANKS signal (worker.cuh), after a system-scope fence.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ void allgather_push(const float* src, float* const* dst_per_rank, int world, int count, int tid, int nt) {
  for (int i = tid; i < world * count; i += nt) dst_per_rank[i / count][i % count] = src[i % count];
}

}  // namespace mpk
