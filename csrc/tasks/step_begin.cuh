// step_begin: the first task of a decode step. tokens[b] = forced[step, b] when >= 0 (prompt or
// teacher forcing, host-written), else next_token[b] from the previous step's argmax_select;
// positions[b] = start_pos[b] + step.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ void step_begin(const int32_t* forced, const int32_t* start_pos, const int32_t* next_token, int32_t* tokens,
                           int32_t* positions, int B, int step, int tid, int nt) {
  for (int b = tid; b < B; b += nt) {
    const int32_t f = forced[(size_t)step * B + b];
    tokens[b] = f >= 0 ? f : next_token[b];
    positions[b] = start_pos[b] + step;
  }
}

}  // namespace mpk
