"""CPU checks of the attn_prep fusion's CUDA and host side: the kernel with the attention_prep case
builds for sm_90a with nvcc and ptxas reports no local-memory spills in its functions at 512 worker
threads (G <= 4, D = 128 instances; all 12 for the dispatch function itself), the dispatch case
exists, the backend's MPK_FUSE_ATTN_PREP knob reaches the compiled program, and the host's pre-launch
checks and shared-memory size cover the fused tiles."""

from __future__ import annotations

import re
import shutil

import pytest

from mpk_dist.errors import InputError
from mpk_dist.runtime.build import CSRC
from mpk_dist.taskgraph.fusion import FUSIONS
from mpk_dist.taskgraph.lowering_attn_prep import attn_prep_smem_bytes
from mpk_dist.taskgraph.tasks import BY_NAME

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
WITH = sorted(FUSIONS) + ["attn_prep"]


ENTRY_FRAME_BYTES_MAX = 592
"""The kernel entry's stack frame at batch 1 (ptxas -v). A tripwire, not a cause: three changes that grew it
(v0.11's pipelined attention walk: 2,480 B; v0.12's and v0.13's first rows-together staging: 880 and 864 B, with
128 B of spills in the fused linear bodies) each slowed the whole qwen3-8b batch-1 kernel by 10-50%, while the
same frame padded alone cost nothing (docs/PERF.md v0.13, call 7): the growth came with larger once-a-tile code.
A change that needs a larger frame has to show on the GPU that it does not slow the kernel. The tensor-core
attention walk had it at 608 B with ~100 B of spills in attention_seq<MG, 4> (v0.27); with int row offsets and its
value loads after the score mmas it is back at 592 B and spill-free (v0.28: qwen3-8b batch 8 5.735 / 5.738 ms vs
5.823 / 5.832 with the spilling walk). This bound holds for the default batch-1 programs (norm_linear_silu, unroll 4
and 16)."""

ENTRY_FRAME_SILU_LINEAR_BYTES_MAX = 608
"""The same frame in the batch-1 program that runs silu_linear instead (MPK_FUSE_SILU_EPI=0, unroll 8; not a default):
the batch-1 norm-weight L2 prefetch (MPK_PREFETCH_NORM_W, on at batch 1 since docs/PERF.md v0.31) takes it from 592
to 608 B there, and only there (checked with ptxas -v at the commit before it, with and without the define)."""


ARG_PASS_BYTES_MAX = 4
"""Bytes a run_attention_prep_attend<MG, 4> wrapper stores to local memory and its attention_seq<MG, 4> loads back
(an argument handed over once a tile, no loop traffic): 0 at unroll 4 and 16, 4 B in one instance at unroll 8
(v0.28; with the v0.27 walk the wrappers stored 16-20 B and attention_seq spilled 96-120 / 124-144 B). A tripwire."""


def _frame(log: str, fn: str) -> int:
    """ptxas -v: the stack frame bytes of function ``fn`` (mangled, or the kernel's plain name)."""
    m = re.search(rf"Function properties for {re.escape(fn)}\n\s*(\d+) bytes stack frame", log)
    assert m, f"ptxas -v printed no properties for {fn}"
    return int(m.group(1))


def _spills(log: str) -> dict[str, tuple[int, int]]:
    """ptxas -v: function (mangled) -> (spill store bytes, spill load bytes)."""
    out = {}
    for m in re.finditer(r"Function properties for (\S+)\n[^\n]*?(\d+) bytes spill stores, (\d+) bytes spill loads", log):
        out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return out


