"""Lowering: one rank's decode-step op graph -> task-ops (tiles with arguments, parameters, footprints).

Tiles are sized from the SM count: column-tiled ops (linear, embedding, add, all-reduce, silu_mul)
split their N columns into blocks of a multiple of ``ALIGN`` so there are about ``sms`` tiles; the
gate|up projection is tiled on the intermediate boundary so silu_mul tile j needs gate tile j and
up tile j only. Every op over the hidden size uses the same column blocks, so O-projection tile t
feeds all-reduce tile t directly. Linear-kind ops over B > ``ROW_BLOCK`` rows are tiled over
(column block, row block of ``ROW_BLOCK`` rows) (``Lowerer.linear_grid``; docs/TASKGRAPH.md, "Row
blocks"). See docs/TASKGRAPH.md.
"""

from __future__ import annotations

import numpy as np

from mpk_dist.backends import torch_ops as T
from mpk_dist.graph import Graph, Op
from mpk_dist.taskgraph.program import EMPTY, Footprint, Program, TaskOp
from mpk_dist.taskgraph.tasks import BY_NAME as K

ALIGN = 16
"""Column tiles of non-linear ops (all-reduce, argmax, norms) are multiples of this many features."""

LINEAR_ALIGN = 8
"""Linear tiles are multiples of this many weight rows: one MMA unit (linear_mma.cuh works in units of
8 rows) and enough tiles for every SM on narrow outputs (qwen3-0.6b's N = 1024 over 132 SMs makes 128
tiles of 8 rows; multiples of 16 made only 64, leaving half the SMs idle on o_proj and down_proj)."""

ROW_BLOCK = 16
"""Rows of one linear-kind tile (linear, norm_linear, linear_residual, silu_linear) at most: the CUDA
bodies keep one accumulator per row in registers (``acc[MPK_BATCH]``, csrc/tasks/linear.cuh,
fused_gemv.cuh), so a linear over B > ROW_BLOCK rows is lowered to tiles of ROW_BLOCK rows each
(the last block shorter when B is not a multiple; the mega-kernel refuses that, the interpreter runs
it) and the kernel is generated for min(B, ROW_BLOCK) rows (``mpk_dist.runtime.tables.kernel_batch``)."""

PAGED_HOST_INPUTS = ("seq_slots", "logit_rows")
"""Inputs of paged graphs that stay host-written ``input`` buffers (not written by step_begin)."""

PAGED_DEVICE_STATE = ("page_table",)
"""Inputs of paged graphs that the programs keep in ``state`` buffers: the page table is written by the
page_alloc task (``lowering_pages``), not by the host."""


