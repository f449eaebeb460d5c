"""The kernel prebuild (mpk_dist.runtime.prebuild) asks for exactly the kernel a run's Session builds
(same KernelShape, same program shapes for the generated bodies), so its cubins are cache hits."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from mpk_dist.errors import InputError
from mpk_dist.model_source import open_model
from mpk_dist.runtime import prebuild as PB
from mpk_dist.taskgraph.lowering_attention import AUTO_SPLIT_MAX_BATCH


def _fake_build_kernel(keep):
    """A build_kernel that builds nothing and hands ``keep`` the shape and the program's op kinds."""
    def build(shape, **kw):
        keep(shape, [op["kind"] for op in kw["program"].meta["ops"]])
        return "src", types.SimpleNamespace(cubin=b"", cached=True, compiler="fake", path=Path("x"))
    return build


@pytest.mark.parametrize("batch, schedule, tp, env, splits", [(1, "aot", 1, {}, "auto"), (1, "aot", 1, {}, 1),
                                                              (3, "jit", 1, {"MPK_LINEAR_UNROLL": "4"}, "auto"),
                                                              (4, "aot", 1, {}, "auto"),
                                                              (20, "aot", 2, {"MPK_LINEAR_MMA": "1"}, "auto")])
def test_prebuild_shape_is_the_sessions(fake_gpu, monkeypatch, batch, schedule, tp, env, splits):
    from mpk_dist.runtime import kernel as K
    from mpk_dist.runtime import session as S

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}

    def record(who):
        return _fake_build_kernel(lambda shape, kinds: seen.__setitem__(who, (shape, kinds)))

    monkeypatch.setattr(S, "build_kernel", record("session"))
    monkeypatch.setattr(K, "build_kernel", record("prebuild"))
    m = open_model("tiny")
    # 'auto' splits at this max_seq_len on the fake GPU's SMs as on an H200's (the prebuild's assumption)
    b = fake_gpu.MegakernelBackend(m.config, m.weights, tp=tp, device="cpu", max_seq_len=512, schedule=schedule,
                                   attn_splits=splits)
    b.session(batch)
    PB.build_one(PB.BuildCase("tiny", tp=tp, batch=batch, schedule=schedule, attn_splits=splits))
    assert seen["prebuild"][0] == seen["session"][0]
    assert seen["prebuild"][1] == seen["session"][1], "the same fused kinds (so the same generated bodies)"
    split = splits == "auto" and batch <= AUTO_SPLIT_MAX_BATCH  # tiny's o_proj is far below the unsplit rule's bytes
    assert ("attention_split_prep" if split else "attention_prep") in seen["session"][1]


def test_case_environment_gives_the_sessions_shape_under_that_environment(fake_gpu, monkeypatch):
    """A BuildCase's env (tune_sweep --prebuild-jobs: a variant's knobs) builds what a Session builds with those
    variables set, and nothing of it is left set afterwards."""
    import os

    from mpk_dist.runtime import kernel as K
    from mpk_dist.runtime import session as S

    env = {"MPK_LINEAR_UNROLL": "8", "MPK_LINEAR_ROWS": "2"}
    seen = {}
    monkeypatch.setattr(S, "build_kernel", _fake_build_kernel(lambda shape, kinds: seen.__setitem__("session", shape)))
    monkeypatch.setattr(K, "build_kernel", _fake_build_kernel(lambda shape, kinds: seen.__setitem__("prebuild", shape)))
    m = open_model("tiny")
    with monkeypatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        fake_gpu.MegakernelBackend(m.config, m.weights, tp=1, device="cpu", max_seq_len=512).session(1)
    assert not any(k in os.environ for k in env)
    PB.build_one(PB.BuildCase("tiny", env=tuple(sorted(env.items()))))
    assert seen["prebuild"] == seen["session"]
    assert (seen["prebuild"].linear_unroll, seen["prebuild"].linear_rows) == (8, 2)
    assert not any(k in os.environ for k in env)


def test_prebuild_compiles_at_the_runs_cache_length(monkeypatch):
    """qwen3-8b at batch 1: 'auto' is unsplit at 512 positions and split at 2048 (o_proj's bytes per position,
    lowering_attention.resolve_splits), and the prebuild's program follows the case's max_seq_len."""
    from mpk_dist.runtime import kernel as K

    seen = []
    monkeypatch.setattr(K, "build_kernel", _fake_build_kernel(lambda shape, kinds: seen.append(kinds)))
    for n in (512, 2048):
        PB.build_one(PB.BuildCase("qwen3-8b", max_seq_len=n))
    assert "attention_split_prep" not in seen[0] and "attention_split_prep" in seen[1]


def test_cases_and_bad_jobs():
    got = PB.cases(["tiny"], [1, 4], ["aot", "jit"], [1, 2])
    assert len(got) == 2 * 2 + 2 and all(c.schedule == "aot" for c in got if c.tp > 1)
    assert {c.max_seq_len for c in got} == {512} and got[0].label() == "tiny tp1 b1 aot"
    long = PB.cases(["tiny"], [1], ["aot"], [1], ("auto", 1), max_seq_len=2048)
    assert [c.label() for c in long] == ["tiny tp1 b1 aot s2048", "tiny tp1 b1 aot k1 s2048"]
    with pytest.raises(InputError, match="--jobs: expected >= 1"):
        PB.prebuild(got, 0)


def test_failure_summary_quotes_the_compiler_errors():
    """A failed case's progress line names the exception's first line and the compiler's error lines (at most
    FAILURE_DETAIL_LINES), not only 'nvcc failed on ...' with what failed cut off."""
    from mpk_dist.runtime.build import BuildError

    text = ("nvcc failed on /tmp/x/k.cu (exit 1):\n/src/a.cuh(522): error: operand types are incompatible\n"
            "  detail that names nothing\n" + "".join(f"/src/b.cuh({i}): error: e{i}\n" for i in range(10)))
    out = PB.failure_summary(BuildError(text)).splitlines()
    assert out[0] == "BuildError: nvcc failed on /tmp/x/k.cu (exit 1):"
    assert out[1].strip() == "/src/a.cuh(522): error: operand types are incompatible"
    assert len(out) == 1 + PB.FAILURE_DETAIL_LINES and "detail that names nothing" not in "\n".join(out)
    assert PB.failure_summary(ValueError("bad shape")) == "ValueError: bad shape"
