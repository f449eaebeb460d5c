"""CPU tests of the idle-worker L2 prefetch plan (mpk_dist/runtime/idle_prefetch.py) and its place in the task
records: the spans sit on the next task of exactly the workers an attention level leaves idle (whose previous
task feeds the attention), cover each chosen linear op's weights once with no gap, stop at the budget and at
whole ops, and land in the record words the kernel reads (csrc/runtime/dispatch.cuh prefetch_spans)."""

from __future__ import annotations

import numpy as np
import pytest

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import task_records as R
from mpk_dist.runtime.idle_prefetch import ATTENTION_KINDS, MAX_SPANS, SPAN_ALIGN, describe, idle_spans
from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env
from mpk_dist.runtime.session import resolve_args
from mpk_dist.runtime.tables import LINEAR_KINDS, weight_block_bytes
from mpk_dist.taskgraph.abi import BUFFER_COLS, DTYPE_BYTES, DTYPES, TASK_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.tasks import BY_NAME

def _program(name: str, sms: int = 132, max_seq_len: int = 576):
    return compile_rank_programs(get_preset(name), tp=1, batch=1, sms=sms, max_seq_len=max_seq_len,
                                 fuse=fusions_for_batch(fusions_from_env(), 1), attn_splits="auto")[0]


def _arg_addr(cg) -> np.ndarray:
    """Argument addresses as a Session resolves them, with each buffer at its own 4 KB-aligned fake base."""
    bufs = cg.arrays["buffers"]
    name_of = {code: name for name, code in DTYPES.items()}
    sizes = [DTYPE_BYTES[name_of[int(row[BUFFER_COLS["DTYPE"]])]] for row in bufs]
    base, addrs = 0x7F00_0000_0000, []
    for row, es in zip(bufs, sizes):
        addrs.append(base)
        base += (int(row[BUFFER_COLS["NUMEL"]]) * es + 4095) // 4096 * 4096 + 4096
    return resolve_args(cg.arrays["args"], addrs, sizes)


def _ops(cg):
    T = cg.arrays["tasks"]
    op_index, opcode = T[:, TASK_COLS["OP_INDEX"]], T[:, TASK_COLS["OPCODE"]]
    return {int(op): int(opcode[np.argmax(op_index == op)]) for op in np.unique(op_index)}


def _op_bytes(cg, op: int) -> int:
    tiles = np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OP_INDEX"]] == op)[0]
    return sum(weight_block_bytes(cg, int(t)) for t in tiles)


@pytest.fixture(scope="module")
def small():
    cg = _program("qwen3-0.6b")
    return cg, _arg_addr(cg)


def test_spans_cover_the_next_linear_ops_once_from_the_idle_workers(small):
    """qwen3-0.6b at 132 SMs: every attention level's idle workers (4) carry shares that together are o_proj,
    gate_up, down and the next layer's qkv (31.5 MB < 42 MB), each op's range covered once with no gap, shares
    at line boundaries, the carriers' previous task a tile of the level before the attention."""
    cg, addr = small
    spans = idle_spans(cg, addr, 42 << 20)
    T = cg.arrays["tasks"]
    op_index, worker = T[:, TASK_COLS["OP_INDEX"]], T[:, TASK_COLS["WORKER"]]
    ops = _ops(cg)
    attn = [op for op, code in ops.items() if code in {BY_NAME[k].opcode for k in ATTENTION_KINDS}]
    linear = {BY_NAME[k].opcode for k in LINEAR_KINDS}
    assert len(attn) == 28
    carriers = np.nonzero((spans[:, :, 1] > 0).any(axis=1))[0]
    assert len(carriers) == 4 * 28, describe(spans)
    offs, lst = cg.arrays["worker_offsets"], cg.arrays["worker_tasks"]
    for a in attn:
        busy = set(worker[op_index == a].tolist())
        mine = [t for t in carriers if op_index[t] > a and (op_index[t] < min([o for o in attn if o > a], default=1 << 30))]
        mine = [t for t in mine if int(worker[t]) not in busy]
        assert len(mine) == 4 and len({int(worker[t]) for t in mine}) == 4
        for t in mine:  # the previous task in its worker's list feeds the attention op (the level before)
            w = int(worker[t])
            order = lst[int(offs[w]):int(offs[w + 1])].tolist()
            prev = order[order.index(int(t)) - 1]
            assert int(op_index[prev]) == a - 1 and ops[a - 1] in linear
        got = sorted((int(s[0]), int(s[1])) for t in mine for s in spans[t] if s[1] > 0)
        assert all(n > 0 and a0 % SPAN_ALIGN == 0 for a0, n in got)
        for (a0, n0), (a1, _) in zip(got, got[1:]):
            assert a0 + n0 <= a1  # no overlap
        want, total = [], 0  # the linear ops after it, whole ones while they fit (the last layer: lm_head does not)
        for op in [op for op in ops if op > a and ops[op] in linear][:4]:
            if total + _op_bytes(cg, op) > 42 << 20:
                break
            want.append(op)
            total += _op_bytes(cg, op)
        assert len(want) == (3 if a == max(attn) else 4)
        assert sum(n for _, n in got) == total


