// TaskView: typed access to one task's record (task_record.cuh: arguments, parameters, dtypes), and
// through it to the task's rows of the ABI tables.
// Column and argument indices come from the generated ABI header (abi_generated.h), never copied.
#pragma once
#include <stdint.h>
#include "abi_generated.h"
#include "params.cuh"

namespace mpk {

struct TaskView {
  const RuntimeParams& p;
  const int32_t* rec;  // the task's record (task_record.cuh): shared memory (aot) or global (jit)

  __device__ TaskView(const RuntimeParams& params, const int32_t* record) : p(params), rec(record) {}

  __device__ int task() const { return rec[REC_TASK]; }
  __device__ int opcode() const { return rec[REC_OPCODE]; }
  __device__ bool flag(int f) const { return (rec[REC_FLAGS] & f) != 0; }  // a REC_FLAG_* bit
  // The ABI rows, for the rare readers of an argument's buffer id or count (remote arguments, page table).
  __device__ const int32_t* row() const { return p.tasks + (size_t)task() * TASK_NUM_COLS; }
  __device__ const int32_t* arg_row(int i) const { return p.args + (size_t)(row()[TASK_COL_ARG_BEGIN] + i) * ARG_NUM_COLS; }
  __device__ int buffer(int i) const { return arg_row(i)[ARG_COL_BUFFER]; }

  // Element type code (DTYPE_*) of argument i's buffer, or -1 for an absent optional argument.
  __device__ int dtype(int i) const { return rec[REC_DTYPES + i]; }

  // Pointer to argument i on this rank (buffer base + OFFSET elements, resolved on the host);
  // nullptr when absent.
  template <typename T>
  __device__ T* arg(int i) const {
    return reinterpret_cast<T*>(*reinterpret_cast<const uint64_t*>(rec + REC_ARGS + 2 * i));
  }

  // Pointer to argument i in rank r's copy of a symmetric buffer (remote arguments).
  template <typename T>
  __device__ T* peer_arg(int i, int r) const {
    const int32_t* a = arg_row(i);
    return reinterpret_cast<T*>(p.peer_base[(size_t)r * p.num_buffers + a[ARG_COL_BUFFER]]) + a[ARG_COL_OFFSET];
  }

  __device__ int param(int i) const { return rec[REC_PARAMS + i]; }
  __device__ float fparam(int i) const { return __int_as_float(param(i)); }
};

}  // namespace mpk