def col_tiles(n: int, sms: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """Split n columns into about ``sms`` blocks of a multiple of ``align``: [(c0, cols), ...]."""
    per = -(-n // max(1, sms))
    per = max(align, -(-per // align) * align)
    return [(c0, min(per, n - c0)) for c0 in range(0, n, per)]


def row_blocks(rows: int, block: int = ROW_BLOCK) -> list[tuple[int, int]]:
    """Split ``rows`` rows into blocks of ``block``: [(r0, nrows), ...] (one block when rows <= block)."""
    return [(r0, min(block, rows - r0)) for r0 in range(0, rows, block)]


def _grid_fp(buf: int, grid: list[tuple[int, int, int, int]], shift: int = 0, row_shift: int = 0,
             remote: bool = False) -> Footprint:
    """Rectangles rows [r0, r0 + nrows) x columns [c0, c0 + n) (+ shifts) of (r0, nrows, c0, n) tiles."""
    return Footprint(buf, np.array([(row_shift + r0, row_shift + r0 + nr, shift + c0, shift + c0 + n)
                                    for r0, nr, c0, n in grid], np.int64).reshape(-1, 4), remote)


def _rows_fp(buf: int, grid: list[tuple[int, int, int, int]], cols: int) -> Footprint:
    """All ``cols`` columns of each tile's rows (a linear tile's input: its row block, whole K)."""
    return Footprint(buf, np.array([(r0, r0 + nr, 0, cols) for r0, nr, _, _ in grid], np.int64).reshape(-1, 4))


def _cols_fp(buf: int, tiles: list[tuple[int, int]], rows: int, shift: int = 0, remote: bool = False) -> Footprint:
    return Footprint(buf, np.array([(0, rows, shift + c0, shift + c0 + n) for c0, n in tiles], np.int64).reshape(-1, 4),
                     remote)


def _all_fp(buf: int, prog: Program, tiles: int, remote: bool = False) -> Footprint:
    r, c = prog.buffers[buf].view
    return Footprint(buf, np.tile(np.array([[0, r, 0, c]], np.int64), (tiles, 1)), remote)


class Lowerer:
    """Lowers the ops of one graph into a ``Program``."""

    def __init__(self, graph: Graph, sms: int, max_steps: int):
        self.g, self.sms = graph, sms
        self.B, self.W, self.rank = graph.batch, graph.world_size, graph.rank
        self.p = Program(graph.rank, graph.world_size, graph.batch, max_steps)
        self.consumers: dict[str, list[Op]] = {}
        for op in graph.ops:
            for t in op.inputs:
                self.consumers.setdefault(t, []).append(op)

    # -- buffers ---------------------------------------------------------------------------------
    def declare_buffers(self, skip: set[str] | frozenset[str] = frozenset()) -> None:
        """One buffer per graph tensor (except ``skip``: activations fused away) plus the step-loop buffers."""
        gathered = {op.outputs[0] for op in self.g.ops if op.kind == "all_gather"}
        for t in self.g.tensors.values():
            if t.name in skip:
                continue
            kind = {"input": "activation"}.get(t.kind, t.kind)  # tokens/positions: written by step_begin
            if t.name in PAGED_HOST_INPUTS:
                kind = "input"  # paged graphs: the host writes the slot map and logit rows before a launch
            if t.name in PAGED_DEVICE_STATE:
                kind = "state"  # paged graphs: page_alloc keeps the page table on the device
            if t.name in gathered:
                kind = "comm"
            view = None
            if t.name == "next_token" and t.shape[0] < self.B:
                # NOTE: gathered head (paged graphs): argmax_select writes MB rows, step_begin reads N
                # (its forced tokens always win in a one-step-per-launch pass); padded to N rows so
                # both stay in bounds.
                self.p.buffer(t.name, (self.B,), t.dtype, kind)
                continue
            if t.kind == "state":  # KV cache [B, S, Hkv, D]: rows = (b, pos), cols = (head, d)
                view = (t.shape[0] * t.shape[1], int(np.prod(t.shape[2:])))
            self.p.buffer(t.name, t.shape, t.dtype, kind, view)
        S, R = self.p.max_steps, self.head_rows()
        for name, shape, kind in (("forced_tokens", (S, self.B), "input"), ("start_pos", (self.B,), "input"),
                                  ("token_out", (S, R), "output")):
            self.p.buffer(name, shape, "i32", kind)
        self.p.special = {n: self.p.id(n) for n in ("forced_tokens", "start_pos", "tokens", "positions",
                                                    "next_token", "token_out", "logits")}

    def head_rows(self) -> int:
        """Rows of the head (next_token): B, or MB when the graph gathers each sequence's last row."""
        t = self.g.tensors.get("next_token")
        return self.B if t is None else int(t.shape[0])

    def _new(self, op: Op, kind: str, suffix: str = "") -> TaskOp:
        return self.p.op(op.name + suffix, K[kind], op.layer, op.name)

    # -- ops ---------------------------------------------------------------------------------------
    def step_begin(self) -> None:
        """The first task of a step (not a graph op)."""
        p, B = self.p, self.B
        t = p.op("step_begin", K["step_begin"], None, "")
        ids = {n: p.id(n) for n in ("forced_tokens", "start_pos", "next_token", "tokens", "positions")}
        t.add_tile({"FORCED": (ids["forced_tokens"], 0, p.max_steps * B), "START_POS": (ids["start_pos"], 0, B),
                    "NEXT_TOKEN": (ids["next_token"], 0, B), "TOKENS": (ids["tokens"], 0, B),
                    "POSITIONS": (ids["positions"], 0, B)}, {"BATCH": B, "MAX_STEPS": p.max_steps})
        t.reads = [_all_fp(ids["next_token"], p, 1)]
        t.writes = [_all_fp(ids["tokens"], p, 1), _all_fp(ids["positions"], p, 1)]

    def embedding(self, op: Op) -> None:
        """Hidden-column tiles of the embedding rows."""
        p, B = self.p, self.B
        tok, tbl, out = p.id(op.inputs[0]), p.id(op.inputs[1]), p.id(op.outputs[0])
        V, H = self.g.tensors[op.inputs[1]].shape
        tiles = col_tiles(H, self.sms)
        t = self._new(op, "embedding")
        for c0, n in tiles:
            t.add_tile({"TOKENS": (tok, 0, B), "TABLE": (tbl, c0, (V - 1) * H + n), "OUT": (out, c0, (B - 1) * H + n)},
                       {"BATCH": B, "COLS": n, "TABLE_STRIDE": H, "OUT_STRIDE": H,
                        "VOCAB_START": op.attrs["vocab_start"], "VOCAB_ROWS": V})
        t.reads = [_all_fp(tok, p, len(tiles))]
        t.writes = [_cols_fp(out, tiles, B)]

    def rms_norm(self, op: Op) -> None:
        """One tile per sequence."""
        p, B = self.p, self.B
        x, w, y = p.id(op.inputs[0]), p.id(op.inputs[1]), p.id(op.outputs[0])
        N = self.g.tensors[op.inputs[0]].shape[-1]
        t = self._new(op, "rms_norm")
        for b in range(B):
            t.add_tile({"X": (x, b * N, N), "W": (w, 0, N), "Y": (y, b * N, N)}, {"N": N, "EPS": op.attrs["eps"]})
        rows = np.array([(b, b + 1, 0, N) for b in range(B)], np.int64)
        t.reads, t.writes = [Footprint(x, rows)], [Footprint(y, rows.copy())]

    def linear_cols(self, N: int, halves: bool = False) -> list[tuple[int, int]]:
        """Column blocks of a linear-kind op with N outputs (``halves``: the gate|up projection, tiled on
        the intermediate boundary). Over several row blocks each gets ``sms / blocks`` column tiles.

        NOTE (trade-off, not measured): with R row blocks every weight block is read R times (once
        per row block; the R tiles of one column block run next to each other, so the later reads
        may hit L2) and each tile keeps >= LINEAR_ALIGN weight rows; keeping ~one wave of tiles over
        all blocks (rather than ``sms`` column tiles per block) bounds the task and event counts. The
        re-reads are the price of GEMV tiles until tensor-core prefill tiles (M rows x N features)
        exist."""
        share = max(1, self.sms // len(row_blocks(self.B)))
        if halves:
            half = col_tiles(N // 2, max(1, share // 2), LINEAR_ALIGN)
            return half + [(N // 2 + c0, n) for c0, n in half]
        return col_tiles(N, share, LINEAR_ALIGN)

    def _linear_tiles(self, op: Op, N: int) -> list[tuple[int, int]]:
        return self.linear_cols(N, any(c.kind == "silu_mul" for c in self.consumers.get(op.outputs[0], [])))

    def linear_grid(self, cols: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
        """Tiles (r0, nrows, n0, n) of a linear-kind op: each column block, then its row blocks (the
        tiles sharing a weight block sit next to each other, i.e. on neighbouring workers at once)."""
        return [(r0, nr, n0, n) for n0, n in cols for r0, nr in row_blocks(self.B)]

    def linear(self, op: Op) -> None:
        """Blocks of output features x row blocks of <= ROW_BLOCK rows (one block when B <= 16)."""
        p = self.p
        x, w, y = p.id(op.inputs[0]), p.id(op.inputs[1]), p.id(op.outputs[0])
        N, K_ = self.g.tensors[op.inputs[1]].shape
        grid = self.linear_grid(self._linear_tiles(op, N))
        t = self._new(op, "linear")
        for r0, nr, n0, n in grid:
            t.add_tile({"X": (x, r0 * K_, nr * K_), "W": (w, n0 * K_, n * K_), "Y": (y, r0 * N + n0, (nr - 1) * N + n)},
                       {"BATCH": nr, "K": K_, "N_TILE": n, "X_STRIDE": K_, "Y_STRIDE": N})
        t.reads = [_rows_fp(x, grid, K_)]
        t.writes = [_grid_fp(y, grid)]

    def _inv_freq(self, attrs: dict) -> int:
        name = "rope_inv_freq"
        data = T.rope_attrs_inv_freq(attrs).numpy().astype(np.float32)
        if name in self.p.by_name:
            if not np.array_equal(self.p.by_name[name].data, data):
                raise ValueError("qkv_prep: layers with different rope parameters are not supported")
            return self.p.id(name)
        return self.p.buffer(name, data.shape, "f32", "const", data=data)

    def qkv_prep(self, op: Op) -> None:
        """One tile per q head, then one per kv head (which also appends to the KV cache)."""
        p, B, a = self.p, self.B, op.attrs
        hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
        qkv, pos = p.id(op.inputs[0]), p.id(op.inputs[1])
        qn, kn = (p.id(op.inputs[2]), p.id(op.inputs[3])) if a.get("qk_norm") else (None, None)
        q, kc, vc = (p.id(n) for n in op.outputs)
        S, QS = self.g.max_seq_len, (hq + 2 * hkv) * D
        inv = self._inv_freq(a)
        t = self._new(op, "qkv_prep")
        common = {"BATCH": B, "HEAD_DIM": D, "QKV_STRIDE": QS, "EPS": a["eps"]}
        for h in range(hq):
            t.add_tile({"QKV": (qkv, h * D, (B - 1) * QS + D), "POSITIONS": (pos, 0, B),
                        "NORM_W": None if qn is None else (qn, 0, D), "INV_FREQ": (inv, 0, D // 2),
                        "DST": (q, h * D, (B - 1) * hq * D + D), "DST_V": None},
                       {**common, "V_OFFSET": 0, "DST_BATCH_STRIDE": hq * D, "DST_POS_STRIDE": 0, "MAX_SEQ": 1, "IS_KV": 0})
        cache_count = (B - 1) * S * hkv * D + (S - 1) * hkv * D + D
        for j in range(hkv):
            t.add_tile({"QKV": (qkv, (hq + j) * D, (B - 1) * QS + hkv * D + D), "POSITIONS": (pos, 0, B),
                        "NORM_W": None if kn is None else (kn, 0, D), "INV_FREQ": (inv, 0, D // 2),
                        "DST": (kc, j * D, cache_count), "DST_V": (vc, j * D, cache_count)},
                       {**common, "V_OFFSET": hkv * D, "DST_BATCH_STRIDE": S * hkv * D, "DST_POS_STRIDE": hkv * D,
                        "MAX_SEQ": S, "IS_KV": 1})
        head = lambda c0: (0, B, c0, c0 + D)  # noqa: E731 - one head's columns of a [B, *] tensor
        kvrow = lambda j: (0, B * S, j * D, j * D + D)  # noqa: E731 - head j of every cache row
        t.reads = [Footprint(qkv, np.array([head(h * D) for h in range(hq)] + [head((hq + j) * D) for j in range(hkv)])),
                   Footprint(qkv, np.array([EMPTY] * hq + [head((hq + hkv + j) * D) for j in range(hkv)])),
                   _all_fp(pos, p, hq + hkv)]
        t.writes = [Footprint(q, np.array([head(h * D) for h in range(hq)] + [EMPTY] * hkv)),
                    Footprint(kc, np.array([EMPTY] * hq + [kvrow(j) for j in range(hkv)])),
                    Footprint(vc, np.array([EMPTY] * hq + [kvrow(j) for j in range(hkv)]))]

    def attention(self, op: Op) -> None:
        """One tile per (kv head, sequence): its GROUP query heads over that sequence's cache. A tile per
        kv head over all B sequences ran them one after another on 8 SMs (qwen3-8b batch 8); per
        sequence they spread over kv_heads x B SMs with the same arithmetic per sequence."""
        p, B, a = self.p, self.B, op.attrs
        hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
        q, kc, vc, pos = (p.id(n) for n in op.inputs)
        o = p.id(op.outputs[0])
        S, G = self.g.max_seq_len, hq // hkv
        cache_count = (S - 1) * hkv * D + D
        t = self._new(op, "attention")
        pairs = [(j, b) for j in range(hkv) for b in range(B)]
        for j, b in pairs:
            qa = (b * hq * D + j * G * D, G * D)
            kva = (b * S * hkv * D + j * D, cache_count)
            t.add_tile({"Q": (q, *qa), "K_CACHE": (kc, *kva), "V_CACHE": (vc, *kva), "POSITIONS": (pos, b, 1),
                        "OUT": (o, *qa)},
                       {"BATCH": 1, "HEAD_DIM": D, "GROUP": G, "Q_STRIDE": hq * D, "KV_POS_STRIDE": hkv * D,
                        "KV_BATCH_STRIDE": S * hkv * D, "MAX_SEQ": S, "SCALE": a["scale"]})
        qrect = np.array([(b, b + 1, j * G * D, (j + 1) * G * D) for j, b in pairs], np.int64)
        kvrect = np.array([(b * S, (b + 1) * S, j * D, (j + 1) * D) for j, b in pairs], np.int64)
        t.reads = [Footprint(q, qrect), Footprint(kc, kvrect), Footprint(vc, kvrect.copy()), _all_fp(pos, p, len(pairs))]
        t.writes = [Footprint(o, qrect.copy())]

    def silu_mul(self, op: Op) -> None:
        """Intermediate-column tiles (the same blocks as each half of the gate|up projection)."""
        p, B = self.p, self.B
        gu, out = p.id(op.inputs[0]), p.id(op.outputs[0])
        I = self.g.tensors[op.outputs[0]].shape[-1]
        both = self.linear_cols(2 * I, halves=True)  # the gate|up projection's column blocks
        tiles = both[:len(both) // 2]
        t = self._new(op, "silu_mul")
        for c0, n in tiles:
            t.add_tile({"GU": (gu, c0, (B - 1) * 2 * I + I + n), "OUT": (out, c0, (B - 1) * I + n)},
                       {"BATCH": B, "COLS": n, "GU_STRIDE": 2 * I, "UP_OFFSET": I, "OUT_STRIDE": I})
        t.reads = [_cols_fp(gu, tiles, B), _cols_fp(gu, tiles, B, shift=I)]
        t.writes = [_cols_fp(out, tiles, B)]

    def add(self, op: Op) -> None:
        """Column tiles of a + b (the residual add at tp 1)."""
        p, B = self.p, self.B
        x, y, out = (p.id(n) for n in (*op.inputs, *op.outputs))
        N = self.g.tensors[op.outputs[0]].shape[-1]
        tiles = col_tiles(N, self.sms)
        t = self._new(op, "add")
        for c0, n in tiles:
            ext = (c0, (B - 1) * N + n)
            t.add_tile({"X": (x, *ext), "Y": (y, *ext), "OUT": (out, *ext)}, {"BATCH": B, "COLS": n, "STRIDE": N})
        t.reads = [_cols_fp(x, tiles, B), _cols_fp(y, tiles, B)]
        t.writes = [_cols_fp(out, tiles, B)]

    # -- paged KV cache (opt-in graphs, models.llama.build_paged_graph; docs/SERVING.md) ---------------
    def _page_params(self, pool: str) -> dict:
        NP, P, hkv, D = self.g.tensors[pool].shape
        MB, MP = self.g.tensors["page_table"].shape
        return {"PAGE_SIZE": P, "PAGE_STRIDE": P * hkv * D, "POS_STRIDE": hkv * D, "MAX_PAGES": MP, "NUM_PAGES": NP}

    def qkv_prep_paged(self, op: Op) -> None:
        """As qkv_prep (one tile per q head, then per kv head); kv tiles append to the page pools."""
        p, B, a = self.p, self.B, op.attrs
        hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
        qkv, pos, slots, table = (p.id(n) for n in op.inputs[:4])
        qn, kn = (p.id(op.inputs[4]), p.id(op.inputs[5])) if a.get("qk_norm") else (None, None)
        q, kp, vp = (p.id(n) for n in op.outputs)
        QS, pool_n = (hq + 2 * hkv) * D, p.buffers[kp].numel
        inv, pages = self._inv_freq(a), self._page_params(op.outputs[1])
        MB, MP = self.g.tensors["page_table"].shape
        t = self._new(op, "qkv_prep_paged")
        common = {"BATCH": B, "HEAD_DIM": D, "QKV_STRIDE": QS, "EPS": a["eps"], **pages}
        ins = {"POSITIONS": (pos, 0, B), "SLOTS": (slots, 0, B), "PAGE_TABLE": (table, 0, MB * MP),
               "INV_FREQ": (inv, 0, D // 2)}
        for h in range(hq):
            t.add_tile({**ins, "QKV": (qkv, h * D, (B - 1) * QS + D), "NORM_W": None if qn is None else (qn, 0, D),
                        "DST": (q, h * D, (B - 1) * hq * D + D), "DST_V": None},
                       {**common, "V_OFFSET": 0, "Q_STRIDE": hq * D, "IS_KV": 0})
        for j in range(hkv):
            t.add_tile({**ins, "QKV": (qkv, (hq + j) * D, (B - 1) * QS + hkv * D + D),
                        "NORM_W": None if kn is None else (kn, 0, D),
                        "DST": (kp, j * D, pool_n - j * D), "DST_V": (vp, j * D, pool_n - j * D)},
                       {**common, "V_OFFSET": hkv * D, "Q_STRIDE": 0, "IS_KV": 1})
        rows = p.buffers[kp].view[0]
        head = lambda c0: (0, B, c0, c0 + D)  # noqa: E731 - one head's columns of a [N, *] tensor
        kvcol = lambda j: (0, rows, j * D, j * D + D)  # noqa: E731 - head j of every page row
        whole = p.buffers[table].view
        t.reads = [Footprint(qkv, np.array([head(h * D) for h in range(hq)] + [head((hq + j) * D) for j in range(hkv)])),
                   Footprint(qkv, np.array([EMPTY] * hq + [head((hq + hkv + j) * D) for j in range(hkv)])),
                   _all_fp(pos, p, hq + hkv),
                   # kv tiles read the page table that page_alloc wrote this step (q tiles do not)
                   Footprint(table, np.array([EMPTY] * hq + [(0, whole[0], 0, whole[1])] * hkv, np.int64))]
        t.writes = [Footprint(q, np.array([head(h * D) for h in range(hq)] + [EMPTY] * hkv)),
                    Footprint(kp, np.array([EMPTY] * hq + [kvcol(j) for j in range(hkv)])),
                    Footprint(vp, np.array([EMPTY] * hq + [kvcol(j) for j in range(hkv)]))]

    def paged_attention(self, op: Op) -> None:
        """One tile per (kv head, block of <= ROW_BLOCK tokens): its GROUP query heads, keys read through
        the page table. One warp per token walks its positions, so blocks spread a long prompt chunk
        over more SMs (one block, as before, when N <= ROW_BLOCK)."""
        p, B, a = self.p, self.B, op.attrs
        hq, hkv, D = a["q_heads"], a["kv_heads"], a["head_dim"]
        q, kp, vp, pos, slots, table = (p.id(n) for n in op.inputs)
        o, G, pool_n = p.id(op.outputs[0]), hq // hkv, p.buffers[kp].numel
        MB, MP = self.g.tensors["page_table"].shape
        t = self._new(op, "paged_attention")
        tiles = [(j, r0, nr) for j in range(hkv) for r0, nr in row_blocks(B)]
        for j, r0, nr in tiles:
            qa = (r0 * hq * D + j * G * D, (nr - 1) * hq * D + G * D)
            t.add_tile({"Q": (q, *qa), "K_PAGES": (kp, j * D, pool_n - j * D), "V_PAGES": (vp, j * D, pool_n - j * D),
                        "POSITIONS": (pos, r0, nr), "SLOTS": (slots, r0, nr), "PAGE_TABLE": (table, 0, MB * MP),
                        "OUT": (o, *qa)},
                       {"BATCH": nr, "HEAD_DIM": D, "GROUP": G, "Q_STRIDE": hq * D, "SCALE": a["scale"],
                        **self._page_params(op.inputs[1])})
        rows = p.buffers[kp].view[0]
        qrect = np.array([(r0, r0 + nr, j * G * D, (j + 1) * G * D) for j, r0, nr in tiles], np.int64)
        kvrect = np.array([(0, rows, j * D, (j + 1) * D) for j, _, _ in tiles], np.int64)
        t.reads = [Footprint(q, qrect), Footprint(kp, kvrect), Footprint(vp, kvrect.copy()),
                   _all_fp(pos, p, len(tiles)), _all_fp(table, p, len(tiles))]  # + the table page_alloc wrote
        t.writes = [Footprint(o, qrect.copy())]

    def gather_rows(self, op: Op) -> None:
        """Hidden-column tiles copying the ``logit_rows`` rows of the N-row stream into MB rows.

        NOTE: the ops after this one (the head: final norm, lm_head, argmax, token select) run over
        the gathered rows, so the row count of the lowering becomes MB from here on (graph order is
        topological and gather_rows is the last op over token rows).
        """
        p, N = self.p, self.B
        x, rows, out = p.id(op.inputs[0]), p.id(op.inputs[1]), p.id(op.outputs[0])
        MB, C = self.g.tensors[op.outputs[0]].shape
        tiles = col_tiles(C, self.sms)
        t = self._new(op, "gather_rows")
        for c0, n in tiles:
            t.add_tile({"X": (x, c0, (N - 1) * C + n), "ROWS": (rows, 0, MB), "OUT": (out, c0, (MB - 1) * C + n)},
                       {"BATCH": MB, "COLS": n, "X_STRIDE": C, "OUT_STRIDE": C, "X_ROWS": N})
        # Which rows are read depends on the pass's logit_rows: the tile may read any row of its columns.
        t.reads = [_cols_fp(x, tiles, N), _all_fp(rows, p, len(tiles))]
        t.writes = [_cols_fp(out, tiles, MB)]
        self.B = MB
