"""Flagged words: the fp32 residual stream handed from one level to the next without an event wait.

A linear level's last tile ends with a block barrier, ``fence.acq_rel.gpu`` and a signal; the next level's
tiles see the signal (csrc/bench/event_wake.cu: the last of 131 waiters 1.5-2.3 us after it under load), pass a
block barrier and then load the vector itself: latency only, about five times a layer (docs/PERF.md v0.33,
"Level boundaries"). With this pass (opt-in: ``compile_rank_programs(flag_words=True)``, ``MPK_FLAG_WORDS=1``)
the tiles that write the fp32 residual stream (``linear_residual``: o_proj and down at tp 1) also write a
flagged copy of each element, one 64-bit word (value bits, step tag) stored with one relaxed store, and the
readers of that stream poll the words themselves until every tag is the step's: the norm prologues of the next
level (``norm_linear``, ``norm_linear_silu``: qkv, gate|up, the final norm of the lm_head) gather them into
shared memory instead of waiting on the producers' event, and the residual reads of the next ``linear_residual``
read the flagged word instead of the plain one (the plain store is not ordered before the flagged one, so every
kernel reader of a flagged buffer reads the copy). A 64-bit word is read whole or not at all (single-copy
atomicity), so a word with the step's tag carries the step's value.

What stays as it was: the plain buffers are still written (the interpreter, the tests and the host read them),
the producers still fence and signal (off the consumers' critical path), and the event graph is the one the
unflagged program has (the interpreter and the race checks see no difference: the flags are a kernel-side
channel, not in any task's footprint). Only the task records drop the waits a polling reader no longer needs
(``skip_waits``: waits at step offset 0 on events signalled only by the tiles that write the polled copy); the
jit schedule keeps every wait (correct, without the gain).

A buffer is flagged only when every reader is one of the kinds above reading it through the argument that has a
flagged twin, and its one writer is a ``linear_residual``; the copies are ``state`` buffers ([..., 2] int32, 8 bytes
an element), so a new generation (``Session.reset``) zeroes them with the cache: tag 0 is never a step's (the tag
of step s is s + 1).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.abi import NULL_BUFFER, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.program import Program

PRODUCER = ("linear_residual", "Y", "Y_FLAGS")
"""The kind that writes a flagged copy: its output argument and that argument's flagged twin."""

READERS = {"norm_linear": ("X", "X_FLAGS"), "norm_linear_silu": ("X", "X_FLAGS"),
           "linear_residual": ("RESIDUAL", "RESIDUAL_FLAGS")}
"""Kinds that can read a flagged copy: the argument read and its flagged twin."""

POLLING = ("norm_linear", "norm_linear_silu")
"""Readers that poll the copy in place of their wait (the others read it after waits that already order it)."""

SUFFIX = ".flags"
"""A flagged copy's buffer name: the plain buffer's name plus this."""


def apply_flag_words(prog: Program) -> list[str]:
    """Add the flagged copies to ``prog`` in place (buffers and the tiles' flagged arguments); returns the names of
    the plain buffers that got one, in program order."""
    writers: dict[int, list] = {}
    readers: dict[int, list] = {}
    for op in prog.ops:
        for fp in op.writes:
            writers.setdefault(fp.buf, []).append(op)
        for fp in op.reads:
            readers.setdefault(fp.buf, []).append(op)
    flagged = []
    for op in prog.ops:
        if op.kind.name != PRODUCER[0] or not op.tiles:
            continue
        y = op.args[0][op.kind.arg_index(PRODUCER[1])][0]
        users = readers.get(y, [])
        if len(writers.get(y, [])) != 1 or not users or not any(u.kind.name in POLLING for u in users):
            continue
        if not all(u.kind.name in READERS and all(row[u.kind.arg_index(READERS[u.kind.name][0])][0] == y
                                                   for row in u.args) for u in users):
            continue  # some reader would read the plain buffer unordered: leave this one as it is
        buf = prog.buffers[y]
        fid = prog.buffer(buf.name + SUFFIX, (*buf.shape, 2), "i32", "state", view=(buf.view[0], 2 * buf.view[1]))
        _twin(op, PRODUCER[1], PRODUCER[2], fid)
        for u in {id(u): u for u in users}.values():
            _twin(u, *READERS[u.kind.name], fid)
        flagged.append(buf.name)
    return flagged


