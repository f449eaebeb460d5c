"""Host mirrors of the kernel's structs (csrc/runtime/params.cuh, watchdog.cuh) as ctypes layouts.

``RuntimeParams`` is filled here and copied to the device as raw bytes; the generated source
``static_assert``s every field offset and the size against these layouts (``layout_asserts``), so a
mismatch between the two sides fails the build instead of corrupting a run.
"""

from __future__ import annotations

import ctypes

import numpy as np

from mpk_dist.taskgraph.tasks.page_alloc import FAULT_NAMES

_P = ctypes.c_uint64  # every device pointer travels as a 64-bit address
_I = ctypes.c_int32

# (name, ctype) in the order of struct RuntimeParams.
PARAM_FIELDS = [
    ("tasks", _P), ("event_tab", _P), ("waits", _P), ("signals", _P), ("args", _P), ("params", _P),
    ("buffers", _P), ("worker_offsets", _P), ("worker_tasks", _P),
    ("buf_base", _P), ("peer_base", _P), ("peer_events", _P), ("peer_quota", _P), ("events", _P),
    ("dep_ptr", _P), ("dep_task", _P), ("dep_offset", _P), ("launched", _P), ("queues", _P), ("queue_tail", _P),
    ("sched_queues", _P), ("sched_tail", _P),
    ("next_token", _P), ("token_out", _P), ("logits", _P), ("stop_ids", _P), ("done", _P), ("logits_dump", _P),
    ("step_end_ns", _P), ("progress", _P), ("halt", _P), ("error", _P), ("trace", _P), ("trace_len", _P),
    ("pass_doorbell", _P), ("pass_stage", _P), ("pass_copies", _P),
    ("records", _P), ("task_rec", _P),
    ("timeout_ns", ctypes.c_uint64), ("pass_wait_ns", ctypes.c_uint64),
    ("num_tasks", _I), ("num_events", _I), ("num_workers", _I), ("num_buffers", _I),
    ("world", _I), ("rank", _I), ("final_task", _I), ("batch", _I), ("vocab", _I), ("prompt_len", _I),
    ("max_new_tokens", _I), ("num_stop", _I), ("stop_on_done", _I), ("step_begin", _I), ("step_end", _I),
    ("queue_cap", _I), ("sched_cap", _I), ("num_sched", _I), ("trace_cap", _I), ("inject_hang_task", _I),
    ("abi_version", _I), ("trace_from", _I), ("num_pass_copies", _I),
]


class RuntimeParams(ctypes.Structure):
    """struct mpk::RuntimeParams."""

    _fields_ = PARAM_FIELDS


ERROR_FIELDS = [
    ("code", ctypes.c_uint32), ("valid", ctypes.c_uint32), ("task_id", _I), ("event_id", _I), ("step", _I),
    ("sm_id", _I), ("worker", _I), ("rank", _I), ("seen", ctypes.c_uint32), ("expected", ctypes.c_uint32),
    ("elapsed_ns", ctypes.c_uint64), ("peer", _I), ("peer_sent", ctypes.c_uint32),
    ("peer_expected", ctypes.c_uint32), ("pad0", ctypes.c_uint32),
]


class ErrorRecord(ctypes.Structure):
    """struct mpk::ErrorRecord (watchdog.cuh)."""

    _fields_ = ERROR_FIELDS


ERROR_CODES = {0: "none", 1: "timeout", 2: "queue overflow", 3: "bad task", 4: "injected",
               5: "no pass posted", **FAULT_NAMES, 9: "flagged word wait", 10: "worker pairing"}
"""Watchdog error codes (csrc/runtime/watchdog.cuh ErrorCode) by name; 6..8 are page_alloc's faults, 9 a flagged
word that stayed behind (csrc/runtime/dispatch.cuh flag_gather), 10 a block of a two-blocks-per-SM launch whose SM's
other block never published its worker (csrc/runtime/worker_index.cuh)."""

PASS_COPY_COLS = 4
"""Columns of RuntimeParams.pass_copies (csrc/runtime/pass_begin.cuh): stage word offset, buffer index,
words, destination words added per step."""
DOORBELL_POSTED, DOORBELL_STOP = 0, 1
"""Words of RuntimeParams.pass_doorbell."""

TRACE_MARKS = 6
"""csrc/runtime/params.cuh kTraceMarks: phase marks a task body may set (csrc/runtime/trace_marks.cuh)."""
TRACE_DTYPE = np.dtype([("task_id", "<u4"), ("step", "<u4"), ("start_ns", "<u8"), ("wait_ns", "<u4"), ("run_ns", "<u4"),
                        ("prep_ns", "<u4"), ("post_ns", "<u4"), ("mark_ns", "<u4", (TRACE_MARKS,))])
"""struct mpk::TraceRecord."""


def layout_asserts() -> str:
    """C++ static_asserts tying the device structs to these layouts (emitted into the .cu)."""
    lines = []
    for cls, cname in ((RuntimeParams, "mpk::RuntimeParams"), (ErrorRecord, "mpk::ErrorRecord")):
        for name, _ in cls._fields_:
            off = getattr(cls, name).offset
            lines.append(f'static_assert(offsetof({cname}, {name}) == {off}, "{cname}::{name}: host layout differs");')
        lines.append(f'static_assert(sizeof({cname}) == {ctypes.sizeof(cls)}, "{cname}: host size differs");')
    lines.append(f'static_assert(sizeof(mpk::TraceRecord) == {TRACE_DTYPE.itemsize}, "TraceRecord size");')
    from mpk_dist.runtime.task_records import layout_asserts as record_asserts

    lines += record_asserts()
    return "\n".join(lines)


def to_bytes(params: RuntimeParams) -> bytes:
    """Raw bytes of a filled struct (copied to the device)."""
    return ctypes.string_at(ctypes.addressof(params), ctypes.sizeof(params))
