// qkv_prep_paged (mpk_dist/taskgraph/tasks/qkv_prep_paged.py): qkv_prep over a ragged batch of N
// tokens whose KV cache is a page pool (docs/SERVING.md, "Page-table ABI for the kernel").
//  q tile : dst[b*Q_STRIDE + d] = rope(norm(qkv[b, head])) for every token b (padding included)
//  kv tile: pool[page(slot[b], pos[b]) * PAGE_STRIDE + (pos[b] % P) * POS_STRIDE + d] = rope(norm(k)),
//           v pool likewise = v; tokens with slot -1 (padding) write nothing.
// The per-token math is qkv_prep's (same rounding, same code): one warp per token calls it for a
// batch of one with its row's destination. This header also holds the page addressing that
// paged_attention.cuh reads through (tasks/paged.py on the CPU side).
#pragma once
#include "common.cuh"
#include "qkv_prep.cuh"

namespace mpk {

// Page-table view of one paged task: PAGE_TABLE [MB, MP] with `table_len` = MB * MP (the
// argument's COUNT), and the page-addressing parameters (tasks/paged.py PAGE_PARAMS).
struct PagedKv {
  const int32_t* table;
  int table_len, page_size, page_stride, pos_stride, max_pages, num_pages;

  // Page id holding positions j*P .. j*P+P-1 of the sequence in `slot`, or -1 when the slot, the
  // column or the page id is out of range (the host checked; this keeps a bad table from
  // becoming an out-of-bounds write).
  __device__ __forceinline__ int page(int slot, int j) const {
    if (slot < 0 || j < 0 || j >= max_pages) return -1;
    const long long i = (long long)slot * max_pages + j;
    if (i >= table_len) return -1;
    const int pg = table[i];
    return (pg >= 0 && pg < num_pages) ? pg : -1;
  }

  // Element offset (from a pool argument's base, i.e. this task's kv head) of position p in page pg.
  __device__ __forceinline__ size_t row(int pg, int p) const {
    return (size_t)pg * page_stride + (size_t)(p % page_size) * pos_stride;
  }
};

// True on every worker thread when each non-padding token b has a valid page for the positions it
// touches: pos[b] only (`prefix` false: a kv write) or 0..pos[b] (`prefix` true: attention reads).
// Block-uniform on purpose: the caller returns false on every thread together (the worker then
// records kErrBadTask for the task, see worker.cuh) instead of diverging at a later barrier.
__device__ bool paged_tokens_ok(const PagedKv& kv, const int32_t* pos, const int32_t* slots, int B, bool prefix,
                                int tid, int nt) {
  __shared__ int bad;
  if (tid == 0) bad = 0;
  worker_barrier(nt);  // the reset is seen before any thread reports
  for (int b = 0; b < B; ++b) {
    const int s = slots[b], p = pos[b];
    if (s < 0) continue;
    if (p < 0) {
      bad = 1;  // every reporter stores the same value: a benign race, read after the barrier
      continue;
    }
    const int last = p / kv.page_size;
    for (int j = (prefix ? 0 : last) + tid; j <= last; j += nt)
      if (kv.page(s, j) < 0) bad = 1;
  }
  worker_barrier(nt);  // every report is in before anyone reads the verdict
  // NOTE: no barrier after the read: the next write of `bad` is the next task's reset, which comes
  // after run_and_signal's post-task barrier.
  return bad == 0;
}

// Returns false (on every thread) when a kv tile meets a bad page-table entry.
__device__ bool qkv_prep_paged(const bf16* qkv, const int32_t* pos, const int32_t* slots, const PagedKv& kv,
                               const bf16* norm_w, const float* inv_freq, bf16* dst, bf16* dst_v, int B, int D,
                               int qkv_stride, int v_offset, int q_stride, int is_kv, float eps, int tid, int nt) {
  if (is_kv && !paged_tokens_ok(kv, pos, slots, B, false, tid, nt)) return false;
  const int warp = tid >> 5, lane = tid & 31, nwarps = nt >> 5;
  for (int b = warp; b < B; b += nwarps) {
    const bf16* src = qkv + (size_t)b * qkv_stride;
    // qkv_prep for one token on this warp alone (tid = lane, nt = 32): destination row given, so
    // its batch and position strides are 0.
    if (!is_kv) {
      qkv_prep(src, pos + b, norm_w, inv_freq, dst + (size_t)b * q_stride, nullptr, 1, D, qkv_stride, 0, 0, 0, 0, eps,
               lane, 32);
      continue;
    }
    const int s = slots[b];
    if (s < 0) continue;  // padding: writes nothing
    const size_t o = kv.row(kv.page(s, pos[b] / kv.page_size), pos[b]);
    qkv_prep(src, pos + b, norm_w, inv_freq, dst + o, dst_v + o, 1, D, qkv_stride, v_offset, 0, 0, 1, eps, lane, 32);
  }
  return true;
}

}  // namespace mpk
