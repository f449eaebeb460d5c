"""CPU tests of the split-KV tiles' cache-row stage (record flag REC_FLAG_STAGE_KV, csrc/tasks/attention_split.cuh
KvStage): the shared memory the host sizes for it matches the kernel's layout (scratch, q, 16-byte aligned, then
BATCH x range x k/v rows), the flag marks exactly the split-KV tiles, the launch grows only when the stage
fits, and MPK_ATTN_STAGE_KV=0 turns it off without touching the binary's inputs."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.runtime import task_records as R
from mpk_dist.runtime.build import CSRC
from mpk_dist.taskgraph.abi import ARG_COLS, TASK_COLS
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.fusion import FUSIONS, OPT_IN_FUSIONS
from mpk_dist.taskgraph.lowering_attention import AUTO_SPLIT_MAX_BATCH, KV_STAGE_KINDS, kv_stage_smem_bytes
from mpk_dist.taskgraph.tasks import BY_NAME

THREADS = 512
# every fusion the flagged words go with ('silu_down' does not): split tiles run the prep and merge
BACKEND_FUSE = [*FUSIONS, *(f for f in OPT_IN_FUSIONS if f != "silu_down")]


def _program(batch: int = 1, fuse=BACKEND_FUSE, max_seq_len: int = 256, attn_splits=None):
    """qwen3-0.6b's split program; ``attn_splits`` None: 'auto', or at batch 4 (which 'auto' leaves unsplit since
    v0.28) the 4 ranges it gave there before."""
    if attn_splits is None:
        attn_splits = "auto" if batch <= AUTO_SPLIT_MAX_BATCH else 4
    return compile_rank_programs(get_preset("qwen3-0.6b"), tp=1, batch=batch, sms=132, max_seq_len=max_seq_len,
                                 fuse=fuse, attn_splits=attn_splits)[0]


def _tiles(cg, kind: str) -> list[dict]:
    k = BY_NAME[kind]
    tasks, params = cg.arrays["tasks"], cg.arrays["params"]
    out = []
    for row in tasks[tasks[:, TASK_COLS["OPCODE"]] == k.opcode]:
        p0 = int(row[TASK_COLS["PARAM_BEGIN"]])
        out.append({n: int(params[p0 + k.param_index(n)]) for n in ("GROUP", "HEAD_DIM", "BATCH", "POS_BEGIN",
                                                                     "POS_END")})
    return out


@pytest.mark.parametrize("fuse,kind", [(BACKEND_FUSE, "attention_split_prep"), (list(FUSIONS), "attention_split")])
@pytest.mark.parametrize("batch", [1, 4])
def test_stage_bytes_follow_the_kernel_layout(fuse, kind, batch):
    """Per tile: merge scratch (nwarps x G x (D + 2) floats) [+ G x D bf16 of q], aligned to 16, then
    B x (POS_END - POS_BEGIN) x 2 x D bf16 -- the offsets attention_split.cuh / attention_split_prep.cuh use."""
    cg = _program(batch, fuse)
    tiles = _tiles(cg, kind)
    assert tiles, f"the program has no {kind} tiles"
    want = 0
    for t in tiles:
        scratch = (THREADS // 32) * t["GROUP"] * (t["HEAD_DIM"] + 2) * 4
        if kind == "attention_split_prep":
            scratch += t["GROUP"] * t["HEAD_DIM"] * 2
        at = -(-scratch // 16) * 16
        want = max(want, at + t["BATCH"] * (t["POS_END"] - t["POS_BEGIN"]) * 2 * t["HEAD_DIM"] * 2)
    assert kv_stage_smem_bytes(cg, THREADS) == want
    # qwen3-0.6b at 256 positions: 4 ranges of 64 per kv head, so the stage is 64 rows of 128 bf16, k and v
    assert want >= batch * 64 * 2 * 128 * 2


def test_launch_grows_by_the_stage_only_when_asked_and_it_fits():
    cg = _program(4)
    plain, staged = tables.smem_bytes(cg, THREADS), tables.smem_bytes(cg, THREADS, stage_kv=True)
    assert tables.kv_stage_fits(cg, THREADS)
    assert plain < kv_stage_smem_bytes(cg, THREADS) <= staged
    # one range of a 2048-position cache for 4 sequences: 4 x 2048 x 512 B = 4 MB, beyond any SM
    big = _program(4, max_seq_len=2048, attn_splits=1)
    assert not _tiles(big, "attention_split_prep")  # attn_splits=1: no split tiles, nothing to stage
    assert not tables.kv_stage_fits(big, THREADS)
    wide = _program(4, max_seq_len=4096, attn_splits=2)
    assert kv_stage_smem_bytes(wide, THREADS) > tables.HOPPER_MAX_DYNAMIC_SMEM
    assert not tables.kv_stage_fits(wide, THREADS)
    assert tables.smem_bytes(wide, THREADS, stage_kv=True) == tables.smem_bytes(wide, THREADS)


def test_flag_marks_exactly_the_split_tiles():
    cg = _program(1)
    n = cg.arrays["args"].shape[0]
    addrs = (np.arange(n, dtype=np.uint64) * np.uint64(4096) + np.uint64(0x7F12_0000_0000))
    addrs[cg.arrays["args"][:, ARG_COLS["BUFFER"]] < 0] = 0
    on, task_rec = R.build_records(cg, addrs.view(np.int64), stage_kv=True)
    off, _ = R.build_records(cg, addrs.view(np.int64))
    opcodes = cg.arrays["tasks"][:, TASK_COLS["OPCODE"]][on[:, R.REC_TASK]]
    split = np.isin(opcodes, [BY_NAME[k].opcode for k in KV_STAGE_KINDS])
    assert split.any() and not split.all()
    assert np.array_equal((on[:, R.REC_FLAGS] & R.FLAG_STAGE_KV) != 0, split)
    assert not (off[:, R.REC_FLAGS] & R.FLAG_STAGE_KV).any()
    # the flag is the only difference
    assert np.array_equal(on[:, R.REC_FLAGS] & ~R.FLAG_STAGE_KV, off[:, R.REC_FLAGS])
    assert np.array_equal(np.delete(on, R.REC_FLAGS, axis=1), np.delete(off, R.REC_FLAGS, axis=1))


def test_cuda_header_names_the_flag_and_its_bit():
    src = (CSRC / "runtime" / "task_record.cuh").read_text()
    m = re.search(r"REC_FLAG_STAGE_KV\s*=\s*(\d+)", src)
    assert m and int(m.group(1)) == R.FLAG_STAGE_KV
    assert R.FLAG_STAGE_KV & (R.FLAG_SIG_SYS | R.FLAG_WAITS_INLINE | R.FLAG_SIGNALS_INLINE | R.FLAG_BULK_PREFETCH) == 0
