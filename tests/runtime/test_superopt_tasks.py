"""CPU tests of the superoptimized task bodies in the kernel build (mpk_dist.runtime.superopt_tasks):
the problems are the program's fused shapes, a cold compile searches and a warm one does not, the
generated header is the one on the include path (and in the build's hashed header list), a kind
without a lowerable µGraph runs its hand-written body with a note, and --no-superopt reaches the
kernel as MPK_SUPEROPT 0. The search runs for real once per module at the tiny preset's shapes."""

from __future__ import annotations

import copy
import shutil
import subprocess
import types

import numpy as np
import pytest

from mpk_dist.runtime import superopt_tasks as ST
from mpk_dist.runtime.build import CSRC, BuildError, compile_source
from mpk_dist.runtime.codegen import KernelShape, render_source
from mpk_dist.runtime.kernel import abi_include_dir, build_kernel
from mpk_dist.superopt.codegen import render

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A module-wide empty cache directory (search results and kernels)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MPK_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    mp.delenv("MPK_SUPEROPT_MAX_WEIGHTS", raising=False)
    # qk_norm_rope's search always runs to its limit (25 s by default); it verifies graphs at the tiny
    # shapes within ~8 s on one process, and the GEMV patterns finish far below this
    mp.setenv("MPK_SUPEROPT_TIMEOUT", "15")
    # the tiny batch-1 program is where these tests search qk_norm_rope; a run's batch-1 build compiles the
    # checked-in body instead (test_batch1_and_split_prep_tiles_compile_the_checked_in_qk_body_without_a_search)
    mp.setenv("MPK_SUPEROPT_QK_SEARCH", "1")
    ST._MEMO.clear()
    ST._NOTED.clear()
    yield mp
    mp.undo()
    ST._MEMO.clear()


