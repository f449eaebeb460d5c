"""The device page allocator (task kind page_alloc: mpk_dist/taskgraph/tasks/page_alloc.py, the body
csrc/tasks/page_alloc.cuh) on the CPU: it hands out exactly the page ids of the host ``PagePool`` driven
in slot order over a random churn of admits, growth and releases (slot reuse in one pass included);
an empty stack, a slot released twice, a page owned by another slot and a position past the page-table
row are clear errors that leave the state as it was; in the compiled program it runs once per step
right after step_begin and dropping its wait is caught; and the constants the CUDA side repeats
(fault codes, shared-memory layout, dispatch case) agree with the Python side."""

from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from mpk_dist.serving.pages import PagePool
from mpk_dist.taskgraph.tasks import BY_NAME
from mpk_dist.taskgraph.tasks.base import TileContext
from mpk_dist.taskgraph.tasks.page_alloc import (FAULT_EMPTY, FAULT_RELEASE, FAULT_TOO_LONG, HEADER_WORDS,
                                                 STATE_BUFFERS, PageAllocError, initial_state, smem_words)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
KIND = BY_NAME["page_alloc"]
ARG_OF = dict(zip(STATE_BUFFERS, ("FREE_PAGES", "NUM_FREE", "PAGE_TABLE", "PAGES_USED", "OWNER")))


class Device:
    """The allocator's state buffers (flat int32 tensors, as the interpreter holds them) and one tile."""

    def __init__(self, num_pages: int, max_seqs: int, max_pages: int, page_size: int, batch: int):
        self.np_, self.mb, self.mp, self.p, self.b = num_pages, max_seqs, max_pages, page_size, batch
        self.state = {k: torch.from_numpy(v.reshape(-1).copy())
                      for k, v in initial_state(num_pages, max_seqs, max_pages).items()}

    def run(self, release, slots, positions) -> None:
        """One pass: ``release`` [MB] flags, tokens' ``slots`` / ``positions`` (padded to BATCH with -1 / 0)."""
        def i32(a, n, fill):
            out = torch.full((n,), fill, dtype=torch.int32)
            out[: len(a)] = torch.as_tensor(np.asarray(a, np.int32))
            return out

        named = {"RELEASE": i32(release, self.mb, 0), "POSITIONS": i32(positions, self.b, 0),
                 "SLOTS": i32(slots, self.b, -1), **{ARG_OF[k]: v for k, v in self.state.items()}}
        bufs = [named[a.name] for a in KIND.args]
        params = KIND.pack_params({"BATCH": self.b, "MAX_SEQS": self.mb, "MAX_PAGES": self.mp,
                                   "NUM_PAGES": self.np_, "PAGE_SIZE": self.p})
        ctx = TileContext(KIND, bufs, [0] * len(bufs), [len(b) for b in bufs], params, 0, 0, 1, lambda i: [bufs[i]])
        KIND.run_tile(ctx)

    def arrays(self) -> dict[str, np.ndarray]:
        """The state as numpy arrays in PagePool's shapes."""
        a = {k: v.numpy().copy() for k, v in self.state.items()}
        a["page_table"] = a["page_table"].reshape(self.mb, self.mp)
        return a


def _same_as_pool(dev: Device, pool: PagePool) -> None:
    a = dev.arrays()
    assert np.array_equal(a["free_pages"], pool.free_pages), "free stack (stale entries above the top included)"
    assert int(a["num_free"][0]) == pool.num_free
    assert np.array_equal(a["page_table"], pool.page_table)
    assert np.array_equal(a["pages_used"], pool.pages_used)
    assert np.array_equal(a["page_owner"], pool.owner)


