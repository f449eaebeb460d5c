"""The ABI between the task-graph compiler and the mega-kernel, defined once, here.

The compiled program of one TP rank is a set of flat integer arrays that the GPU runtime copies
to the device as is (see docs/TASKGRAPH.md for the full contract):

* task table ``tasks`` int32 [T, len(TASK_COLS)]: one row per task (one tile of one op).
* event table ``events`` int32 [E, len(EVENT_COLS)]: one row per event (a counter).
* wait list ``waits`` int32 [NW, len(WAIT_COLS)]: (event, step offset) pairs; task i waits on rows
  [WAIT_BEGIN, WAIT_END) of it.
* signal list ``signals`` int32 [NS, len(SIGNAL_COLS)]: (event, target) pairs; task i increments
  rows [SIGNAL_BEGIN, SIGNAL_END) after its writes are visible.
* argument table ``args`` int32 [NA, len(ARG_COLS)]: (buffer, element offset, element count) per
  pointer argument, in the order the task kind declares (tasks/<kind>.py).
* parameter table ``params`` int32 [NP]: parameter values in the order the kind declares; float
  parameters hold the bits of a float32.
* buffer table ``buffers`` int64 [NB, len(BUFFER_COLS)]: dtype code, kind code, element count.
  Names and shapes travel in the JSON metadata.
* per-worker lists for ahead-of-time mode: ``worker_offsets`` int32 [W+1], ``worker_tasks`` int32:
  worker w runs worker_tasks[worker_offsets[w]:worker_offsets[w+1]] in that order, every step.

Events and steps: counters start at 0 at launch and are NEVER reset. For decode step s (0-based) a
wait entry (event e, offset o) is satisfied when counter[e] >= (s + 1 + o) * triggers[e]; a
threshold <= 0 is satisfied at once (o = -1 in step 0 waits for the host-initialised state). Each
signal entry adds 1 to the counter on its target rank(s) per step.
"""

from __future__ import annotations

ABI_VERSION = 2
"""Bumped whenever a column, code, opcode or argument order changes; the runtime checks it."""


def _columns(*names: str) -> dict[str, int]:
    return {n: i for i, n in enumerate(names)}


TASK_COLS = _columns(
    "OPCODE",        # task kind (tasks.KINDS[i].opcode)
    "OP_INDEX",      # index of the op in meta['ops'] (name, kind, layer) for error messages and traces
    "LAYER",         # decoder layer, -1 outside layers (embedding, head, step_begin)
    "TILE",          # tile index within the op (0..tiles-1)
    "WAIT_BEGIN",    # first row of the wait list
    "WAIT_END",      # one past the last row of the wait list
    "SIGNAL_BEGIN",  # first row of the signal list
    "SIGNAL_END",    # one past the last row
    "ARG_BEGIN",     # first row of the argument table (args in the kind's declared order)
    "ARG_END",       # one past the last row; ARG_END - ARG_BEGIN == len(kind.args)
    "PARAM_BEGIN",   # first entry of the parameter table
    "PARAM_END",     # one past the last; PARAM_END - PARAM_BEGIN == len(kind.params)
    "WORKER",        # worker (SM) of this task in ahead-of-time mode
)
"""Columns of the task table (int32)."""

EVENT_COLS = _columns(
    "TRIGGERS",  # signals this event receives on one rank per step (local + WORLD x remote signallers)
    "SCOPE",     # EV_SCOPE_LOCAL or EV_SCOPE_SYSTEM (signalled by peers: symmetric memory, system-scope acquire)
    "OP_INDEX",  # the op whose tasks signal it (for error messages)
)
"""Columns of the event table (int32)."""

WAIT_COLS = _columns(
    "EVENT",        # event id (row of the event table)
    "STEP_OFFSET",  # 0: this step, -1: the previous step (threshold (s + 1 + offset) * triggers)
)
"""Columns of the wait list (int32)."""

SIGNAL_COLS = _columns(
    "EVENT",   # event id
    "TARGET",  # SIG_SELF or SIG_ALL_RANKS
)
"""Columns of the signal list (int32)."""

ARG_COLS = _columns(
    "BUFFER",  # buffer id (row of the buffer table) or NULL_BUFFER
    "OFFSET",  # element offset of the tile's base inside the buffer
    "COUNT",   # elements from the base to one past the last element the task may touch
)
"""Columns of the argument table (int32)."""

BUFFER_COLS = _columns(
    "DTYPE",  # DTYPES code
    "KIND",   # BUFFER_KINDS code
    "NUMEL",  # element count
)
"""Columns of the buffer table (int64)."""

DTYPES = {"bf16": 0, "f16": 1, "f32": 2, "i32": 3}
"""Element type codes."""

DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4}