@pytest.fixture(scope="module")
def program():
    """The tiny preset's fused rank program (norm_linear and silu_linear tiles)."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    return compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=8, max_seq_len=64, fuse=True)[0]


class Counting:
    """A searcher that counts its calls and runs the real search."""

    def __init__(self):
        self.calls = []

    def __call__(self, problem):
        self.calls.append(problem)
        return ST.search(problem, processes=1)


@pytest.fixture(scope="module")
def cold(env, program):
    """prepare() on an empty cache with the real search; (result, searcher, log lines)."""
    searcher, log = Counting(), []
    return ST.prepare(program, searcher, log.append), searcher, log


def test_problems_are_the_programs_fused_shapes(program):
    from mpk_dist.models.presets import get_preset

    c = get_preset("tiny")
    eps = float(np.float32(c.rms_norm_eps))
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    want = {ST.Problem("norm_linear", 1, c.hidden_size, qkv, eps), ST.Problem("norm_linear", 1, c.hidden_size,
                                                                              2 * c.intermediate_size, eps),
            ST.Problem("norm_linear", 1, c.hidden_size, c.vocab_size, eps),
            ST.Problem("silu_linear", 1, c.intermediate_size, c.hidden_size, 0.0),
            ST.Problem("qk_norm_rope", c.num_heads, c.head_dim, c.head_dim, eps)}
    got = ST.problems_of(program)
    assert set(got) == want
    down = ST.Problem("silu_linear", 1, c.intermediate_size, c.hidden_size, 0.0)
    assert got[down] == c.num_layers * c.intermediate_size * c.hidden_size  # weight elements per step


def test_cold_compile_searches_once_per_problem_and_warm_does_not(env, program, cold):
    so, searcher, log = cold
    assert sorted(p.label() for p in searcher.calls) == sorted(p.label() for p in ST.problems_of(program))
    assert sum("searched in" in m or "superoptimize's cache hit" in m for m in log) == len(searcher.calls)
    ST._MEMO.clear()  # a new process: only the disk cache is left
    warm_log = []
    warm = ST.prepare(program, searcher, warm_log.append)
    assert len(searcher.calls) == len(ST.problems_of(program)), "a warm compile searched again"
    assert sum(": cached (" in m for m in warm_log) == len(ST.problems_of(program)), warm_log
    assert warm.include_dirs == so.include_dirs and warm.defines == so.defines


def _sleepy_search(problem):
    """Stands in for the real search in the side-by-side test (top level: it crosses a process pool)."""
    import os
    import time

    t0 = time.time()
    time.sleep(0.5)
    return ST.Choice(problem, None, {"pid": os.getpid(), "t0": t0, "t1": time.time()}, "no µGraph (test)")


def test_uncached_searches_run_side_by_side(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ST, "_MEMO", {})
    monkeypatch.setattr(ST, "search", _sleepy_search)
    probs = [ST.Problem("norm_linear", 1, 64, n, 1e-6) for n in (128, 256, 512)]
    ST.search_side_by_side(probs + probs[:1], ST.search)  # a repeated problem is searched once
    got = [ST._MEMO[ST.cache_path(p)] for p in probs]
    assert [c.problem for c in got] == probs
    pids = {c.stats["pid"] for c in got}
    assert len(pids) == 3 and os.getpid() not in pids, "each search in its own process"
    assert max(c.stats["t0"] for c in got) < min(c.stats["t1"] for c in got), "the three searches overlapped"
    ST._MEMO.clear()  # what a later process sees: the disk cache
    assert all(ST._read(ST.cache_path(p)).problem == p for p in probs)
    # answered problems are not searched again (choose() then reads them); fewer than two: no pool
    calls = []
    monkeypatch.setattr(ST, "choose", lambda p, searcher=None: calls.append(p))
    ST.search_side_by_side(probs + [ST.Problem("norm_linear", 1, 64, 1024, 1e-6)], ST.search)
    assert calls == []


def test_every_kind_gets_a_generated_header_or_the_hand_written_body(env, cold):
    so, _, log = cold
    for kind in ST.KIND_PATTERN:
        if kind in so.choices:
            c = so.choices[kind]
            d = next(x for x in so.include_dirs if x.name == f"{c.problem.pattern}-{c.ug_hash}")
            assert (d / "generated" / f"{kind}.cuh").read_text() == render(c.ugraph, kind, eps=c.problem.eps)
            assert f"MPK_SUPEROPT_{kind.upper()}" not in so.defines
        else:
            assert so.defines[f"MPK_SUPEROPT_{kind.upper()}"] == 0
            assert any(f"{kind} runs the hand-written body" in m for m in log), log
    assert so.choices, "no kind got a generated body at the tiny shapes"


def test_no_lowerable_graph_falls_back_with_a_note(env, program, monkeypatch, tmp_path):
    def nothing(problem):
        return ST.Choice(problem, None, {"seconds": 0.1}, "the search found no verified µGraph (test)")

    ST._MEMO.clear()
    ST._NOTED.clear()  # notes print once per process; this test reads them
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    log = []
    so = ST.prepare(program, nothing, log.append)
    assert so.defines == {"MPK_SUPEROPT_NORM_LINEAR": 0, "MPK_SUPEROPT_SILU_LINEAR": 0,
                          "MPK_SUPEROPT_QK_NORM_ROPE": 0} and not so.include_dirs
    assert any("no verified µGraph (test)" in m for m in log)
    assert any("silu_linear runs the hand-written body (csrc/tasks/silu_linear.cuh): no searched shape gave"
               in m for m in log)
    ST._MEMO.clear()


def test_qk_norm_rope_gets_a_generated_body_and_llama_keeps_the_hand_written_one(env, cold):
    """The tiny preset (Qwen3: q/k norms) gets a generated qk_norm_rope from its search; a model without
    q/k norms (tiny-llama: rope only) has no qk_norm_rope problem and keeps qkv_prep's hand-written body."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    so, _, _ = cold
    c = so.choices["qk_norm_rope"]
    assert c.problem.eps > 0 and c.problem.label() == f"qk_norm_rope H=4 D=32 eps={c.problem.eps:g}"
    assert "MPK_SUPEROPT_QK_NORM_ROPE" not in so.defines
    assert "mpk::qk_norm_rope" in render(c.ugraph, "qk_norm_rope", eps=c.problem.eps)
    llama = compile_rank_programs(get_preset("tiny-llama"), tp=1, batch=1, sms=8, max_seq_len=64, fuse=True)[0]
    assert not any(p.kind == "qk_norm_rope" for p in ST.problems_of(llama))
    calls, log = [], []
    ST._NOTED.clear()
    out = ST.prepare(llama, lambda p: calls.append(p) or ST.search(p, processes=1), log.append)
    assert out.defines.get("MPK_SUPEROPT_QK_NORM_ROPE") == 0 and not any(p.kind == "qk_norm_rope" for p in calls)
    assert any("qk_norm_rope runs the hand-written body (csrc/tasks/qkv_prep.cuh): the model has no q/k norm" in m
               for m in log), log