def test_same_page_ids_as_the_host_pool_under_random_churn():
    """300 passes: finished slots released (sometimes re-admitted into the same slot in the same pass),
    new slots admitted, running ones growing by 1..6 positions (page boundaries crossed, several pages at
    once); after every pass the device state equals the PagePool driven in slot order, array for array."""
    rng = random.Random(3)
    NP, MB, MP, P, N = 24, 6, 5, 3, 32
    pool, dev = PagePool(NP, P, MB, MP), Device(NP, MB, MP, P, N)
    length: dict[int, int] = {}
    reused = crossed = 0
    for _ in range(300):
        done = sorted(s for s in length if rng.random() < 0.2)
        for s in done:  # slot order, as Scheduler._retire
            pool.release_slot(s)
            del length[s]
        while pool.num_free_slots and rng.random() < 0.5:
            s = pool.acquire_slot()
            reused += s in done
            length[s] = 0
        grow: dict[int, int] = {}
        budget = pool.num_free  # what the scheduler's reservation guarantees: every grow fits
        for s in sorted(length):
            want = min(length[s] + rng.randint(0, 6), pool.max_len)
            extra = pool.pages_for(want) - int(pool.pages_used[s])
            if want > length[s] and extra <= budget:
                grow[s] = want
                budget -= max(0, extra)
        toks = [(s, p) for s, n in grow.items() for p in range(length[s], n)]
        rng.shuffle(toks)  # token order in a pass does not matter: each slot's highest position does
        toks = toks[:N - len(grow)] + [(s, n - 1) for s, n in grow.items()]  # the last position always in
        for s in sorted(grow):  # slot order, as Scheduler.plan
            crossed += pool.pages_for(grow[s]) > pool.pages_used[s]
            pool.grow(s, grow[s])
            length[s] = grow[s]
        dev.run(pool.take_releases(), [s for s, _ in toks], [p for _, p in toks])
        _same_as_pool(dev, pool)
        pool.check()
    assert reused > 5 and crossed > 100, "the churn re-admits freed slots and crosses page boundaries"


def test_empty_stack_is_a_clear_error_and_leaves_the_state():
    dev = Device(num_pages=4, max_seqs=3, max_pages=4, page_size=2, batch=8)
    dev.run([0, 0, 0], [0, 0, 0], [0, 1, 2])  # slot 0: 2 pages
    before = dev.arrays()
    with pytest.raises(PageAllocError, match=r"expected 3 free pages for slot 1, got 2 on the free stack"):
        dev.run([0, 0, 0], [1], [5])  # slot 1 needs 3 pages, 2 are free
    after = dev.arrays()
    assert all(np.array_equal(before[k], after[k]) for k in STATE_BUFFERS), "a fault writes nothing"


def test_a_release_frees_before_the_same_pass_allocates():
    """Slot 0 finishes and slot 1 takes its pages in the same pass (the stack is empty before)."""
    dev = Device(num_pages=2, max_seqs=2, max_pages=2, page_size=2, batch=4)
    dev.run([0, 0], [0], [3])
    dev.run([1, 0], [1], [2])
    a = dev.arrays()
    assert a["page_table"].tolist() == [[-1, -1], [1, 0]] and a["pages_used"].tolist() == [0, 2]
    assert int(a["num_free"][0]) == 0 and a["page_owner"].tolist() == [1, 1]


def test_double_release_is_caught():
    dev = Device(num_pages=6, max_seqs=2, max_pages=3, page_size=2, batch=4)
    dev.run([0, 0], [0, 1], [0, 2])
    dev.run([1, 0], [], [])  # slot 0's request finished: its pages go back
    with pytest.raises(PageAllocError, match=r"released slot 0 to own its pages, got it holds no pages: a page "
                                             r"released twice"):
        dev.run([1, 0], [], [])  # the same release again


def test_a_page_owned_by_another_slot_is_caught():
    dev = Device(num_pages=6, max_seqs=2, max_pages=3, page_size=2, batch=4)
    dev.run([0, 0], [0, 1], [0, 0])
    dev.state["page_table"].view(2, 3)[1, 0] = int(dev.state["page_table"][0])  # slot 1's table names slot 0's page
    with pytest.raises(PageAllocError, match=r"released slot 1 to own its pages, got its page 0 is owned by slot 0"):
        dev.run([0, 1], [], [])


def test_a_position_past_the_page_table_row_is_caught():
    dev = Device(num_pages=16, max_seqs=2, max_pages=3, page_size=2, batch=4)
    with pytest.raises(PageAllocError, match=r"expected at most 3 pages \(the page-table row\) for slot 1, got a "
                                             r"position needing 4"):
        dev.run([0, 0], [1], [6])


# ---- in the compiled program --------------------------------------------------------------------------
def _program():
    import dataclasses

    from mpk_dist.models.llama import PagedSpec
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.paged_compiler import compile_paged_programs

    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    spec = PagedSpec(max_tokens=6, max_seqs=2, num_pages=8, page_size=2, max_pages_per_seq=4)
    return cfg, spec, compile_paged_programs(cfg, spec, 1, sms=4)[0]