@needs_nvcc
@pytest.mark.parametrize("unroll", [4, 8, 16])
def test_kernel_builds_without_spills_in_the_new_functions(unroll, tmp_path, monkeypatch):
    """The batch-1 kernel at each unroll a batch-1 default may take (tables.default_linear_unroll): no spills in
    the attention_prep functions, the unsplit attention walk (attention_seq, on tensor cores) or the fused linear
    bodies, but an argument a wrapper hands attention_seq through local memory (ARG_PASS_BYTES_MAX), and the
    entry's stack frame no larger than ENTRY_FRAME_BYTES_MAX; at these 512 threads the split prep's per-sequence
    function inlined (csrc/runtime/dispatch.cuh MPK_SPLIT_PREP_SEQ_OUTLINED). A program's kernel leaves out the silu
    kind it does not run (kernel.kind_defines): the default batch-1 programs run norm_linear_silu (unroll 4 and 16
    here), those with MPK_FUSE_SILU_EPI=0 silu_linear (unroll 8 here)."""
    from mpk_dist.runtime.codegen import KernelShape
    from mpk_dist.runtime.kernel import build_kernel

    left_out = "MPK_SILU_EPI_KIND" if unroll == 8 else "MPK_SILU_LINEAR_KIND"
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MPK_NVCC_EXTRA_FLAGS", f"-Xptxas -v -D{left_out}=0")
    _, res = build_kernel(KernelShape(batch=1, worker_threads=512, schedule="aot", linear_unroll=unroll),
                          compiler="nvcc")
    assert res.cubin[:4] == b"\x7fELF"
    assert {"attention_prep.cuh", "attention_mma_walk.cuh", "mma_ops.cuh"} <= {p.name for p in res.headers}
    spills = _spills(res.log)
    mine = {k: v for k, v in spills.items() if "attention_prep" in k}
    dispatch = [k for k in mine if "18run_attention_prep" in k]
    heads = [k for k in mine if "attention_prep_heads" in k]
    # run_attention_prep_attend<MG, ME>: G <= 4 and D = 128 (4 elements per lane) use MG <= 4, ME <= 4
    small = [k for k in mine if re.search(r"run_attention_prep_attendILi[124]ELi[24]E", k)]
    assert len(dispatch) == 1 and len(heads) == 1 and len(small) == 6, sorted(mine)
    for k in dispatch + heads:
        assert mine[k] == (0, 0), f"{k}: ptxas spills (stores, loads) = {mine[k]}"
    for k in small:
        stores, loads = mine[k]
        assert loads == 0 and stores <= ARG_PASS_BYTES_MAX, f"{k}: ptxas spills (stores, loads) = {mine[k]}"
    # attention_seq<MG, ME> holds the unsplit tiles' tensor-core walk (csrc/tasks/attention_mma_walk.cuh, default on)
    walk = [k for k in spills if re.search(r"13attention_seqILi[124]ELi[24]E", k)]
    assert len(walk) == 6, sorted(k for k in spills if "attention_seq" in k)
    for k in walk:
        stores, loads = spills[k]
        assert stores == 0 and loads <= ARG_PASS_BYTES_MAX, f"{k}: ptxas spills (stores, loads) = {spills[k]}"
    # 512 threads (128 registers): the split prep's per-sequence function is inlined (MPK_SPLIT_PREP_SEQ_OUTLINED's
    # default follows the register cap; measured faster so at qwen3-1.7b, docs/PERF.md v0.37)
    assert any("run_attention_split_prep" in k for k in spills) and not any("split_prep_sequence" in k for k in spills)
    assert b"split_prep_sequence" not in res.cubin
    fused = {k: v for k, v in spills.items() if re.search(r"run_(norm|silu)_linear", k)}  # + run_norm_linear_silu
    assert len(fused) == 2 and all(v == (0, 0) for v in fused.values()), f"fused linear bodies spill: {fused}"
    assert any("run_norm_linear_silu" in k for k in fused) == (left_out == "MPK_SILU_LINEAR_KIND"), sorted(fused)
    frame = _frame(res.log, "mpk_megakernel")
    bound, name = ((ENTRY_FRAME_BYTES_MAX, "ENTRY_FRAME_BYTES_MAX") if left_out == "MPK_SILU_LINEAR_KIND"
                   else (ENTRY_FRAME_SILU_LINEAR_BYTES_MAX, "ENTRY_FRAME_SILU_LINEAR_BYTES_MAX"))
    assert frame <= bound, f"the kernel entry's stack frame is {frame} B, expected <= {bound} B (see {name})"


def test_dispatch_case_and_opcode():
    text = (CSRC / "runtime" / "dispatch.cuh").read_text()
    run_task = text[text.index("__device__ bool run_task("):text.index("__device__ void prefetch_task(")]
    assert re.search(r"case OP_ATTENTION_PREP: return run_attention_prep\(", run_task)
    # appended as 24 (page_alloc came after it as 25): kinds are never renumbered
    assert BY_NAME["attention_prep"].opcode == 24 and BY_NAME["page_alloc"].opcode == 25
    body = (CSRC / "tasks" / "attention_prep.cuh").read_text()
    assert "MPK_SUPEROPT_QK_NORM_ROPE" in body and "gen::qk_norm_rope" in body  # the generated body's hook