def test_shapes_above_the_weight_cap_are_not_searched(env, program, monkeypatch):
    monkeypatch.setenv("MPK_SUPEROPT_MAX_WEIGHTS", "100")
    ST._NOTED.clear()
    calls, log = [], []
    so = ST.prepare(program, calls.append, log.append)
    assert not calls and set(so.defines) == {"MPK_SUPEROPT_NORM_LINEAR", "MPK_SUPEROPT_SILU_LINEAR",
                                             "MPK_SUPEROPT_QK_NORM_ROPE"}
    assert any("not searched (K*N > 100" in m for m in log)


def test_search_keeps_the_cheapest_candidate_that_lowers(env, cold, monkeypatch):
    """The best candidate does not lower (grid over rows): the second one is kept, with a note."""
    import mpk_dist.superopt as SO
    from mpk_dist.superopt.search import SearchResult

    so = cold[0]
    kind = next(iter(so.choices))
    good = so.choices[kind].ugraph
    bad = copy.deepcopy(good)
    bad["kernel_ops"][0]["block"]["grid"] = [["m", 2]]
    cands = [types.SimpleNamespace(to_dict=lambda d=d: d) for d in (bad, good)]
    monkeypatch.setattr(SO, "superoptimize", lambda g, **kw: SearchResult(cands[0], cands, {"seconds": 1.0}))
    c = ST.search(so.choices[kind].problem)
    assert c.ugraph == good and c.stats["rank"] == 1 and "candidate 2 of 2" in c.note and "grid" in c.note
    cands.pop()
    c = ST.search(so.choices[kind].problem)
    assert c.ugraph is None and "no verified µGraph lowers to a task body" in c.note


def test_kernel_shape_switch_is_rendered():
    assert "#define MPK_SUPEROPT 1" in render_source(KernelShape(1))
    off = KernelShape(1, superopt=False)
    assert "#define MPK_SUPEROPT 0" in render_source(off) and off.name().endswith("_nso")


def test_no_superopt_flag_reaches_the_megakernel_backend_only():
    import argparse

    from mpk_dist.backends import registry
    from mpk_dist.cli.commands.run import add_model_args, backend_opts
    from mpk_dist.errors import InputError
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert backend_opts(p.parse_args(["--no-superopt"])) == {"superopt": False}
    assert "superopt" not in backend_opts(p.parse_args([]))
    registry._check_options("megakernel", MegakernelBackend, {"superopt": False})
    from mpk_dist.backends.torch_backend import TorchBackend

    with pytest.raises(InputError, match="superopt"):
        registry._check_options("torch", TorchBackend, {"superopt": False})


@needs_nvcc
def test_superopt_kernel_compiles_with_the_generated_headers(env, program, cold):
    """The whole mega-kernel with MPK_SUPEROPT 1 builds for sm_90a; its hashed headers hold the
    generated files of the build's µGraph folders; a warm build neither searches nor compiles."""
    so, searcher, _ = cold
    ST._MEMO.clear()
    src, res = build_kernel(KernelShape(1), compiler="nvcc", program=program)
    assert "#define MPK_SUPEROPT 1" in src and res.cubin[:4] == b"\x7fELF"
    hashed = {str(p) for p in res.headers}
    for kind, c in so.choices.items():
        gen = next(d for d in so.include_dirs if d.name.endswith(c.ug_hash)) / "generated" / f"{kind}.cuh"
        assert str(gen.resolve()) in hashed, f"{gen} not among the hashed headers"
    n = len(searcher.calls)
    _, again = build_kernel(KernelShape(1), compiler="nvcc", program=program)
    assert again.cached and again.key == res.key and len(searcher.calls) == n