def test_one_task_right_after_step_begin_before_the_page_table_readers():
    from mpk_dist.taskgraph.abi import TASK_COLS, WAIT_COLS

    _, spec, cg = _program()
    tasks, waits = cg.arrays["tasks"], cg.arrays["waits"]
    ops = tasks[:, TASK_COLS["OPCODE"]]
    (t,) = np.nonzero(ops == KIND.opcode)[0]
    assert t == 1 and ops[0] == BY_NAME["step_begin"].opcode, "the second task of the step"
    kinds = {b["name"]: b["kind"] for b in cg.meta["buffers"]}
    assert {kinds[n] for n in STATE_BUFFERS} == {"state"} and kinds["release_slots"] == "input"
    ev = {int(w) for w in waits[tasks[t, TASK_COLS["WAIT_BEGIN"]]:tasks[t, TASK_COLS["WAIT_END"]], WAIT_COLS["EVENT"]]}
    assert len(ev) == 1 and "step_begin" in cg.meta["events"][ev.pop()], "it waits on step_begin (positions) only"
    shapes = {b["name"]: b["shape"] for b in cg.meta["buffers"]}
    assert shapes["page_table"] == [spec.max_seqs, spec.max_pages_per_seq] and shapes["free_pages"] == [spec.num_pages]


def test_dropping_its_wait_on_step_begin_is_caught():
    from mpk_dist.errors import DeviceTimeout
    from mpk_dist.models.llama import build_paged_graph
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.interpreter import Interpreter
    from mpk_dist.taskgraph.paged_compiler import page_state
    from mpk_dist.taskgraph.race import RaceError
    from mpk_dist.taskgraph.testing import drop_wait
    from mpk_dist.weights import SyntheticSource, load_rank_weights

    cfg, spec, cg = _program()
    (t,) = np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]] == KIND.opcode)[0]
    w = [load_rank_weights(build_paged_graph(cfg, spec, tp=1, rank=0), SyntheticSource(cfg, seed=1))]
    it = Interpreter([drop_wait(cg, int(cg.arrays["tasks"][t, TASK_COLS["WAIT_BEGIN"]]))], w, seed=4)
    it.reset_state()
    for name, a in page_state(cg).items():
        it.buffer(0, name).copy_(torch.from_numpy(a))
    it.buffer(0, "seq_slots").copy_(torch.tensor([0, 0, 1, -1, -1, -1], dtype=torch.int32))
    it.buffer(0, "logit_rows").copy_(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises((RaceError, DeviceTimeout)):
        it.run(1, torch.tensor([[3, 4, 5, 0, 0, 0]]), torch.tensor([0, 1, 0, 0, 0, 0]))


# ---- what the CUDA side repeats --------------------------------------------------------------------------
def test_cuda_constants_match_the_python_side():
    from mpk_dist.runtime.params import ERROR_CODES

    watchdog = (CSRC / "runtime" / "watchdog.cuh").read_text()
    for name, code in (("kErrPagesExhausted", FAULT_EMPTY), ("kErrPageRelease", FAULT_RELEASE),
                       ("kErrPageTableFull", FAULT_TOO_LONG)):
        m = re.search(rf"{name} = (\d+),", watchdog)
        assert m and int(m.group(1)) == code, name
        assert code in ERROR_CODES, f"{name} has a host name"
    body = (CSRC / "tasks" / "page_alloc.cuh").read_text()
    assert f"constexpr int kPageHeaderWords = {HEADER_WORDS};" in body
    assert "return kPageHeaderWords + 4 * MB + 2 * B;" in body
    assert smem_words(10, 3) == HEADER_WORDS + 4 * 3 + 2 * 10
    dispatch = (CSRC / "runtime" / "dispatch.cuh").read_text()
    assert "case OP_PAGE_ALLOC: return run_page_alloc(" in dispatch and '#include "page_alloc.cuh"' in dispatch


def test_shared_memory_of_the_paged_program_covers_page_alloc():
    from mpk_dist.runtime import tables

    _, spec, cg = _program()
    need = 4 * smem_words(spec.max_tokens, spec.max_seqs)
    assert tables.page_alloc_bytes(cg) == need and tables.smem_bytes(cg, 128) >= need
