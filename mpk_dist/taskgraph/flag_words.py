"""Flagged words: activations handed from one level to the next without an event wait.

A linear level's last tile ends with a block barrier, ``fence.acq_rel.gpu`` and a signal; the next level's
tiles see the signal (csrc/bench/event_wake.cu: the last of 131 waiters 1.5-2.3 us after it under load), pass a
block barrier and then load the vector itself: latency only, about five times a layer (docs/PERF.md, "Level
boundaries"). With this pass (opt-in: fusion names 'flags' and 'flags16', the megakernel's ``MPK_FLAG_WORDS=1``
and ``=2``) the tiles that write an activation also write a flagged copy of it: 64-bit words of (value bits, step
tag), each stored with one relaxed store, and the next level's tiles poll the words themselves until every tag is
the step's instead of waiting on the producers' event. A 64-bit word is read whole or not at all (single-copy
atomicity), so a word with the step's tag carries the step's value.

* 'flags': the fp32 residual stream (``x_mid``, ``x_out``), one element a word, written by ``linear_residual``
  (o_proj and down at tp 1) and polled by the norm prologues of the next level (``norm_linear``,
  ``norm_linear_silu``: qkv, gate|up, the lm_head), which gather the words into shared memory; the residual reads
  of the next ``linear_residual`` take the word too (the plain store is not ordered before the flagged one, so every
  kernel reader of a flagged buffer reads the copy; that read is ordered after the polling tiles of the level
  between, which saw the same words, by its own events).
* 'flags16' (with 'flags'): also the bf16 vectors the down and o_proj projections read (the gate|up product written
  by ``norm_linear_silu``, the attention output written by the split tiles' head merge), two values a word; a
  ``linear_residual`` whose X and RESIDUAL are both flagged polls both (X into its staged rows, the residual slice
  beside them) instead of its waits.

What stays as it was: the plain buffers are still written (the interpreter, the tests and the host read them),
the producers still fence and signal (off the consumers' critical path), and the event graph is the one the
unflagged program has (the interpreter and the race checks see no difference: the flags are a kernel-side
channel, not in any task's footprint). Only the task records drop the waits a polling reader no longer needs
(``skip_waits``: waits at step offset 0 on events signalled only by tiles that write a copy it polls); the jit
schedule keeps every wait (correct, without the gain). A polling task reads nothing else that a producer of the
step wrote (weights and norm weights are constants).

A buffer is flagged only when its one writer is a producer kind above and every reader reads it through an
argument with a flagged twin; the copies are ``state`` buffers of int32 pairs (8 bytes an fp32 element, 8 bytes
two bf16), zeroed with the cache by ``Session.reset``: tag 0 is never a step's (the tag of step s is s + 1).
"""

from __future__ import annotations

import numpy as np

from mpk_dist.taskgraph.abi import NULL_BUFFER, TASK_COLS, WAIT_COLS
from mpk_dist.taskgraph.program import Program

PRODUCERS = {"flags": {"linear_residual": ("Y", "Y_FLAGS")},
             "flags16": {"norm_linear_silu": ("Y", "Y_FLAGS"), "attention_split_prep": ("MERGED", "MERGED_FLAGS"),
                         "attention_split": ("MERGED", "MERGED_FLAGS")}}
"""Per fusion name, the kinds that write a flagged copy: their output argument and its flagged twin."""

READERS = {"norm_linear": (("X", "X_FLAGS"),), "norm_linear_silu": (("X", "X_FLAGS"),),
           "linear_residual": (("RESIDUAL", "RESIDUAL_FLAGS"), ("X", "X_FLAGS"))}
"""Kinds that can read a flagged copy: (argument, its flagged twin) pairs."""

PRODUCER_TWINS = {kind: twin for f in PRODUCERS.values() for kind, (_, twin) in f.items()}
"""Each producer kind's flagged twin, whichever fusion name asks for it."""

POLLED = {"norm_linear": "X_FLAGS", "norm_linear_silu": "X_FLAGS", "linear_residual": "X_FLAGS"}
"""The twin whose presence makes a task poll in place of its waits (a linear_residual polls its residual too)."""

SUFFIX = ".flags"
"""A flagged copy's buffer name: the plain buffer's name plus this."""


