// Task records: one contiguous 384-byte row per task with everything a worker needs to run it -- its
// waits (event, step offset, triggers, scope), its signals, its argument pointers and dtypes, its
// parameters and its planned weight prefetch -- resolved on the host (mpk_dist/runtime/task_records.py)
// from the ABI tables.
//
// Why: read through the ABI tables, one task costs chains of dependent loads (task row -> wait row ->
// event row -> counter; row -> argument row -> buffer row for a dtype; row -> signal row -> event
// row before the fence), each an L2 round trip of ~0.5 us under the weight stream, since the L1 left
// beside the shared-memory carve-out does not hold them. The trace of 2026-11-30 showed ~1.5 us
// before a linear tile's wait and ~2.6 us after every body, on every task kind. A record is read in
// ONE round trip of independent 16-byte loads, and the aot worker copies the next task's record into
// shared memory (cp.async) while it waits for the current one, so on the critical path a task reads
// its descriptors at shared-memory latency.
//
// Rows are stored in the aot worker order (records[i] describes worker_tasks[i]); task_rec[t] is
// the row of task t (the jit schedule's lookup). Layout mirrored by task_records.py; the generated
// source static_asserts the constants against it.
#pragma once
#include <stdint.h>

namespace mpk {

constexpr int REC_WORDS = 96;  // int32 words per record (384 bytes: 24 lanes x 16 bytes)
constexpr int REC_TASK = 0;
constexpr int REC_OPCODE = 1;
constexpr int REC_FLAGS = 2;
constexpr int REC_PREFETCH = 3;  // planned L2 prefetch bytes (prefetch_plan.py), -1: the MPK_PREFETCH_KB cap
constexpr int REC_NWAITS = 4;
constexpr int REC_NSIGNALS = 5;
constexpr int REC_PREFETCH_NEXT = 6;  // aot: bytes of the NEXT record's weight block to prefetch during this wait (0: none)
constexpr int REC_WAITS = 8;  // REC_MAX_WAITS x (event, step offset, triggers, scope)
constexpr int REC_WAIT_COLS = 4;
constexpr int REC_MAX_WAITS = 4;
constexpr int REC_SIGNALS = 24;  // REC_MAX_SIGNALS x (event, kind, triggers)
constexpr int REC_SIGNAL_COLS = 3;
constexpr int REC_MAX_SIGNALS = 4;
constexpr int REC_ARGS = 36;  // REC_MAX_ARGS 64-bit addresses (two words each, low first)
constexpr int REC_MAX_ARGS = 12;
constexpr int REC_DTYPES = 60;  // REC_MAX_ARGS dtype codes (-1: absent optional argument)
constexpr int REC_PARAMS = 72;  // REC_MAX_PARAMS parameters in the kind's declared order
constexpr int REC_MAX_PARAMS = 16;

// REC_FLAGS bits. A task with more waits or signals than a record holds keeps reading the tables.
constexpr int REC_FLAG_SIG_SYS = 1;          // some signal goes to a peer or a system-scope event
constexpr int REC_FLAG_WAITS_INLINE = 2;     // the waits are in the record
constexpr int REC_FLAG_SIGNALS_INLINE = 4;   // the signals are in the record
constexpr int REC_FLAG_BULK_PREFETCH = 8;    // L2 prefetches by bulk copies (common.cuh prefetch_l2_bulk)
constexpr int REC_FLAG_STAGE_KV = 16;        // split-KV tile: its range's cache rows into shared memory first

// Signal kinds (column 1 of a signal entry).
constexpr int SIG_KIND_LOCAL = 0;      // this rank's counter, gpu scope
constexpr int SIG_KIND_SYSTEM = 1;     // this rank's counter, system scope (peers or the host acquire it)
constexpr int SIG_KIND_ALL_RANKS = 2;  // every rank's counter (SIG_ALL_RANKS)

constexpr int kRecordLanes = REC_WORDS / 4;  // 16-byte copies per record
constexpr int kRecordFirstThread = 32;       // warp 1 copies records: warp 0 holds thread 0, which waits

}  // namespace mpk