def _preprocess(tmp_path, shape: KernelShape, first) -> subprocess.CompletedProcess:
    """nvcc -E of the kernel source with ``first`` ahead of the usual include path."""
    cu = tmp_path / "k.cu"
    cu.write_text(render_source(shape))
    dirs = [first, abi_include_dir(), CSRC / "runtime", CSRC / "tasks", CSRC / "comm", CSRC]
    cmd = ["nvcc", "-E", "-std=c++17", "-arch=sm_90a", *[f"-I{d}" for d in dirs], str(cu), "-o", str(tmp_path / "k.ii")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@needs_nvcc
def test_include_path_picks_the_build_folder_and_the_switch_turns_it_off(env, tmp_path):
    """A folder first on the path wins over csrc/tasks/generated under MPK_SUPEROPT 1 (the poison
    header is compiled); with --no-superopt (MPK_SUPEROPT 0) it is never included."""
    poison = tmp_path / "poison"
    (poison / "generated").mkdir(parents=True)
    (poison / "generated" / "silu_linear.cuh").write_text('#error "the build folder was picked"\n')
    on = _preprocess(tmp_path, KernelShape(1), poison)
    assert on.returncode != 0 and "the build folder was picked" in on.stderr
    off = _preprocess(tmp_path, KernelShape(1, superopt=False), poison)
    assert off.returncode == 0, off.stderr[-2000:]
    qk = tmp_path / "poison_qk"  # the qkv_prep hook: included under MPK_SUPEROPT 1 only
    (qk / "generated").mkdir(parents=True)
    (qk / "generated" / "qk_norm_rope.cuh").write_text('#error "the qk_norm_rope build folder was picked"\n')
    on = _preprocess(tmp_path, KernelShape(1), qk)
    assert on.returncode != 0 and "the qk_norm_rope build folder was picked" in on.stderr
    off = _preprocess(tmp_path, KernelShape(1, superopt=False), qk)
    assert off.returncode == 0, off.stderr[-2000:]
    with pytest.raises(BuildError, match="the build folder was picked"):
        compile_source(render_source(KernelShape(1)), "poisoned", compiler="nvcc", include_dirs=[poison, abi_include_dir()],
                       use_cache=False)


def test_attn_prep_fusion_asks_for_the_same_qk_norm_rope_problem():
    """With qkv_prep folded into the attention tiles (opt-in fusion attn_prep) the program still asks for
    the qk_norm_rope body at the model's shapes (H q heads of a layer, D, eps), the one the unfused asks."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.taskgraph.compiler import compile_rank_programs
    from mpk_dist.taskgraph.fusion import OPT_IN_FUSIONS

    def qk(fuse):
        cg = compile_rank_programs(get_preset("qwen3-0.6b"), tp=1, batch=4, sms=132, max_seq_len=64, fuse=fuse)[0]
        return [p for p in ST.problems_of(cg) if p.kind == "qk_norm_rope"]

    plain = qk(True)
    fused = qk(("norm", "silu", "residual", *(f for f in OPT_IN_FUSIONS if f != "silu_down")))  # (not with flags)
    assert len(plain) == 1 and fused == plain and plain[0].batch == get_preset("qwen3-0.6b").num_heads


def test_batch1_and_split_prep_tiles_compile_the_checked_in_qk_body_without_a_search(monkeypatch, tmp_path):
    """A split-KV program (attention_split_prep tiles run the q/k norm + rope through the hook) and any batch-1
    program search no qk_norm_rope problem (no 25 s on the cold start), define nothing for it, so the hook
    compiles the checked-in generated body, and say so; Llama (no q/k norm) keeps the hand-written body; a
    batch-2 program still searches."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.megakernel_backend import DEFAULT_ATTN_FUSIONS
    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.compiler import compile_rank_programs
    from mpk_dist.taskgraph.tasks import BY_NAME

    def program(model, batch=1):  # the program a run builds (the backend's default fusions)
        return compile_rank_programs(get_preset(model), tp=1, batch=batch, sms=132, max_seq_len=512,
                                     attn_splits="auto", fuse=("norm", "silu", "residual", *DEFAULT_ATTN_FUSIONS))[0]

    def nothing(problem):
        asked.append(problem)
        return ST.Choice(problem, None, {"seconds": 0.0}, "not searched (test)")

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MPK_SUPEROPT_QK_SEARCH", raising=False)
    ST._MEMO.clear()
    ST._NOTED.clear()  # notes print once per process; this test reads them
    asked, log = [], []
    cg = program("qwen3-0.6b")
    assert (cg.arrays["tasks"][:, TASK_COLS["OPCODE"]] == BY_NAME["attention_split_prep"].opcode).any(), "not split"
    so = ST.prepare(cg, nothing, log.append)
    assert asked and not any(p.kind == "qk_norm_rope" for p in asked)
    assert "MPK_SUPEROPT_QK_NORM_ROPE" not in so.defines and "qk_norm_rope" not in so.choices
    assert any("split prep tiles: the checked-in generated body" in m for m in log), log
    llama = ST.prepare(program("llama3-8b"), nothing, log.append)
    assert llama.defines.get("MPK_SUPEROPT_QK_NORM_ROPE") == 0
    # qwen3-8b's batch-1 attention is unsplit at 512 positions: still no qk_norm_rope search (the cold start)
    asked.clear()
    cg8 = program("qwen3-8b")
    assert not (cg8.arrays["tasks"][:, TASK_COLS["OPCODE"]] == BY_NAME["attention_split_prep"].opcode).any()
    assert any(p.kind == "qk_norm_rope" for p in ST.problems_of(cg8)), "the unsplit prep has a q/k norm problem"
    so8 = ST.prepare(cg8, nothing, log.append)
    assert asked and not any(p.kind == "qk_norm_rope" for p in asked)
    assert "MPK_SUPEROPT_QK_NORM_ROPE" not in so8.defines and "qk_norm_rope" not in so8.choices
    assert any("a batch-1 program: the checked-in generated body" in m for m in log), log
    # above batch 1 the unsplit prep searches as before
    asked.clear()
    ST.prepare(program("qwen3-0.6b", batch=2), nothing, log.append)
    assert any(p.kind == "qk_norm_rope" for p in asked)
    asked.clear()  # and MPK_SUPEROPT_QK_SEARCH=1 searches the batch-1 unsplit prep too
    monkeypatch.setenv("MPK_SUPEROPT_QK_SEARCH", "1")
    ST.prepare(cg8, nothing, log.append)
    assert any(p.kind == "qk_norm_rope" for p in asked)
    ST._MEMO.clear()


def test_checked_in_qk_norm_rope_fallback_is_the_renderers_text():
    """csrc/tasks/generated/qk_norm_rope.cuh (the body a build without its own searched µGraph compiles) is what
    today's renderer makes of the µGraph stored beside it: a renderer change that is not re-rendered fails here
    (the fallback once kept 8 pair slots after the renderer had moved to one instance per pair count)."""
    import json

    import numpy as np

    from mpk_dist.runtime.build import CSRC
    from mpk_dist.superopt.codegen import render

    folder = CSRC / "tasks" / "generated"
    ug = json.loads((folder / "qk_norm_rope.ugraph.json").read_text())
    text = render(ug, "qk_norm_rope", eps=float(np.float32(1e-6)))
    assert "template <int kMaxPairs>" in text
    assert (folder / "qk_norm_rope.cuh").read_text() == text, "re-render the fallback from qk_norm_rope.ugraph.json"


def test_a_timed_out_answer_says_where_it_is_stored(tmp_path, monkeypatch):
    """A search that hit its time limit is stored like any other (a warm build must not search again), and both the
    search's line and every later "cached" line name the stored file and how to search again; a search that ended
    on its own says nothing of the kind."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ST, "_MEMO", {})
    slow = ST.Problem("norm_linear", 1, 64, 32, 1e-6)
    quick = ST.Problem("norm_linear", 1, 64, 48, 1e-6)

    def searcher(problem):
        timed_out = problem == slow
        return ST.Choice(problem, None, {"timed_out": timed_out, "seconds": 1.0, "explored": 7},
                         "the search found no verified µGraph (timed out before verifying one)")

    lines = []
    ST.choose(slow, searcher=searcher, log=lines.append)
    ST.choose(quick, searcher=searcher, log=lines.append)
    path = ST.cache_path(slow)
    assert path.exists()
    assert "timed out" in lines[0] and str(path) in lines[0] and "MPK_SUPEROPT_TIMEOUT" in lines[0]
    assert "time limit" not in lines[1] and str(ST.cache_path(quick)) not in lines[1]
    monkeypatch.setattr(ST, "_MEMO", {})
    again = []
    c = ST.choose(slow, searcher=lambda p: pytest.fail("searched again"), log=again.append)
    assert c.ugraph is None and c.stats["timed_out"]
    assert "cached (no µGraph)" in again[0] and str(path) in again[0] and "search again" in again[0]
