"""CPU interpreter of the SERIALIZED task graph: all TP ranks in one process, random valid schedules.

Each rank has its own buffer set (flat torch tensors sized from the buffer table); symmetric (comm)
buffers are real per-rank buffers, and a remote write lands in every rank's copy, as through the
GPU's peer pointers. Event counters follow the kernel's rule exactly: never reset within a launch,
a wait (event, offset) in step s passes at counter >= (s + 1 + offset) * triggers. Every step's task
instances exist from the start (a ``PersistentLaunch`` adds a step's when the host posts it); at each
point one ready instance is picked at random (seeded), so
steps overlap wherever the events allow. ``mode='aot'`` instead runs each worker's static list in
order (random interleaving of workers), which also proves those lists deadlock-free. With
``check_races`` each access is checked against shadow state (``mpk_dist.taskgraph.race``).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from mpk_dist.errors import DeviceTimeout, InputError
from mpk_dist.taskgraph.abi import EVENT_COLS, NULL_BUFFER, SIG_ALL_RANKS, TASK_COLS
from mpk_dist.taskgraph.race import Race, RaceError, Shadow
from mpk_dist.taskgraph.serialize import CompiledGraph
from mpk_dist.taskgraph.tasks import BY_OPCODE
from mpk_dist.taskgraph.tasks.base import TileContext

TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32}
UNTRACKED = ("weight", "const", "input", "ticket")  # tickets: atomic words, modelled in _Launch._take_ticket


@dataclass
class RunResult:
    """Tokens [steps, B] of a launch, captured per-step outputs {name: [steps, B, full]}, races."""

    tokens: torch.Tensor
    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    races: list[Race] = field(default_factory=list)
    executed: int = 0


class _Decoded:
    """One rank's tables decoded into Python lists (for speed; from the arrays only)."""

    def __init__(self, cg: CompiledGraph):
        t, a, p = cg.arrays["tasks"], cg.arrays["args"], cg.arrays["params"]
        w, s = cg.arrays["waits"], cg.arrays["signals"]
        c = TASK_COLS
        self.kind = [BY_OPCODE[int(x)] for x in t[:, c["OPCODE"]]]
        self.args = [[tuple(int(v) for v in a[k]) for k in range(r[c["ARG_BEGIN"]], r[c["ARG_END"]])] for r in t]
        self.params = [p[r[c["PARAM_BEGIN"]]: r[c["PARAM_END"]]].tolist() for r in t]
        self.waits = [[(int(w[k, 0]), int(w[k, 1])) for k in range(r[c["WAIT_BEGIN"]], r[c["WAIT_END"]])] for r in t]
        self.signals = [[(int(s[k, 0]), int(s[k, 1])) for k in range(r[c["SIGNAL_BEGIN"]], r[c["SIGNAL_END"]])] for r in t]
        self.triggers = cg.arrays["events"][:, EVENT_COLS["TRIGGERS"]].tolist()
        off, wt = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
        self.worker_lists = [wt[off[i]: off[i + 1]].tolist() for i in range(len(off) - 1)]


