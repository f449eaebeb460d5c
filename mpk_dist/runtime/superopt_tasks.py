"""Superoptimized task bodies for one mega-kernel build: search, cache, render, include path.

When a kernel is built with ``KernelShape.superopt`` (the default; ``--no-superopt`` turns it off),
``prepare(program)`` asks the superoptimizer for every fusable pattern the compiled program runs, at
the program's decode shapes (B, K, N of its ``norm_linear`` tiles: every rms_norm -> linear incl.
the qkv, gate/up and lm_head projections; and of its ``silu_linear`` tiles: silu*mul -> down),
renders the chosen µGraph with ``mpk_dist.superopt.codegen.render`` and writes the header into a
per-(pattern, µGraph hash) folder of the kernel build cache. Those folders go first on the include
path, so ``#include "generated/<kind>.cuh"`` in dispatch.cuh picks them over csrc/tasks/generated,
and the build's cache key (which hashes every included header) covers the generated text.

One generated function serves every tile of a kind (K and N are run-time parameters), so when a
program has several shapes of one kind, the body comes from the shape that streams the most weight
bytes per step among those whose search gave a µGraph the code generator lowers (printed). A kind
without any runs its hand-written body (``-DMPK_SUPEROPT_<KIND>=0``) with a printed note saying why.

Cache: each problem's choice (the µGraph as plain data, the search statistics, or the reason there
is none) is stored as JSON under ``$MPK_CACHE_DIR/superopt/tasks/`` keyed by pattern, shapes, eps,
search bounds and package version, so a warm compile does not search again (it prints "cached").
Unlike ``superoptimize``'s own cache, a timed-out search is stored too: a compile must be
reproducible and fast on the second run; delete the file to search again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from mpk_dist import __version__

KIND_PATTERN = {"norm_linear": "rmsnorm_linear", "silu_linear": "silu_mul_linear", "qk_norm_rope": "qk_norm_rope"}
"""Generated body (function name) -> the superopt pattern whose µGraph replaces its hand-written body.
``qk_norm_rope`` is the per-head q/k norm + rope inside the qkv_prep task (csrc/tasks/qkv_prep.cuh)."""
HAND_WRITTEN = {"qk_norm_rope": "qkv_prep.cuh"}
"""Where a body's hand-written version lives when it is not csrc/tasks/<kind>.cuh."""

CACHE_FORMAT = 2  # 2: grid counts costed at their first loop count that fits (K=12288 silu_linear lowers now)
DEFAULT_TIMEOUT_S = 120.0
"""Per-problem search limit (``MPK_SUPEROPT_TIMEOUT`` overrides); the best verified graph so far is used."""
PATTERN_TIMEOUT_S = {"qk_norm_rope": 25.0}
"""Patterns whose search always ends at its limit (qk_norm_rope: the depth-2 space with five inputs is not
exhausted within minutes) get a shorter default, so a cold compile stays reasonable; the searches of one
build run side by side (``search_side_by_side``), so this limit is the cold build's search time. On the H200
machine (qwen3-8b, empty cache, 2026-11-30): 30 s gave a 58.3 s cold start, then 62.6 s once the kernel grew
(nvcc ~30 s); 25 s explored 0.83 M graphs, chose the same µGraph af488251fdd1898c as 30 s and started cold in
59.1 s; 20 s (0.61 M) chose another one (f7ac2faf93e6f94d, 54.0 s); 12 s verified none. ``MPK_SUPEROPT_TIMEOUT``
still overrides."""
MAX_SEARCH_WEIGHTS = 1 << 26
"""Largest K*N searched (``MPK_SUPEROPT_MAX_WEIGHTS`` overrides). The verifier evaluates the whole
µGraph at the real shape in float64 and over finite fields, so memory and time grow with the weight:
qwen3-0.6b's lm_head (1024 x 151936) took 184 s and 4.8 GB on 2 cores. A larger problem runs the
body its kind gets from the searched shapes (the body is generic in K and N)."""


