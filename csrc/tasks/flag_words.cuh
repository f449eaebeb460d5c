// Flagged words (mpk_dist/taskgraph/flag_words.py; opt-in, MPK_FLAG_WORDS): an fp32 value and the tag of the step
// that wrote it in one 64-bit word, so a reader on another SM can poll the data itself instead of an event.
// The writers (linear_residual's epilogue, fused_gemv.cuh Epi) store a word with st_relaxed_gpu_u64 after the plain
// value; the readers load it with ld_relaxed_gpu_u64 (csrc/runtime/sync.cuh) and take it once its tag is the
// step's: a norm tile gathers its input rows this way (flag_gather, csrc/runtime/dispatch.cuh) instead of waiting on
// its producers' event, and a residual read takes the word's value (it is ordered after the gathering tiles, which
// saw the same words). Tag 0 is never a step's (the tag of step s is s + 1; the copies are zeroed with the cache).
#pragma once
#include <stdint.h>
#include <cuda_bf16.h>
#include "sync.cuh"  // st_relaxed_gpu_u64

#ifndef MPK_FLAG_WORDS
#define MPK_FLAG_WORDS 0
#endif
// Sleep between a thread's polling rounds of words not yet written (0: back to back). csrc/bench/ll_boundary.cu
// measures both ("flag" and "flag+sleep").
#ifndef MPK_FLAG_POLL_SLEEP_NS
#define MPK_FLAG_POLL_SLEEP_NS 0
#endif

namespace mpk {

constexpr int kFlagPollWords = 8;  // words a thread has in flight per polling round

__device__ __forceinline__ uint32_t flag_tag_of_step(int step) { return (uint32_t)step + 1u; }
__device__ __forceinline__ uint64_t flag_word(float v, uint32_t tag) {
  return (uint64_t)__float_as_uint(v) | ((uint64_t)tag << 32);
}
__device__ __forceinline__ float flag_value(uint64_t w) { return __uint_as_float((uint32_t)w); }
__device__ __forceinline__ uint32_t flag_tag(uint64_t w) { return (uint32_t)(w >> 32); }

// A bf16 vector's flagged copy holds a column pair a word (the even column in the low half). Called by the threads
// of consecutive lanes that own elements e and e + 1 (e even, every lane of a pair active): the even lane writes the
// word at words + e / 2 with its neighbour's value.
__device__ __forceinline__ void flag_store_pair(uint64_t* words, size_t e, __nv_bfloat16 v, uint32_t tag) {
  const uint32_t mine = (uint32_t)__bfloat16_as_ushort(v);
  const uint32_t other = __shfl_xor_sync(__activemask(), mine, 1);
  if ((e & 1) == 0) st_relaxed_gpu_u64(words + e / 2, (uint64_t)(mine | (other << 16)) | ((uint64_t)tag << 32));
}

}  // namespace mpk