def words_per_element(dtype: str) -> int:
    """int32 words of a flagged copy per element of the plain buffer: an fp32 value a 64-bit word (2), or two bf16 a
    word (1)."""
    return {"f32": 2, "bf16": 1}[dtype]


def apply_flag_words(prog: Program, fusions) -> list[str]:
    """Add the flagged copies that ``fusions`` ('flags', 'flags16') ask for to ``prog`` in place (buffers and the
    tiles' flagged arguments); returns the names of the plain buffers that got one, in program order."""
    producers = {k: v for f in ("flags", "flags16") if f in fusions for k, v in PRODUCERS[f].items()}
    writers: dict[int, list] = {}
    readers: dict[int, list] = {}
    for op in prog.ops:
        for fp in op.writes:
            writers.setdefault(fp.buf, []).append(op)
        for fp in op.reads:
            readers.setdefault(fp.buf, []).append(op)
    flagged, fid_of = [], {}
    for op in prog.ops:
        if op.kind.name not in producers or not op.tiles:
            continue
        out, twin = producers[op.kind.name]
        a = op.kind.arg_index(out)
        y = op.args[0][a][0]
        if y == NULL_BUFFER or y in fid_of or any(row[a][0] != y for row in op.args):
            continue
        buf = prog.buffers[y]
        users = readers.get(y, [])
        if buf.dtype not in ("f32", "bf16") or len({id(w) for w in writers.get(y, [])}) != 1 or not users:
            continue
        if buf.dtype == "bf16" and (buf.shape[-1] % 2 or any(row[a][1] % 2 or row[a][2] % 2 for row in op.args)):
            continue  # a word holds a column pair: no pair may straddle two tiles
        if not all(_reads_through_twins(u, y) for u in users):
            continue  # some reader would read the plain buffer unordered: leave this one as it is
        wpe = words_per_element(buf.dtype)
        shape = (*buf.shape, 2) if wpe == 2 else (*buf.shape[:-1], buf.shape[-1] // 2, 2)
        fid = prog.buffer(buf.name + SUFFIX, shape, "i32", "state", view=(buf.view[0], wpe * buf.view[1]))
        fid_of[y] = fid
        _twin(op, out, twin, fid, wpe)
        flagged.append(buf.name)
    for op in prog.ops:  # every reader of a flagged buffer reads its copy
        for arg, twin in READERS.get(op.kind.name, ()):
            y = op.args[0][op.kind.arg_index(arg)][0] if op.tiles else NULL_BUFFER
            if y in fid_of:
                _twin(op, arg, twin, fid_of[y], words_per_element(prog.buffers[y].dtype))
    for op in prog.ops:  # a linear_residual polls only when its residual is flagged too (its one other input)
        if op.kind.name == "linear_residual" and op.tiles:
            x_twin, r_twin = op.kind.arg_index("X_FLAGS"), op.kind.arg_index("RESIDUAL_FLAGS")
            if op.args[0][x_twin][0] != NULL_BUFFER and op.args[0][r_twin][0] == NULL_BUFFER:
                for row in op.args:
                    row[x_twin] = (NULL_BUFFER, 0, 0)  # reads X after its wait; the copy's writes go unread
    return flagged


def _reads_through_twins(op, y: int) -> bool:
    """Whether every argument of ``op`` that names buffer ``y`` has a flagged twin."""
    names = [a.name for a in op.kind.args]
    twinned = {arg for arg, _ in READERS.get(op.kind.name, ())}
    return op.tiles > 0 and all(names[i] in twinned for i, (buf, _, _) in enumerate(op.args[0]) if buf == y) and \
        any(names[i] in twinned for i, (buf, _, _) in enumerate(op.args[0]) if buf == y)


def _twin(op, arg: str, twin: str, fid: int, wpe: int) -> None:
    """Point every tile's ``twin`` argument at the flagged copy ``fid``: ``wpe`` int32 words per element of ``arg``."""
    a, t = op.kind.arg_index(arg), op.kind.arg_index(twin)
    for row in op.args:
        _, off, count = row[a]
        row[t] = (fid, wpe * off, wpe * count)


def twin_buffers(cg, t: int) -> dict[str, int]:
    """Task t's flagged-twin arguments (reader or producer) that point at a copy: {twin name: copy buffer id}."""
    from mpk_dist.taskgraph.tasks import BY_NAME

    kind = cg.meta["ops"][int(cg.arrays["tasks"][t, TASK_COLS["OP_INDEX"]])]["kind"]
    twins = {tw for _, tw in READERS.get(kind, ())} | ({PRODUCER_TWINS[kind]} if kind in PRODUCER_TWINS else set())
    row0 = int(cg.arrays["tasks"][t, TASK_COLS["ARG_BEGIN"]])
    fids = {tw: int(cg.arrays["args"][row0 + BY_NAME[kind].arg_index(tw), 0]) for tw in twins}
    return {tw: fid for tw, fid in fids.items() if fid != NULL_BUFFER}


def copy_writers(cg) -> dict[int, set[int]]:
    """Each flagged copy of program ``cg`` -> the ops (indices into meta["ops"]) whose tiles write it."""
    ops, op_of_task = cg.meta["ops"], cg.arrays["tasks"][:, TASK_COLS["OP_INDEX"]].tolist()
    out: dict[int, set[int]] = {}
    for t, oi in enumerate(op_of_task):
        twin = PRODUCER_TWINS.get(ops[oi]["kind"])
        fid = twin_buffers(cg, t).get(twin) if twin else None
        if fid is not None:
            out.setdefault(fid, set()).add(oi)
    return out


def skip_waits(cg) -> np.ndarray:
    """bool [waits]: the wait rows a polling task drops from its record (see the module docstring): step offset 0, on
    an event whose every signaller is a tile of an op that writes a copy the task reads."""
    A, ops = cg.arrays, cg.meta["ops"]
    tasks, waits, sig = A["tasks"], A["waits"], A["signals"]
    skip = np.zeros(waits.shape[0], bool)
    op_of_task = tasks[:, TASK_COLS["OP_INDEX"]].astype(np.int64)
    nsig = tasks[:, TASK_COLS["SIGNAL_END"]] - tasks[:, TASK_COLS["SIGNAL_BEGIN"]]
    owner = np.repeat(np.arange(tasks.shape[0]), nsig)
    signal_ops: dict[int, set] = {}
    for e, t in zip(sig[:, 0].tolist(), owner.tolist()):
        signal_ops.setdefault(e, set()).add(int(op_of_task[t]))
    writers = copy_writers(cg)
    for t in range(tasks.shape[0]):
        kind = ops[int(op_of_task[t])]["kind"]
        if kind not in POLLED:
            continue
        tw = twin_buffers(cg, t)
        if POLLED[kind] not in tw:
            continue
        read = set().union(*(writers.get(fid, set()) for name, fid in tw.items() if name != PRODUCER_TWINS.get(kind)))
        for k in range(int(tasks[t, TASK_COLS["WAIT_BEGIN"]]), int(tasks[t, TASK_COLS["WAIT_END"]])):
            e, off = int(waits[k, WAIT_COLS["EVENT"]]), int(waits[k, WAIT_COLS["STEP_OFFSET"]])
            if off == 0 and signal_ops.get(e) and signal_ops[e] <= read:
                skip[k] = True
    return skip


def smem_bytes(cg) -> int:
    """Dynamic shared memory the polling tiles need (0 for a program without flagged copies). A norm tile: its body's
    share (the reduction scratch and staged rows, for norm_linear_silu also its gate|up sums after them, as
    ``fusion.staging_bytes`` counts them) plus the gathered rows, B x K fp32 at the top (csrc/runtime/dispatch.cuh
    flag_gather); a polling linear_residual: its x rows staged as bf16 after the reduction scratch, then its B x N_TILE
    residual values. Counted for every tile of these kinds (the unflagged ones need no more)."""
    if not cg.meta.get("flag_words"):
        return 0
    from mpk_dist.taskgraph.fusion import PAIR_ALIGN, STAGE_OFFSET_BYTES, pair_offset
    from mpk_dist.taskgraph.tasks import kind_params

    need = 0
    for name in POLLED:
        p = kind_params(cg, name, "BATCH", "K", "N_TILE")
        if p is None:
            continue
        B, K, n = p
        body = STAGE_OFFSET_BYTES + 2 * B * K
        if name == "norm_linear_silu":
            body = pair_offset(B, K) + 2 * B * n
        body = -(-body // PAIR_ALIGN) * PAIR_ALIGN  # what follows starts 16-byte aligned
        extra = 4 * B * n if name == "linear_residual" else 4 * B * K
        need = max(need, int((body + extra).max()))
    return need
