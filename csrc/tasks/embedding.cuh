// embedding (opcode from mpk_dist/taskgraph/tasks/embedding.py): columns [c0, c0 + COLS) of
// out[b] = table[tokens[b] - VOCAB_START] when the id lies in this rank's slice, else zeros.
// `table` and `out` already point at column c0. 16-byte copies when everything is 8-aligned.
#pragma once
#include "common.cuh"

namespace mpk {

template <typename OutT>
__device__ void embedding(const int32_t* tokens, const bf16* table, OutT* out, int B, int cols, int table_stride,
                          int out_stride, int vocab_start, int vocab_rows, int tid, int nt) {
  // 16-byte copies only when the output is bf16 like the table; an fp32 output (the residual
  // stream) widens element by element.
  const bool vec = sizeof(OutT) == sizeof(bf16) && ((cols | table_stride | out_stride) & 7) == 0 &&
                   ((reinterpret_cast<uintptr_t>(table) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  const int w = vec ? 8 : 1, per_row = cols / w;
  for (int i = tid; i < B * per_row; i += nt) {
    const int b = i / per_row, c = (i % per_row) * w;
    const int local = tokens[b] - vocab_start;
    const bool in = local >= 0 && local < vocab_rows;
    OutT* dst = out + (size_t)b * out_stride + c;
    const bf16* src = table + (size_t)(in ? local : 0) * table_stride + c;
    if (vec) *reinterpret_cast<uint4*>(dst) = in ? ld_stream_v4(src) : make_uint4(0, 0, 0, 0);
    else store_out(dst, in ? bf2f(*src) : 0.f);
  }
}

}  // namespace mpk