@dataclass(frozen=True)
class Problem:
    """One fusable pattern at one decode shape: ``kind`` with B rows, reduction K, N output columns."""

    kind: str
    batch: int  # rows: batch rows of a linear; heads for qk_norm_rope
    k: int      # reduction length; the head dim D for qk_norm_rope
    n: int      # output columns; D for qk_norm_rope
    eps: float = 0.0  # the rms_norm epsilon (norm_linear, qk_norm_rope)

    @property
    def pattern(self) -> str:
        """The superopt pattern name."""
        return KIND_PATTERN[self.kind]

    def label(self) -> str:
        """Short text for messages: ``norm_linear B=1 K=1024 N=4096 eps=1e-06``, ``qk_norm_rope H=16 D=128
        eps=1e-06`` (the epsilon is part of the problem: llama3 and qwen3 at the same shape search apart)."""
        eps = f" eps={self.eps:g}" if self.eps else ""
        if self.kind == "qk_norm_rope":
            return f"{self.kind} H={self.batch} D={self.k}{eps}"
        return f"{self.kind} B={self.batch} K={self.k} N={self.n}{eps}"

    def target(self):
        """The superopt target Graph at this shape."""
        from mpk_dist.superopt import patterns

        if self.kind == "norm_linear":
            return patterns.rmsnorm_linear(M=self.batch, K=self.k, N=self.n, eps=self.eps)
        if self.kind == "qk_norm_rope":
            return patterns.qk_norm_rope(H=self.batch, D=self.k, eps=self.eps)
        return patterns.silu_mul_linear(M=self.batch, I=self.k, N=self.n)


@dataclass
class Choice:
    """What the search gave for one problem: the µGraph (plain data) or the reason there is none."""

    problem: Problem
    ugraph: dict | None
    stats: dict = field(default_factory=dict)
    note: str = ""

    @property
    def ug_hash(self) -> str:
        """16 hex digits identifying the µGraph (its canonical JSON)."""
        text = json.dumps(self.ugraph, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class SuperoptBuild:
    """What the kernel build needs: include folders (first on the path) and -D defines."""

    include_dirs: list[Path] = field(default_factory=list)
    defines: dict[str, int] = field(default_factory=dict)
    choices: dict[str, Choice] = field(default_factory=dict)  # kind -> the choice its body comes from
    notes: list[str] = field(default_factory=list)


def _f32(bits: int) -> float:
    """A float param from its bit pattern (float params travel as int32)."""
    return float(np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])


def problems_of(cg) -> dict[Problem, int]:
    """The fusable problems a compiled program runs -> weight elements its tiles stream per step
    (qk_norm_rope: head values per step). A model without q/k norms (Llama) has no qk_norm_rope problem:
    its qkv_prep is rope only and keeps the hand-written body."""
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    tasks, params = cg.arrays["tasks"], cg.arrays["params"]
    out: dict[Problem, int] = {}
    # norm_linear_silu runs norm_linear's body on the gate|up projection (N = 2 I, twice its Y_STRIDE)
    for kind_name, body, widths in (("norm_linear", "norm_linear", 1), ("silu_linear", "silu_linear", 1),
                                    ("norm_linear_silu", "norm_linear", 2)):
        kind = BY_NAME[kind_name]
        rows = tasks[tasks[:, TASK_COLS["OPCODE"]] == kind.opcode]
        for p0 in rows[:, TASK_COLS["PARAM_BEGIN"]].tolist():
            get = lambda name: int(params[p0 + kind.param_index(name)])  # noqa: E731
            eps = _f32(get("EPS")) if body == "norm_linear" else 0.0
            prob = Problem(body, get("BATCH"), get("K"), widths * get("Y_STRIDE"), eps)
            out[prob] = out.get(prob, 0) + get("K") * get("N_TILE")
    out.update(_qk_problems(cg))
    for prob, w in _qk_problems_fused(cg).items():
        out[prob] = out.get(prob, 0) + w
    return out


def _normed_tiles(cg, kind_name: str, norm_arg: str) -> tuple[list, Callable[[object, str], int]]:
    """Tiles of ``kind_name`` whose ``norm_arg`` is bound (the model has q/k norms), and a reader of their
    parameters by name."""
    from mpk_dist.taskgraph.abi import ARG_COLS, NULL_BUFFER, TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    kind = BY_NAME[kind_name]
    tasks, params, args = cg.arrays["tasks"], cg.arrays["params"], cg.arrays["args"]
    rows = tasks[tasks[:, TASK_COLS["OPCODE"]] == kind.opcode]
    normed = [t for t in rows if args[t[TASK_COLS["ARG_BEGIN"]] + kind.arg_index(norm_arg), ARG_COLS["BUFFER"]]
              != NULL_BUFFER]

    def get(t, name: str) -> int:
        return int(params[int(t[TASK_COLS["PARAM_BEGIN"]]) + kind.param_index(name)])

    return normed, get


