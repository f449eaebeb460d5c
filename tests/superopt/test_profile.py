"""GPU ranking of superopt candidates (mpk_dist.superopt.profile): on a CPU a clear error; the
standalone task kernels build for sm_90a; the re-ranking and its disagreement report; on a GPU
(marked gpu) the top candidates are timed and re-ranked by measurement."""

from __future__ import annotations

import shutil

import pytest
import torch

from mpk_dist.errors import MpkError
from mpk_dist.runtime.build import compile_source
from mpk_dist.superopt import profile as P
from mpk_dist.superopt.codegen import render, write_if_changed

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")


@cpu_only
def test_profile_without_a_gpu_is_a_clear_error():
    from mpk_dist.superopt.patterns import build

    with pytest.raises(P.ProfileError, match="profile=True needs a CUDA GPU") as e:
        P.profiled_superoptimize(build("silu_mul_linear", {"M": 2, "I": 256, "N": 64}), max_block_ops=3)
    assert isinstance(e.value, MpkError) and "\n" not in str(e.value)
    with pytest.raises(P.ProfileError, match="expected a CUDA GPU"):
        P.StandaloneTask("silu_linear", None, 1)
    from mpk_dist.superopt import superoptimize

    g = build("silu_mul_linear", {"M": 2, "I": 256, "N": 64})
    with pytest.raises(P.ProfileError, match="profile=True needs a CUDA GPU"):
        superoptimize(g, max_block_ops=3, profile=True)  # the API's own switch, same error
    with pytest.raises(MpkError, match="either profile=True .* or a rank= hook, got both"):
        superoptimize(g, max_block_ops=3, profile=True, rank=lambda c: c)


def test_disagreements_name_the_pairs_the_measurement_reorders():
    timed = [{"model_rank": 1, "measured_us": 3.0}, {"model_rank": 0, "measured_us": 4.0},
             {"model_rank": 2, "measured_us": 5.0}]
    assert P.disagreements(timed) == [(0, 1)]
    assert P.disagreements(sorted(timed, key=lambda r: r["model_rank"])) == []


def test_ranker_reorders_by_measurement_and_keeps_untimed_after(monkeypatch):
    """GpuRanker's ordering logic with the GPU part replaced: timed candidates by time, then the
    ones that do not lower in model order, then the rest untouched."""
    monkeypatch.setattr(P, "require_gpu", lambda: None)
    r = P.GpuRanker(top_k=3)
    cands = [type("U", (), {"cost": {"time_us": t}, "name": n})() for n, t in zip("abcd", (1.0, 2.0, 3.0, 4.0))]
    times = {"a": (5.0, ""), "b": (None, "does not lower"), "c": (2.0, "")}
    monkeypatch.setattr(r, "_measure", lambda ug: times[ug.name])
    assert [u.name for u in r(cands)] == ["c", "a", "b", "d"]
    assert r.report["measured_order"] == [2, 0, 1] and r.report["best_changed"] is True
    assert r.report["disagreements"] == [(0, 2)]
    assert r.report["candidates"][1]["not_timed"] == "does not lower"


@pytest.mark.parametrize("kind", ["norm_linear", "silu_linear"])
def test_kind_of_reads_the_target_inputs(results, kind):
    pattern = {"norm_linear": "rmsnorm_linear", "silu_linear": "silu_mul_linear"}[kind]
    assert P.kind_of(results(pattern)[1].best) == kind
    attention = type("U", (), {"inputs": {"Q": None, "Kt": None, "V": None}})()
    with pytest.raises(P.ProfileError, match="GPU timing covers"):
        P.kind_of(attention)


@needs_nvcc
@pytest.mark.parametrize("kind", ["norm_linear", "silu_linear"])
def test_standalone_harness_builds_for_sm90a(results, kind, tmp_path, monkeypatch):
    """The standalone kernel of a generated body (and of the hand-written one) compiles."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    pattern = {"norm_linear": "rmsnorm_linear", "silu_linear": "silu_mul_linear"}[kind]
    write_if_changed(tmp_path / "generated" / f"{kind}.cuh", render(results(pattern)[1].best, kind))
    res = compile_source(P.harness_source(kind), f"task_{kind}", {"MPK_BATCH": 2}, compiler="nvcc",
                         include_dirs=[tmp_path])
    assert res.cubin[:4] == b"\x7fELF" and b"mpk_task" in res.cubin
    assert str((tmp_path / "generated" / f"{kind}.cuh").resolve()) in {str(p) for p in res.headers}
    assert "mpk::" + kind + "(" in P.harness_source(kind, generated=False)


@pytest.mark.gpu
def test_profiled_search_times_and_reranks_on_the_gpu():
    """silu·mul→matmul at decode-like shapes: the top candidates that lower are timed on the GPU,
    the result is ranked by the measurement, and the report says where the model disagrees."""
    from mpk_dist.superopt.patterns import build

    res = P.profiled_superoptimize(build("silu_mul_linear", {"M": 1, "I": 3072, "N": 1024}), top_k=4,
                                   max_block_ops=4, cache=False, timeout_s=120)
    rep = res.stats["profile"]
    timed = [c for c in rep["candidates"] if c["measured_us"] is not None]
    assert timed, rep
    assert all(0 < c["measured_us"] < 1e4 for c in timed)
    first = rep["candidates"][rep["measured_order"][0]]
    assert first["measured_us"] == min(c["measured_us"] for c in timed)
    print(f"\nprofile: {rep}")