class Interpreter:
    """Runs the compiled programs of all ranks (``programs[r]`` = rank r) on the CPU.

    ``weights[r]`` maps weight buffer names to tensors of the exact shape (``load_rank_weights``).
    """

    def __init__(self, programs: list[CompiledGraph], weights: list[dict[str, torch.Tensor]], seed: int = 0,
                 mode: str = "jit", check_races: bool = True, on_race: str = "raise"):
        if mode not in ("jit", "aot") or on_race not in ("raise", "collect"):
            raise InputError(f"interpreter: expected mode jit|aot and on_race raise|collect, got {mode!r}, {on_race!r}")
        self.cgs, self.world = programs, len(programs)
        if [cg.meta["rank"] for cg in programs] != list(range(self.world)):
            raise InputError(f"interpreter: expected the programs of ranks 0..{self.world - 1} in order")
        self.rng, self.mode, self.check_races, self.on_race = random.Random(seed), mode, check_races, on_race
        self.dec = [_Decoded(cg) for cg in programs]
        self.meta = programs[0].meta
        self.B, self.max_steps = int(self.meta["batch"]), int(self.meta["max_steps"])
        self.bufs = [self._allocate(cg, w) for cg, w in zip(programs, weights)]

    def _allocate(self, cg: CompiledGraph, weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for b, info in enumerate(cg.meta["buffers"]):
            numel = int(cg.arrays["buffers"][b, 2])
            dt = TORCH[info["dtype"]]
            if info["kind"] == "weight":
                w = weights.get(info["name"])
                if w is None or list(w.shape) != info["shape"]:
                    got = None if w is None else list(w.shape)
                    raise InputError(f"weight {info['name']}: expected shape {info['shape']}, got {got}")
                out.append(w.to(dt).contiguous().reshape(-1))
            elif info["kind"] == "const":
                out.append(torch.from_numpy(np.asarray(cg.consts[info["name"]])).to(dt).reshape(-1).clone())
            else:
                out.append(torch.zeros(numel, dtype=dt))
        return out

    def buffer(self, rank: int, name: str) -> torch.Tensor:
        """Rank ``rank``'s buffer ``name`` in its declared shape (a view)."""
        b = next(i for i, x in enumerate(self.meta["buffers"]) if x["name"] == name)
        return self.bufs[rank][b].view(self.meta["buffers"][b]["shape"])

    def reset_state(self) -> None:
        """Zero the persistent state (KV caches) and next_token of every rank."""
        for r in range(self.world):
            for b, info in enumerate(self.meta["buffers"]):
                if info["kind"] in ("state", "output", "activation", "comm", "ticket"):
                    self.bufs[r][b].zero_()

    # -- one launch ------------------------------------------------------------------------------
    def run(self, steps: int, forced: torch.Tensor, start_pos: torch.Tensor, capture: tuple[str, ...] = ("logits",)) -> RunResult:
        """Run ``steps`` decode steps in one launch. ``forced`` [steps, B] (-1 = use the produced token;
        row 0 must be given), ``start_pos`` [B]. Returns tokens, per-step captured outputs, races."""
        forced = torch.as_tensor(forced, dtype=torch.int32).reshape(steps, self.B)
        if not 0 < steps <= self.max_steps:
            raise InputError(f"steps: expected 1..{self.max_steps} per launch, got {steps}")
        if bool((forced[0] < 0).any()):
            raise InputError("forced tokens: expected row 0 (the first input token) to be given, got -1")
        for r in range(self.world):
            f = self.buffer(r, "forced_tokens")
            f.fill_(-1)
            f[:steps] = forced
            self.buffer(r, "start_pos").copy_(torch.as_tensor(start_pos, dtype=torch.int32).reshape(self.B))
        run = _Launch(self, steps, capture)
        run.execute()
        toks = [self.buffer(r, "token_out")[:steps].clone() for r in range(self.world)]
        for r in range(1, self.world):
            if not torch.equal(toks[r], toks[0]):
                raise AssertionError(f"rank {r} chose tokens {toks[r].tolist()}, rank 0 chose {toks[0].tolist()}")
        cap = {n: torch.cat([run.snap[(n, r)] for r in range(self.world)], dim=-1) for n in capture}
        return RunResult(toks[0], cap, run.races, run.executed)


class _Launch:
    """State of one launch: counters, waiting instances, happens-before sets, shadow memory."""

    def __init__(self, it: Interpreter, steps: int, capture: tuple[str, ...], lazy: bool = False):
        self.it, self.steps = it, steps
        R, E = it.world, len(it.dec[0].triggers)
        self.counter = [[0] * E for _ in range(R)]
        self.ev_hb = [[0] * E for _ in range(R)]
        self.waiting: list[list[list]] = [[[] for _ in range(E)] for _ in range(R)]  # heaps (threshold, id, inst)
        self.races: list[Race] = []
        self.executed = 0
        self.labels: list[str] = []
        self.shadow = [{} for _ in range(R)]
        names = [b["name"] for b in it.meta["buffers"]]
        for r in range(R):
            for b, info in enumerate(it.meta["buffers"]):
                if info["kind"] not in UNTRACKED:
                    self.shadow[r][b] = Shadow(f"rank{r}:{info['name']}", it.bufs[r][b].numel())
        self.capture = {names.index(n): n for n in capture}
        self.snap = {(n, r): torch.full((steps, *it.meta["buffers"][b]["shape"]), float("nan"))
                     for b, n in self.capture.items() for r in range(R)}
        self.tickets: dict[tuple[int, int, int], tuple[int, int]] = {}  # (rank, buffer, element) -> (count, hb)
        for r in range(R):  # the host zeroes ticket words before every launch
            for b, info in enumerate(it.meta["buffers"]):
                if info["kind"] == "ticket":
                    it.bufs[r][b].zero_()
        self.insts: list[list] = []  # [rank, task, step, pending, hb]
        self.ran: list[bool] = []  # per instance: executed
        self.ready: list[int] = []
        self.added = 0  # steps whose instances exist (all of them unless lazy: PersistentLaunch.post adds them)
        for _ in range(0 if lazy else steps):
            self.add_step()

    def add_step(self) -> None:
        """Create the instances of the next step (every rank's tasks), in the (step, rank, task) order
        the aot heads index by."""
        s = self.added
        for r in range(self.it.world):
            for t in range(len(self.it.dec[r].kind)):
                self._add_instance(r, t, s)
        self.added += 1
        if hasattr(self, "heads"):  # aot workers parked at the end of the added steps move on
            self.heads = [self._aot_head(w) if h < 0 else h for w, h in enumerate(self.heads)]

    def _add_instance(self, r: int, t: int, s: int) -> None:
        d = self.it.dec[r]
        i = len(self.insts)
        inst = [r, t, s, 0, 0]
        self.insts.append(inst)
        self.ran.append(False)
        for e, off in d.waits[t]:
            th = (s + 1 + off) * d.triggers[e]
            if th > self.counter[r][e]:
                inst[3] += 1
                heapq.heappush(self.waiting[r][e], (th, i))
            elif th > 0:
                inst[4] |= self.ev_hb[r][e]
        if inst[3] == 0:
            self.ready.append(i)

    def label(self, exec_id: int) -> str:
        """Label of an executed instance by its execution id."""
        return self.labels[exec_id]

    def _pick(self) -> int | None:
        if self.it.mode == "jit":
            if not self.ready:
                return None
            k = self.rng_index(len(self.ready))
            self.ready[k], self.ready[-1] = self.ready[-1], self.ready[k]
            return self.ready.pop()
        if not hasattr(self, "heads"):
            self._init_aot()
        live = [w for w, i in enumerate(self.heads) if i >= 0 and self.insts[i][3] == 0]
        if not live:
            return None
        w = live[self.rng_index(len(live))]
        i = self.heads[w]
        self.aot_pos[w] += 1
        self.heads[w] = self._aot_head(w)
        return i

    def rng_index(self, n: int) -> int:
        """A uniformly random index below n (the interpreter's seeded generator)."""
        return self.it.rng.randrange(n)

    def _init_aot(self) -> None:
        """One queue per (rank, worker): its static list, repeated for every step."""
        self.queues = [(r, lst) for r in range(self.it.world) for lst in self.it.dec[r].worker_lists]
        self.aot_pos = [0] * len(self.queues)
        self.heads = [self._aot_head(w) for w in range(len(self.queues))]

    def _aot_head(self, w: int) -> int:
        r, lst = self.queues[w]
        k = self.aot_pos[w]
        if not lst or k >= len(lst) * self.added:
            return -1
        T = len(self.it.dec[0].kind)
        return ((k // len(lst)) * self.it.world + r) * T + lst[k % len(lst)]  # index of (rank, task, step)

    def execute(self) -> None:
        """Run every instance of every step; raises on a race (on_race='raise') or a deadlock."""
        self.run_until(lambda: self.executed >= len(self.insts))

    def run_until(self, done) -> None:
        """Run ready instances until ``done()``; a deadlock (nothing ready before that) raises."""
        while not done():
            i = self._pick()
            if i is None:
                self._deadlock()
            self._run_instance(i)

    def _deadlock(self) -> None:
        for r, t, s, pending, _ in self.insts:
            if pending:
                d = self.it.dec[r]
                for e, off in d.waits[t]:
                    th = (s + 1 + off) * d.triggers[e]
                    if self.counter[r][e] < th:
                        raise DeviceTimeout(
                            f"interpreter: deadlock: rank {r} step {s} {self.it.cgs[r].task_label(t)} waits on event "
                            f"{self.it.meta['events'][e]} (count {self.counter[r][e]}, needs {th})")
        raise DeviceTimeout("interpreter: deadlock: AOT worker heads are not ready")

    def _run_instance(self, i: int) -> None:
        r, t, s, _, hb = self.insts[i]
        self.ran[i] = True
        it, d = self.it, self.it.dec[r]
        kind, args = d.kind[t], d.args[t]
        xid = self.executed
        self.executed += 1
        self.labels.append(f"rank {r} step {s} {it.cgs[r].task_label(t)}")
        bufs = [None if b == NULL_BUFFER else it.bufs[r][b] for b, _, _ in args]
        ctx = TileContext(kind, bufs, [a[1] for a in args], [a[2] for a in args], d.params[t], s, r, it.world,
                          lambda k: [it.bufs[q][args[k][0]] for q in range(it.world)])
        acc = kind.accesses(ctx) if (it.check_races or self.capture) else []
        if it.check_races:
            self._check(r, xid, hb, args, acc)
        kind.run_tile(ctx)
        self._capture(r, s, args, acc)
        mine = hb | (1 << xid)
        tk = kind.ticket(ctx)
        if tk is not None:
            mine = self._take_ticket(r, s, xid, kind, ctx, args, tk, mine)
        for e, tgt in d.signals[t]:
            for q in (range(it.world) if tgt == SIG_ALL_RANKS else (r,)):
                self._signal(q, e, mine)

    def _take_ticket(self, r: int, s: int, xid: int, kind, ctx, args, tk: tuple[str, int], mine: int) -> int:
        """The tile's acquire-release add on its ticket word: it acquires what every earlier adder of the
        group released (their happens-before sets) and releases its own. The add that completes the group
        runs the kind's ``run_last`` (its accesses checked with that acquired set) and resets the word with
        a plain store, which releases nothing. Returns the tile's happens-before set after the add."""
        name, group = tk
        word, off = ctx.buf(name), ctx.off(name)
        key = (r, args[kind.arg_index(name)][0], off)
        count, seen = self.tickets.get(key, (0, 0))
        count, seen = count + 1, seen | mine
        if count > group:
            raise AssertionError(f"ticket {self.it.meta['buffers'][key[1]]['name']}[{off}]: {count} adds for a group of {group}")
        if count < group:
            self.tickets[key] = (count, seen)
            word[off] = count
            return seen
        acc = kind.last_accesses(ctx)
        if self.it.check_races:
            self._check(r, xid, seen, args, acc)
        kind.run_last(ctx)
        self._capture(r, s, args, acc)
        self.tickets[key] = (0, 0)
        word[off] = 0
        return seen

    def _check(self, r: int, xid: int, hb: int, args, acc) -> None:
        for a in acc:
            b = args[a.arg][0]
            for q in (range(self.it.world) if a.remote else (r,)):
                sh = self.shadow[q].get(b)
                if sh is None:
                    continue
                fn = {"w": sh.check_write, "a": sh.check_accumulate}.get(a.mode, sh.check_read)
                race = fn(xid, hb, np.asarray(a.index, np.int64), self.label)
                if race is not None:
                    if self.it.on_race == "raise":
                        raise RaceError(race)
                    self.races.append(race)

    def _capture(self, r: int, s: int, args, acc) -> None:
        for a in acc:
            b = args[a.arg][0]
            if a.mode in ("w", "a") and b in self.capture:
                snap = self.snap[(self.capture[b], r)][s].view(-1)
                idx = torch.from_numpy(np.asarray(a.index, np.int64))
                snap[idx] = self.it.bufs[r][b][idx].float()

    def _signal(self, q: int, e: int, hb: int) -> None:
        self.counter[q][e] += 1
        self.ev_hb[q][e] |= hb
        c, heap = self.counter[q][e], self.waiting[q][e]
        while heap and heap[0][0] <= c:
            _, i = heapq.heappop(heap)
            inst = self.insts[i]
            inst[4] |= self.ev_hb[q][e]
            inst[3] -= 1
            if inst[3] == 0:
                self.ready.append(i)


class PersistentLaunch:
    """One launch that runs up to ``steps`` steps, each posted by the host while the launch runs: the
    interpreter's model of the persistent paged kernel (docs/SERVING.md "Persistent passes").

    ``post(s, write)`` is the host's doorbell for step s: ``write(rank)`` lays the step's inputs into
    that rank's input buffers, then the step's instances exist (on the GPU: step_begin(s) waits for
    the doorbell, so nothing of step s reads them earlier). ``wait_final(s)`` runs instances until the
    final task (argmax_select) of step s has run on every rank: what the host sees through the step
    epilogue's progress counter. The rest of step s may still be pending then, as on the GPU, so
    ``post`` first checks that no pending instance of an earlier step reads one of ``inputs`` (the
    host would overwrite what it reads): such a task must come before the final task in the graph.
    """

    def __init__(self, it: Interpreter, steps: int, inputs: tuple[str, ...]):
        if not 0 < steps <= it.max_steps:
            raise InputError(f"persistent launch: expected 1..{it.max_steps} steps (the program's max_steps), "
                             f"got {steps}")
        self.it, self.steps = it, steps
        self.run = _Launch(it, steps, (), lazy=True)
        names = [b["name"] for b in it.meta["buffers"]]
        missing = [n for n in inputs if n not in names]
        if missing:
            raise InputError(f"persistent launch: expected input buffers {list(inputs)}, got none named {missing}")
        self.inputs = {names.index(n): n for n in inputs}
        # per rank: the tasks whose arguments include a host-written input (conservative read set)
        self.readers = [{t for t in range(len(d.kind)) if any(b in self.inputs for b, _, _ in d.args[t])}
                        for d in it.dec]
        self.final = [int(np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]]
                                     == _opcode("argmax_select"))[0][0]) for cg in it.cgs]

    @property
    def posted(self) -> int:
        """Steps posted so far."""
        return self.run.added

    def post(self, s: int, write) -> None:
        """The host's doorbell for step ``s`` (the next one): check, write the inputs, add the step."""
        if s != self.run.added or s >= self.steps:
            raise InputError(f"persistent launch: expected step {self.run.added} next (of {self.steps}), got {s}")
        for i, (r, t, step, _, _) in enumerate(self.run.insts):
            if not self.run.ran[i] and t in self.readers[r]:
                names = [self.inputs[b] for b, _, _ in self.it.dec[r].args[t] if b in self.inputs]
                raise AssertionError(
                    f"persistent launch: step {s}'s host inputs would overwrite {names} while rank {r} step {step} "
                    f"{self.it.cgs[r].task_label(t)} has not read them yet (it is not an ancestor of the final task)")
        for r in range(self.it.world):
            write(r)
        self.run.add_step()

    def wait_final(self, s: int) -> None:
        """Run until every rank's final task of step ``s`` has run (DeviceTimeout on a deadlock)."""
        if s >= self.run.added:
            raise InputError(f"persistent launch: step {s} was not posted (posted {self.run.added})")
        T = len(self.it.dec[0].kind)
        idx = [(s * self.it.world + r) * T + self.final[r] for r in range(self.it.world)]
        self.run.run_until(lambda: all(self.run.ran[i] for i in idx))

    def finish(self) -> None:
        """Run whatever of the posted steps is still pending (the launch ends after its last pass)."""
        self.run.execute()

    @property
    def races(self) -> list[Race]:
        """Races found so far (on_race='collect')."""
        return self.run.races


def _opcode(kind: str) -> int:
    from mpk_dist.taskgraph.tasks import BY_NAME

    return BY_NAME[kind].opcode
