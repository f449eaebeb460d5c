"""Compile the paged-KV graphs of all TP ranks (one ragged pass per launch) into task-graph programs.

Same pipeline as ``compiler.compile_rank_programs`` (lower, events on rank 0, serialize, validate)
over ``models.llama.build_paged_graph``. By default the head runs over the MB sequences: a
``gather_rows`` task picks each emitting sequence's last token row (``logit_rows``) before the final
norm, so ``logits`` is [MB, V/tp]; ``gather_last=False`` keeps the head over all N token rows
(``logits`` [N, V/tp], the rows picked on the host). One step per launch by default (``max_steps`` 1): the host
lays out each pass (tokens, positions, slots, page table) between launches. ``max_steps`` P > 1 is the
persistent form: one launch runs up to P passes, pass s as step s (forced_tokens row s, start_pos = positions - s),
the host posting each pass while the kernel runs (docs/SERVING.md "Persistent passes").
"""

from __future__ import annotations

from mpk_dist.config import ModelConfig
from mpk_dist.errors import InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.taskgraph.compiler import _same_structure
from mpk_dist.taskgraph.deps import build_events, reduce_events
from mpk_dist.taskgraph.lowering_comm import lower_graph
from mpk_dist.taskgraph.serialize import CompiledGraph, serialize
from mpk_dist.taskgraph.validate import validate


PERSISTENT_INPUTS = ("forced_tokens", "start_pos", "seq_slots", "release_slots", "logit_rows")
"""The buffers the host writes for each pass of a persistent launch (the GPU's pass_begin copies them).
The page table is not among them: page_alloc keeps it on the device."""

PASS_INPUTS = ("seq_slots", "release_slots", "logit_rows")
"""The paged inputs the host writes for a launch-per-pass (besides forced_tokens row 0 and start_pos)."""


def persistent_pass_inputs(x: dict, s: int) -> dict:
    """Pass ``s``'s values of PERSISTENT_INPUTS from a pass's tensors (``StepBatch.tensors``): the tokens go
    to forced_tokens row s, and start_pos = positions - s, since step_begin computes start_pos + step."""
    return {"forced_tokens": x["tokens"], "start_pos": x["positions"] - s, "seq_slots": x["seq_slots"],
            "release_slots": x["release_slots"], "logit_rows": x["logit_rows"]}


def page_state(cg: CompiledGraph) -> dict:
    """The device page allocator's state at server start (``tasks.page_alloc.initial_state``), by buffer
    name, sized from the program's buffers: the backends write it into every rank once, after zeroing."""
    from mpk_dist.taskgraph.tasks.page_alloc import initial_state

    shapes = {b["name"]: b["shape"] for b in cg.meta["buffers"]}
    rows, cols = shapes["page_table"]
    return initial_state(shapes["free_pages"][0], rows, cols)


def check_persistent_inputs(cg: CompiledGraph, inputs: tuple[str, ...] = PERSISTENT_INPUTS) -> None:
    """Every task reading a pass input is an ancestor (same step, through its waits) of the step's
    argmax_select: the host posts pass s once step s-1's argmax_select has run, and step_begin then
    overwrites these buffers, so a reader outside that set could still be reading them (AssertionError
    naming it)."""
    import numpy as np

    from mpk_dist.taskgraph.abi import ARG_COLS, SIGNAL_COLS, TASK_COLS, WAIT_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    tasks, waits, signals, args = (cg.arrays[k] for k in ("tasks", "waits", "signals", "args"))
    producers: dict[int, list[int]] = {}
    for t, row in enumerate(tasks):
        for k in range(row[TASK_COLS["SIGNAL_BEGIN"]], row[TASK_COLS["SIGNAL_END"]]):
            producers.setdefault(int(signals[k, SIGNAL_COLS["EVENT"]]), []).append(t)
    final = int(np.nonzero(tasks[:, TASK_COLS["OPCODE"]] == BY_NAME["argmax_select"].opcode)[0][0])
    seen, todo = {final}, [final]
    while todo:
        row = tasks[todo.pop()]
        for k in range(row[TASK_COLS["WAIT_BEGIN"]], row[TASK_COLS["WAIT_END"]]):
            if int(waits[k, WAIT_COLS["STEP_OFFSET"]]) != 0:
                continue
            for t in producers.get(int(waits[k, WAIT_COLS["EVENT"]]), []):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
    names = [b["name"] for b in cg.meta["buffers"]]
    ids = {names.index(n) for n in inputs}
    for t, row in enumerate(tasks):
        bufs = {int(b) for b in args[row[TASK_COLS["ARG_BEGIN"]]:row[TASK_COLS["ARG_END"]], ARG_COLS["BUFFER"]]}
        if bufs & ids and t not in seen:
            raise AssertionError(f"persistent passes: {cg.task_label(t)} reads {sorted(names[b] for b in bufs & ids)} "
                                 "but is not an ancestor of the step's argmax_select: the next pass's inputs could "
                                 "overwrite them while it runs")


def compile_paged_programs(cfg: ModelConfig, spec: PagedSpec, tp: int, sms: int = 16,
                           check: bool = True, gather_last: bool = True, max_steps: int = 1) -> list[CompiledGraph]:
    """The validated paged program of every rank (rank order); ``gather_last``: head over MB rows;
    ``max_steps``: passes one launch can run (1: a launch per pass)."""
    if max_steps < 1:
        raise InputError(f"paged program: expected max_steps >= 1 (passes per launch), got {max_steps}")
    progs = [lower_graph(build_paged_graph(cfg, spec, tp=tp, rank=r, gather_last=gather_last), sms,
                         max_steps=max_steps)
             for r in range(tp)]
    eg = reduce_events(build_events(progs[0]))
    info = {"model": cfg.architecture or cfg.family, "family": cfg.family,
            "max_seq_len": spec.page_size * spec.max_pages_per_seq, "sms": sms, "num_layers": cfg.num_layers,
            "paged": {"max_tokens": spec.max_tokens, "max_seqs": spec.max_seqs, "num_pages": spec.num_pages,
                      "page_size": spec.page_size, "max_pages_per_seq": spec.max_pages_per_seq,
                      "gather_last": gather_last}}
    out = []
    for r, prog in enumerate(progs):
        if not _same_structure(progs[0], prog):
            raise AssertionError(f"rank {r}: paged task graph structure differs from rank 0")
        cg = serialize(prog, eg, info, sms)
        if check:
            validate(cg, structure=(r == 0))
            if max_steps > 1 and r == 0:
                check_persistent_inputs(cg)
        out.append(cg)
    return out