def _twin(op, arg: str, twin: str, fid: int) -> None:
    """Point every tile's ``twin`` argument at the flagged copy ``fid``, two int32 words per element of ``arg``."""
    a, t = op.kind.arg_index(arg), op.kind.arg_index(twin)
    for row in op.args:
        _, off, count = row[a]
        row[t] = (fid, 2 * off, 2 * count)


def skip_waits(cg) -> np.ndarray:
    """bool [waits]: the wait rows a task that polls a flagged copy drops from its record (see the module docstring):
    step offset 0, on an event whose every signaller is a tile of an op that writes that copy."""
    A, meta = cg.arrays, cg.meta
    tasks, waits, sig = A["tasks"], A["waits"], A["signals"]
    skip = np.zeros(waits.shape[0], bool)
    from mpk_dist.taskgraph.tasks import BY_NAME

    ops = meta["ops"]
    op_of_task = tasks[:, TASK_COLS["OP_INDEX"]].astype(np.int64)
    owner = np.repeat(np.arange(tasks.shape[0]), tasks[:, TASK_COLS["SIGNAL_END"]] - tasks[:, TASK_COLS["SIGNAL_BEGIN"]])
    signal_ops: dict[int, set] = {}
    for e, t in zip(sig[:, 0].tolist(), owner.tolist()):
        signal_ops.setdefault(e, set()).add(int(op_of_task[t]))
    args = A["args"]
    # the ops that write each flagged copy
    copy_writers: dict[int, set] = {}
    prod = BY_NAME[PRODUCER[0]]
    twin = prod.arg_index(PRODUCER[2])
    for t in range(tasks.shape[0]):
        if ops[int(op_of_task[t])]["kind"] != PRODUCER[0]:
            continue
        fid = int(args[tasks[t, TASK_COLS["ARG_BEGIN"]] + twin, 0])
        if fid != NULL_BUFFER:
            copy_writers.setdefault(fid, set()).add(int(op_of_task[t]))
    for t in range(tasks.shape[0]):
        kind = ops[int(op_of_task[t])]["kind"]
        if kind not in POLLING:
            continue
        fid = int(args[tasks[t, TASK_COLS["ARG_BEGIN"]] + BY_NAME[kind].arg_index(READERS[kind][1]), 0])
        if fid == NULL_BUFFER or fid not in copy_writers:
            continue
        for k in range(int(tasks[t, TASK_COLS["WAIT_BEGIN"]]), int(tasks[t, TASK_COLS["WAIT_END"]])):
            e, off = int(waits[k, WAIT_COLS["EVENT"]]), int(waits[k, WAIT_COLS["STEP_OFFSET"]])
            if off == 0 and signal_ops.get(e) and signal_ops[e] <= copy_writers[fid]:
                skip[k] = True
    return skip


def smem_bytes(cg) -> int:
    """Dynamic shared memory the polling tiles need (0 for a program without flagged copies): the body's own share
    (the reduction scratch and staged rows, for norm_linear_silu also its gate|up sums after them, as
    ``fusion.staging_bytes`` counts them) plus the gathered rows, B x K fp32 at the top (csrc/runtime/dispatch.cuh
    flag_gather). Counted for every tile of the polling kinds (the layer-0 and unflagged ones need no more)."""
    if not cg.meta.get("flag_words"):
        return 0
    from mpk_dist.taskgraph.fusion import PAIR_ALIGN, STAGE_OFFSET_BYTES, pair_offset
    from mpk_dist.taskgraph.tasks import kind_params

    need = 0
    for name in POLLING:
        p = kind_params(cg, name, "BATCH", "K", "N_TILE")
        if p is None:
            continue
        B, K, n = p
        body = STAGE_OFFSET_BYTES + 2 * B * K
        if name == "norm_linear_silu":
            body = pair_offset(B, K) + 2 * B * n
        body = -(-body // PAIR_ALIGN) * PAIR_ALIGN  # the rows start 16-byte aligned above it
        need = max(need, int((body + 4 * B * K).max()))
    return need