def _first_layer(tiles: list) -> list:
    from mpk_dist.taskgraph.abi import TASK_COLS

    layer0 = min(int(t[TASK_COLS["LAYER"]]) for t in tiles)
    return [t for t in tiles if int(t[TASK_COLS["LAYER"]]) == layer0]


def _qk_problems(cg) -> dict[Problem, int]:
    """qk_norm_rope at (H = q heads of one layer, D, eps) when the qkv_prep tiles have a norm weight."""
    normed, get = _normed_tiles(cg, "qkv_prep", "NORM_W")
    if not normed:
        return {}
    q_heads = [t for t in _first_layer(normed) if not get(t, "IS_KV")]
    t = q_heads[0] if q_heads else normed[0]
    D = get(t, "HEAD_DIM")
    prob = Problem("qk_norm_rope", max(1, len(q_heads)), D, D, _f32(get(t, "EPS")))
    return {prob: len(normed) * D * get(t, "BATCH")}


def _qk_problems_fused(cg) -> dict[Problem, int]:
    """The same problem from attention_prep tiles (the attn_prep fusion: qkv_prep folded into the
    attention tiles, one per (kv head, sequence)): H = GROUP x the kv heads of one layer."""
    normed, get = _normed_tiles(cg, "attention_prep", "Q_NORM_W")
    if not normed:
        return {}
    tiles0 = _first_layer(normed)
    t = tiles0[0]
    D, G = get(t, "HEAD_DIM"), get(t, "GROUP")
    kv_heads = max(1, len(tiles0) // max(1, int(cg.meta["batch"])))
    prob = Problem("qk_norm_rope", G * kv_heads, D, D, _f32(get(t, "EPS")))
    return {prob: len(normed) * (G + 1) * D}


CHECKED_IN_QK = "csrc/tasks/generated/qk_norm_rope.cuh (rendered from qk_norm_rope.ugraph.json beside it)"
"""The qk_norm_rope body split-KV and batch-1 programs compile (see _qk_checked_in)."""


def _qk_checked_in(cg) -> str:
    """Why the program's q/k norm + rope compiles the checked-in generated body unsearched, or '' when it searches:
    split prep tiles (``_split_prep_normed``) and every batch-1 program with a q/k norm. Batch 1 is the cold start
    issue 6 bounds (<= 60 s for qwen3-8b) and since 'auto' leaves the 8B presets' attention unsplit there (docs/PERF.md
    v0.29) their qkv prep would search again: 25 s, and under a loaded build machine the search may end before it
    verifies a graph (the hand-written body then: another kernel from the same request). The checked-in body is
    rendered from the µGraph that search finds at H = 32, D = 128 when it completes (82cad1ded51e4860).
    MPK_SUPEROPT_QK_SEARCH=1 searches batch-1 programs at build time again."""
    if _split_prep_normed(cg):
        return "in the split prep tiles"
    if (int(cg.meta["batch"]) == 1 and os.environ.get("MPK_SUPEROPT_QK_SEARCH") != "1"
            and (_qk_problems(cg) or _qk_problems_fused(cg))):
        return "in a batch-1 program"
    return ""


def _split_prep_normed(cg) -> bool:
    """Whether the program's attention_split_prep tiles (the prep folded into split-KV attention: 'auto' at batch 1
    on the small presets, or an explicit count) run a q/k norm. They call the qk_norm_rope hook like qkv_prep, but
    are not searched at build time (``_qk_checked_in``): without a define the hook compiles the checked-in body."""
    return bool(_normed_tiles(cg, "attention_split_prep", "Q_NORM_W")[0])


def _bounds(pattern: str) -> dict:
    from mpk_dist.cli.commands.superopt import PATTERN_BOUNDS  # the CLI's bounds: one fact, one place

    return dict(PATTERN_BOUNDS[pattern])


def cache_path(problem: Problem) -> Path:
    """The JSON file holding ``problem``'s choice."""
    from mpk_dist.superopt.search import cache_dir

    text = json.dumps([problem.pattern, problem.batch, problem.k, problem.n, repr(problem.eps),
                       _bounds(problem.pattern), __version__, CACHE_FORMAT])
    return cache_dir() / "tasks" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def _read(path: Path) -> Choice | None:
    try:
        d = json.loads(path.read_text())
        prob = Problem(**d["problem"])
        return Choice(prob, d["ugraph"], d.get("stats", {}), d.get("note", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: search again


def _write(path: Path, c: Choice) -> None:
    d = {"problem": c.problem.__dict__, "ugraph": c.ugraph, "stats": c.stats, "note": c.note}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(d, default=str))
        os.replace(tmp, path)  # atomic: a concurrent compile reads the old file or the new one
    except OSError:
        pass  # an unwritable cache only costs a later search


def _jsonable(ug) -> dict:
    """A µGraph's to_dict() as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(ug.to_dict(), default=str))


def search(problem: Problem, timeout_s: float | None = None, processes: int | None = None) -> Choice:
    """Run the superoptimizer for ``problem`` and keep its cheapest candidate the codegen lowers."""
    from mpk_dist.superopt import superoptimize
    from mpk_dist.superopt.codegen import render
    from mpk_dist.superopt.codegen_plan import CodegenError

    default = PATTERN_TIMEOUT_S.get(problem.pattern, DEFAULT_TIMEOUT_S)
    timeout_s = timeout_s or float(os.environ.get("MPK_SUPEROPT_TIMEOUT", default))
    res = superoptimize(problem.target(), timeout_s=timeout_s, processes=processes, **_bounds(problem.pattern))
    stats = {k: v for k, v in res.stats.items() if isinstance(v, (int, float, bool, str))}
    if not res.candidates:
        why = "timed out before verifying one" if res.stats.get("timed_out") else "none within the bounds"
        return Choice(problem, None, stats, f"the search found no verified µGraph ({why})")
    errors = []
    for i, ug in enumerate(res.candidates):
        d = _jsonable(ug)
        try:
            render(d, problem.kind, eps=problem.eps)
        except CodegenError as exc:
            errors.append(str(exc))
            continue
        note = f"candidate {i + 1} of {len(res.candidates)} (the cheaper ones do not lower: {errors[0]})" if errors else ""
        return Choice(problem, d, dict(stats, rank=i), note)
    return Choice(problem, None, stats, f"no verified µGraph lowers to a task body: {errors[0]}")


_MEMO: dict[Path, Choice] = {}
_NOTED: set[str] = set()


def choose(problem: Problem, searcher=search, log=None) -> Choice:
    """``problem``'s choice from this process, the disk cache, or a search (stored); prints one line
    per problem and process: the search time when it searched, "cached" when it did not."""
    log = log or _log
    path = cache_path(problem)
    if path in _MEMO:
        return _MEMO[path]
    c = _read(path)
    if c is not None and c.problem == problem:
        log(f"superopt: {problem.label()}: cached ({_what(c)}){_timed_out_hint(c, path)}")
    else:
        c = searcher(problem)
        _write(path, c)
        how = ("superoptimize's cache hit" if c.stats.get("cached") else
               f"searched in {c.stats.get('seconds', 0.0):.1f} s ({c.stats.get('explored', 0)} explored"
               f"{', timed out' if c.stats.get('timed_out') else ''})")
        log(f"superopt: {problem.label()}: {how}; {_what(c)}{_timed_out_hint(c, path)}")
    _MEMO[path] = c
    return c


def _timed_out_hint(c: Choice, path: Path) -> str:
    """For a stored answer of a search that hit its time limit: where it is and how to search again. Why: a search
    slowed by a loaded machine (a cold build beside other work) may stop before the graph a quiet machine finds,
    and its answer is kept for every later build."""
    if not c.stats.get("timed_out"):
        return ""
    return (f" [the search hit its time limit, so this answer may be worse than a full search's: delete {path} "
            f"or raise MPK_SUPEROPT_TIMEOUT to search again]")


def _what(c: Choice) -> str:
    return f"µGraph {c.ug_hash}" if c.ugraph is not None else "no µGraph"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def header_dir(c: Choice) -> Path:
    """The include folder holding ``generated/<kind>.cuh`` rendered from ``c`` (written if changed)."""
    from mpk_dist.runtime.build import cache_root
    from mpk_dist.superopt.codegen import render, write_if_changed

    d = cache_root() / "superopt" / f"{c.problem.pattern}-{c.ug_hash}"
    write_if_changed(d / "generated" / f"{c.problem.kind}.cuh", render(c.ugraph, c.problem.kind, eps=c.problem.eps))
    return d


def _hand_written(out: SuperoptBuild, kind: str, why: str) -> None:
    out.defines[f"MPK_SUPEROPT_{kind.upper()}"] = 0
    out.notes.append(f"superopt: {kind} runs the hand-written body (csrc/tasks/{HAND_WRITTEN.get(kind, kind + '.cuh')}): "
                     f"{why}")


def _searchable(mine: dict) -> tuple[dict, int]:
    """(the problems of ``mine`` small enough to search, the weight cap MPK_SUPEROPT_MAX_WEIGHTS)."""
    cap = int(os.environ.get("MPK_SUPEROPT_MAX_WEIGHTS", MAX_SEARCH_WEIGHTS))
    return {p: w for p, w in mine.items() if p.k * p.n <= cap}, cap


def search_side_by_side(problems: list, searcher=search) -> None:
    """Search, all at once, the problems that neither this process nor the disk cache answers, each in
    its own forked process (each search runs its own enumeration pool); the choices land in this
    process's memo and the disk cache, where ``choose`` finds them. A cold qwen3-8b build used to wait
    for its three searches in turn (9 + 5 + 30 s on the H200 machine, 2026-11-30). A custom ``searcher``
    (tests) keeps the one-by-one path."""
    todo = []
    for p in problems:
        path = cache_path(p)
        c = _MEMO.get(path) or _read(path)
        if not (c is not None and c.problem == p) and p not in todo:
            todo.append(p)
    if searcher is not search or len(todo) < 2:
        return
    import functools
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(len(todo), mp_context=multiprocessing.get_context("fork")) as ex:
        # each child logs its search line and writes the cache
        for p, c in zip(todo, ex.map(functools.partial(choose, searcher=searcher), todo)):
            _MEMO[cache_path(p)] = c


def _kind_body(out: SuperoptBuild, kind: str, mine: dict, searcher, log) -> None:
    """Choose (and write) the body of ``kind`` from its problems ``mine`` (problem -> weights)."""
    small, cap = _searchable(mine)
    big = sorted(p.label() for p in mine if p not in small)
    if big:
        out.notes.append(f"superopt: not searched (K*N > {cap}, MPK_SUPEROPT_MAX_WEIGHTS): {', '.join(big)}")
    if not small:
        return _hand_written(out, kind, "no shape searched")
    choices = {p: choose(p, searcher, log) for p in sorted(small, key=lambda p: (p.k, p.n, p.batch))}
    out.notes += [f"superopt: {p.label()}: {c.note}" for p, c in choices.items() if c.note]
    ok = {p: w for p, w in small.items() if choices[p].ugraph is not None}
    if not ok:
        return _hand_written(out, kind, "no searched shape gave a µGraph the code generator lowers")
    lead = max(ok, key=lambda p: (ok[p], p.n))  # the shape that streams the most weight bytes
    out.include_dirs.append(header_dir(choices[lead]))
    out.choices[kind] = choices[lead]
    if len(mine) > 1:
        out.notes.append(f"superopt: {kind} body from the µGraph of {lead.label()} (most weight bytes of the "
                         f"{len(ok)} shape(s) with a lowerable µGraph; {len(mine)} in the program)")


def _has_qkv_prep(cg) -> bool:
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.tasks import BY_NAME

    ops = cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
    return bool(np.isin(ops, [BY_NAME[k].opcode for k in ("qkv_prep", "attention_prep", "attention_split_prep")]).any())


def prepare(cg, searcher=search, log=None) -> SuperoptBuild:
    """Include folders and defines that make the build of ``cg``'s kernel use generated bodies."""
    log = log or _log
    out = SuperoptBuild()
    probs = problems_of(cg)
    qk_fixed = _qk_checked_in(cg)
    if qk_fixed:
        probs = {p: w for p, w in probs.items() if p.kind != "qk_norm_rope"}
    search_side_by_side([p for kind in KIND_PATTERN for p in _searchable({q: w for q, w in probs.items()
                                                                           if q.kind == kind})[0]], searcher)
    for kind in KIND_PATTERN:
        mine = {p: w for p, w in probs.items() if p.kind == kind}
        if mine:  # else the kind does not run: whatever body is compiled, no tile calls it
            _kind_body(out, kind, mine, searcher, log)
        elif kind == "qk_norm_rope" and qk_fixed:
            out.notes.append(f"superopt: qk_norm_rope {qk_fixed}: the checked-in generated body {CHECKED_IN_QK}; "
                             "not searched at build time")
        elif kind == "qk_norm_rope" and _has_qkv_prep(cg):  # rope only (no q/k norm): nothing to replace
            _hand_written(out, kind, "the model has no q/k norm (rope only; the qk_norm_rope pattern needs one)")
    for n in out.notes:
        if n not in _NOTED:  # once per process, not once per rank
            _NOTED.add(n)
            log(n)
    return out
