// embedding (opcode from mpk_dist/taskgraph/tasks/embedding.py): columns [c0, c0 + COLS) of
// out[b] = table[tokens[b] - VOCAB_START] when the id lies in this rank's slice, else zeros.
// `table` and `out` already point at column c0. 16-byte copies when everything is 8-aligned.
#pragma once
#include "common.cuh"

namespace mpk {

__device__ void embedding(const int32_t* tokens, const bf16* table, bf16* out, int B, int cols, int table_stride,
                          int out_stride, int vocab_start, int vocab_rows, int tid, int nt) {
  const bool vec = ((cols | table_stride | out_stride) & 7) == 0 &&
                   ((reinterpret_cast<uintptr_t>(table) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  const int w = vec ? 8 : 1, per_row = cols / w;
  for (int i = tid; i < B * per_row; i += nt) {
    const int b = i / per_row, c = (i % per_row) * w;
    const int local = tokens[b] - vocab_start;
    const bool in = local >= 0 && local < vocab_rows;
    bf16* dst = out + (size_t)b * out_stride + c;
    const bf16* src = table + (size_t)(in ? local : 0) * table_stride + c;
    if (vec) *reinterpret_cast<uint4*>(dst) = in ? ld_stream_v4(src) : make_uint4(0, 0, 0, 0);
    else *dst = in ? *src : f2bf(0.f);
  }
}

}  // namespace mpk