BUFFER_KINDS = {
    "weight": 0,      # loaded once from the checkpoint (per-rank slice), read-only in the kernel
    "activation": 1,  # written and read within a step, reused every step
    "state": 2,       # persists across steps and launches (KV cache)
    "input": 3,       # written by the host before a launch (forced tokens, start positions)
    "output": 4,      # read by the host (logits, next token, token output)
    "comm": 5,        # symmetric: allocated on every rank at the same size, peers write it
    "const": 6,       # compile-time constant data shipped with the program (rope inverse frequencies)
    "ticket": 7,      # per-launch group counters (zeroed before every launch): tiles add to them atomically,
                      # the last of a group takes the follow-up work and resets its word (TaskKind.ticket)
}
"""Buffer kind codes."""

EV_SCOPE_LOCAL = 0
"""Only this rank's tasks signal the event."""
EV_SCOPE_SYSTEM = 1
"""Peers signal the event: its counter must be in peer-visible memory, waits acquire at system scope."""

SIG_SELF = -1
"""Signal target: this rank's counter."""
SIG_ALL_RANKS = -2
"""Signal target: the counter of every rank of the TP group, this one included (release, system scope)."""

NULL_BUFFER = -1
"""Buffer id of an absent optional argument (the kernel sees a null pointer)."""

ARRAY_NAMES = ("tasks", "events", "waits", "signals", "args", "params", "buffers", "worker_offsets", "worker_tasks")
"""The arrays of a compiled program, as saved to <name>.npy."""


def _c_ident(name: str) -> str:
    return name.upper().replace("-", "_")


def _header_tables() -> list[str]:
    out = [f"constexpr int MPK_ABI_VERSION = {ABI_VERSION};", ""]
    for prefix, cols in (("TASK", TASK_COLS), ("EVENT", EVENT_COLS), ("WAIT", WAIT_COLS),
                         ("SIGNAL", SIGNAL_COLS), ("ARG", ARG_COLS), ("BUFFER", BUFFER_COLS)):
        for name, idx in cols.items():
            out.append(f"constexpr int {prefix}_COL_{name} = {idx};")
        out.append(f"constexpr int {prefix}_NUM_COLS = {len(cols)};")
        out.append("")
    for name, code in DTYPES.items():
        out.append(f"constexpr int DTYPE_{_c_ident(name)} = {code};")
    for name, code in BUFFER_KINDS.items():
        out.append(f"constexpr int BUFFER_KIND_{_c_ident(name)} = {code};")
    out += [f"constexpr int EV_SCOPE_LOCAL = {EV_SCOPE_LOCAL};", f"constexpr int EV_SCOPE_SYSTEM = {EV_SCOPE_SYSTEM};",
            f"constexpr int SIG_SELF = {SIG_SELF};", f"constexpr int SIG_ALL_RANKS = {SIG_ALL_RANKS};",
            f"constexpr int NULL_BUFFER = {NULL_BUFFER};", ""]
    return out


def _header_kinds() -> list[str]:
    from mpk_dist.taskgraph.tasks import KINDS

    out = ["enum Opcode : int {"]
    out += [f"  OP_{_c_ident(k.name)} = {k.opcode},  // {k.doc}" for k in KINDS]
    out += ["};", f"constexpr int NUM_OPCODES = {len(KINDS)};", ""]
    for k in KINDS:
        p = _c_ident(k.name)
        out.append(f"// {k.name}: {k.doc}")
        for i, a in enumerate(k.args):
            flags = ", ".join(f for f, on in (("written on every rank", a.remote), ("optional", a.optional)) if on)
            out.append(f"constexpr int {p}_ARG_{a.name} = {i};  // [{a.mode}] {a.doc}" + (f" ({flags})" if flags else ""))
        out.append(f"constexpr int {p}_NUM_ARGS = {len(k.args)};")
        for i, prm in enumerate(k.params):
            out.append(f"constexpr int {p}_PARAM_{prm.name} = {i};  // {'float bits: ' if prm.is_float else ''}{prm.doc}")
        out.append(f"constexpr int {p}_NUM_PARAMS = {len(k.params)};")
        out.append("")
    return out


def render_cuda_abi_header() -> str:
    """The C++ header (csrc/runtime/abi_generated.h) with every ABI constant; deterministic text.

    Opcode enum, table column indices, dtype/kind/scope/target codes and, per task kind, the index
    of each named argument and parameter (e.g. ``LINEAR_ARG_W``), so CUDA never hand-copies them.
    """
    lines = [
        "// GENERATED by mpk_dist.taskgraph.abi.render_cuda_abi_header(); do not edit.",
        f"// ABI version {ABI_VERSION}. See docs/TASKGRAPH.md for the meaning of every field.",
        "#pragma once",
        "",
        "namespace mpk {",
        "",
        *_header_tables(),
        *_header_kinds(),
        "}  // namespace mpk",
        "",
    ]
    return "\n".join(lines)