def test_budget_stops_at_whole_ops(small):
    """A budget below o_proj + gate_up covers o_proj alone; below o_proj nothing; 0 is off."""
    cg, addr = small
    ops = _ops(cg)
    a = next(op for op, code in ops.items() if code == BY_NAME["attention_split_prep"].opcode)
    o_bytes, gu_bytes = _op_bytes(cg, a + 1), _op_bytes(cg, a + 2)
    one = idle_spans(cg, addr, o_bytes + gu_bytes - 1)
    assert int(one[:, :, 1].sum()) == 28 * o_bytes
    assert int(idle_spans(cg, addr, o_bytes - 1)[:, :, 1].sum()) == 0
    assert not idle_spans(cg, addr, 0).any()
    with pytest.raises(InputError):
        idle_spans(cg, addr, -1)


def test_the_8b_program_prefetches_o_proj_only():
    """qwen3-8b: o_proj (33.5 MB) fits 42 MB, gate_up (201 MB) does not: one span per carrier, o_proj's bytes."""
    cg = _program("qwen3-8b")
    spans = idle_spans(cg, _arg_addr(cg), 42 << 20)
    ops = _ops(cg)
    a = next(op for op, code in ops.items() if code == BY_NAME["attention_split_prep"].opcode)
    assert int(spans[:, :, 1].sum()) == 36 * _op_bytes(cg, a + 1)
    assert int((spans[:, :, 1] > 0).sum(axis=1).max()) == 1


def test_records_carry_the_spans_where_the_kernel_reads_them(small):
    """The spans' addresses go to argument slots REC_SPAN_ADDR_SLOT.., their bytes to REC_SPAN_BYTES..; every
    other word equals the records without spans; a span on a task with too many arguments is refused."""
    cg, addr = small
    spans = idle_spans(cg, addr, 42 << 20)
    base, task_rec = R.build_records(cg, addr)
    rec, _ = R.build_records(cg, addr, spans=spans)
    T = cg.arrays["tasks"].shape[0]
    for t in np.nonzero((spans[:, :, 1] > 0).any(axis=1))[0][:20]:
        r = rec[task_rec[t]]
        for k in range(MAX_SPANS):
            at = R.REC_ARGS + 2 * (R.REC_SPAN_ADDR_SLOT + k)
            a64 = int(np.array(r[at:at + 2], np.int32).view(np.uint64)[0])
            assert (a64, int(r[R.REC_SPAN_BYTES + k])) == (int(spans[t, k, 0]) if spans[t, k, 1] else a64,
                                                          int(spans[t, k, 1]))
    assert not rec[:, R.REC_SPAN_BYTES:R.REC_SPAN_BYTES + MAX_SPANS][
        ~(spans[:, :, 1] > 0).any(axis=1)[np.argsort(task_rec)]].any()
    changed = rec != base
    cols = set(np.nonzero(changed.any(axis=0))[0].tolist())
    allowed = {R.REC_ARGS + 2 * (R.REC_SPAN_ADDR_SLOT + k) + j for k in range(MAX_SPANS) for j in (0, 1)}
    allowed |= {R.REC_SPAN_BYTES + k for k in range(MAX_SPANS)}
    assert cols and cols <= allowed
    bad = spans.copy()
    many = int(np.argmax(cg.arrays["tasks"][:, TASK_COLS["ARG_END"]] - cg.arrays["tasks"][:, TASK_COLS["ARG_BEGIN"]]
                         > R.REC_SPAN_ADDR_SLOT)) if T else 0
    bad[many, 0] = (0x7F00_0000_0000, 4096)
    with pytest.raises(InputError):
        R.build_records(cg, addr, spans=bad)