def _program(batch: int = 1):
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    return compile_rank_programs(get_preset("tiny"), 1, batch=batch, sms=8, max_seq_len=32, fuse=WITH)[0]


def test_pre_launch_checks_accept_the_fused_program():
    from mpk_dist.runtime import tables

    tables.check_supported(_program(4))


def test_launch_shared_memory_covers_the_attention_half():
    from mpk_dist.runtime import tables

    cg = _program()
    assert tables.smem_bytes(cg, 512) >= attn_prep_smem_bytes(cg, 512) > 0


def test_env_knob_reaches_the_program(fake_gpu, monkeypatch):
    from mpk_dist.model_source import open_model

    m = open_model("tiny")
    monkeypatch.delenv("MPK_FUSE_ATTN_PREP", raising=False)
    monkeypatch.delenv("MPK_FUSE_ATTN_MERGE", raising=False)
    monkeypatch.delenv("MPK_FUSE_SILU_EPI", raising=False)
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    assert b.fuse == frozenset(WITH + ["attn_merge", "silu_epi"])  # the backend's default (fuse=True) has both
    kinds = {o["kind"] for o in b.session(1).cg.meta["ops"]}
    assert "attention_prep" in kinds and not kinds & {"qkv_prep", "attention"}
    monkeypatch.setenv("MPK_FUSE_ATTN_PREP", "0")
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    assert "attn_prep" not in b.fuse and "attn_merge" in b.fuse
    monkeypatch.setenv("MPK_FUSE_ATTN_MERGE", "0")
    named = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4, fuse=["attn_prep"])
    assert named.fuse == frozenset({"attn_prep"})
    monkeypatch.delenv("MPK_FUSE_ATTN_PREP")
    monkeypatch.delenv("MPK_FUSE_ATTN_MERGE")
    plain = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4, fuse=["norm"])
    assert plain.fuse == frozenset({"norm"})  # an explicit list gets the attention fusions only when set to 1
    monkeypatch.setenv("MPK_FUSE_ATTN_MERGE", "1")
    assert fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4,
                                      fuse=["norm"]).fuse == frozenset({"norm", "attn_merge"})
    monkeypatch.setenv("MPK_FUSE_ATTN_PREP", "yes")
    with pytest.raises(InputError, match=r"MPK_FUSE_ATTN_PREP: expected one of 0, 1, got 'yes'"):
        fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)


# ---- the fusion in split-KV programs: attention_split_prep ----
def _split_program(batch: int = 1):
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    return compile_rank_programs(get_preset("tiny"), 1, batch=batch, sms=8, max_seq_len=64, fuse=WITH,
                                 attn_splits=4)[0]


def test_split_prep_dispatch_case_prefetch_and_opcode():
    text = (CSRC / "runtime" / "dispatch.cuh").read_text()
    run_task = text[text.index("__device__ bool run_task("):text.index("__device__ __noinline__ void attention_prefetch(")]
    assert re.search(r"case OP_ATTENTION_SPLIT_PREP: return run_attention_split_prep\(", run_task)
    prefetch = text[text.index("__device__ void prefetch_task("):]
    assert "OP_ATTENTION_SPLIT_PREP" in prefetch, "the fused split tiles prefetch their cache rows too"
    assert BY_NAME["attention_split_prep"].opcode == 26


def test_split_prep_shared_memory_formula_and_launch_size():
    from mpk_dist.runtime import tables
    from mpk_dist.taskgraph.lowering_attn_prep import split_prep_smem_bytes

    cg = _split_program(2)
    assert "attention_split_prep" in {o["kind"] for o in cg.meta["ops"]}
    G, D = 2, 32  # tiny: 4 q heads over 2 kv heads of 32
    assert split_prep_smem_bytes(cg, 512) == 16 * G * (D + 2) * 4 + G * D * 2
    assert tables.smem_bytes(cg, 512) >= split_prep_smem_bytes(cg, 512)
    tables.check_supported(cg)
    body = (CSRC / "tasks" / "attention_split_prep.cuh").read_text()
    assert "attention_smem_bytes(nwarps, G, D) + G * D * (int)sizeof(bf16)" in body  # the formula above
