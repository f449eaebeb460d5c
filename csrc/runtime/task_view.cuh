// TaskView: typed access to one task's row of the ABI tables (arguments, parameters, dtypes).
// Column and argument indices come from the generated ABI header (abi_generated.h), never copied.
#pragma once
#include <stdint.h>
#include "abi_generated.h"
#include "params.cuh"

namespace mpk {

struct TaskView {
  const RuntimeParams& p;
  const int32_t* row;  // tasks[task]

  __device__ TaskView(const RuntimeParams& params, int task)
      : p(params), row(params.tasks + (size_t)task * TASK_NUM_COLS) {}

  __device__ int opcode() const { return row[TASK_COL_OPCODE]; }
  __device__ const int32_t* arg_row(int i) const { return p.args + (size_t)(row[TASK_COL_ARG_BEGIN] + i) * ARG_NUM_COLS; }
  __device__ int buffer(int i) const { return arg_row(i)[ARG_COL_BUFFER]; }

  // Element type code (DTYPE_*) of argument i's buffer, or -1 for an absent optional argument.
  __device__ int dtype(int i) const {
    const int b = buffer(i);
    return b < 0 ? -1 : (int)p.buffers[(size_t)b * BUFFER_NUM_COLS + BUFFER_COL_DTYPE];
  }

  // Pointer to argument i on this rank (buffer base + OFFSET elements, resolved on the host so a
  // task's pointers are one load each, off the critical path of buffer/dtype lookups); nullptr
  // when absent.
  template <typename T>
  __device__ T* arg(int i) const {
    return reinterpret_cast<T*>(p.arg_addr[row[TASK_COL_ARG_BEGIN] + i]);
  }

  // Pointer to argument i in rank r's copy of a symmetric buffer (remote arguments).
  template <typename T>
  __device__ T* peer_arg(int i, int r) const {
    const int32_t* a = arg_row(i);
    return reinterpret_cast<T*>(p.peer_base[(size_t)r * p.num_buffers + a[ARG_COL_BUFFER]]) + a[ARG_COL_OFFSET];
  }

  __device__ int param(int i) const { return p.params[row[TASK_COL_PARAM_BEGIN] + i]; }
  __device__ float fparam(int i) const { return __int_as_float(param(i)); }
};

}  // namespace mpk
