"""scripts/tune_sweep.py's row labels: the kernel shape each variant ran, read from the cubin the backend reports."""

from __future__ import annotations

import pytest

from mpk_dist.runtime.codegen import KernelShape


def test_kernel_shape_name_is_the_shape_of_the_cubin(tune_sweep, tmp_path):
    """A variant's row names the shape it built (threads, rows, unroll): `r2` at a program's unroll 4 shows u4 beside
    r2, which is how two rows of two loads differ from two rows of four (docs/PERF.md v0.31)."""
    shape = KernelShape(batch=1, worker_threads=256, schedule="aot", linear_rows=2, linear_unroll=4, prefetch_kb=64)
    cubin = tmp_path / "kernels" / f"{shape.name()}-73ca850a04851f14d050f471ed2f42ff.cubin"
    assert tune_sweep.kernel_shape_name(str(cubin)) == shape.name() == "mk_b1_t256_aot_r2_u4_p64"
    assert tune_sweep.kernel_shape_name("") == "-"  # a backend that reports no cubin
    assert tune_sweep.kernel_shape_name(str(tmp_path / "trace.json")) == "-"


def test_prebuild_cases_are_the_variants_distinct_kernels(tune_sweep):
    """--prebuild-jobs builds one kernel per distinct variant: base twice is one case, a -D part and a knob land in
    the case's environment, k<N> / s0 in its program, and f0 / f1 (another fusion set) are left to build when run."""
    text = "base;-DMPK_NORM_ONE_ROUND=1;base;r2,u8;k4;s0;f0;-DMPK_NORM_ONE_ROUND=1"
    variants = [(t, tune_sweep.parse_variant(t)) for t in text.split(";")]
    cases = tune_sweep.prebuild_cases(variants, "qwen3-0.6b", 1, 544)
    assert [c.env for c in cases] == [(), (("MPK_NVCC_EXTRA_FLAGS", "-DMPK_NORM_ONE_ROUND=1"),),
                                      (("MPK_LINEAR_ROWS", "2"), ("MPK_LINEAR_UNROLL", "8")), (), ()]
    assert [(c.attn_splits, c.superopt) for c in cases] == [("auto", True)] * 3 + [(4, True), ("auto", False)]
    assert {(c.model, c.batch, c.max_seq_len, c.schedule, c.tp) for c in cases} == {("qwen3-0.6b", 1, 544, "aot", 1)}
    assert "MPK_LINEAR_ROWS=2 MPK_LINEAR_UNROLL=8" in cases[2].label()


def test_build_one_sets_the_case_environment_only_while_it_builds(monkeypatch):
    import os

    from mpk_dist.runtime import prebuild

    seen = {}

    def fake_build(case):
        seen.update({k: os.environ.get(k) for k in ("MPK_NVCC_EXTRA_FLAGS", "MPK_LINEAR_ROWS")})
        return "mk.cubin", True, 0.0

    monkeypatch.setattr(prebuild, "_build_one", fake_build)
    monkeypatch.setenv("MPK_LINEAR_ROWS", "4")
    monkeypatch.delenv("MPK_NVCC_EXTRA_FLAGS", raising=False)
    case = prebuild.BuildCase("tiny", env=(("MPK_NVCC_EXTRA_FLAGS", "-DX=1"), ("MPK_LINEAR_ROWS", "2")))
    assert prebuild.build_one(case) == ("mk.cubin", True, 0.0)
    assert seen == {"MPK_NVCC_EXTRA_FLAGS": "-DX=1", "MPK_LINEAR_ROWS": "2"}
    assert os.environ.get("MPK_LINEAR_ROWS") == "4" and "MPK_NVCC_EXTRA_FLAGS" not in os.environ


@pytest.mark.parametrize("failed", [0, 2])
def test_prebuild_only_builds_and_stops_before_the_gpu(tune_sweep, monkeypatch, failed):
    """--prebuild-only hands the variants' distinct kernels to the prebuild (jobs default to the cores) and returns
    its verdict without opening a model on a GPU: the build machine of gpu_check.sh --ab-prebuild has none."""
    import os

    from mpk_dist import model_source
    from mpk_dist.runtime import prebuild

    calls = []
    monkeypatch.setattr(prebuild, "prebuild", lambda cases, jobs: calls.append((cases, jobs)) or failed)
    monkeypatch.setattr(model_source, "open_model", lambda *a, **k: pytest.fail("--prebuild-only opened a model"))
    rc = tune_sweep.main(["--model", "qwen3-0.6b", "--prompt-len", "200", "--output-len", "48", "--max-seq-len",
                          "320", "--prebuild-only", "--variants", "base;-DMPK_ROPE_NEAR=1;base"])
    assert rc == (1 if failed else 0)
    (cases, jobs), = calls
    assert jobs == min(os.cpu_count() or 1, 16)
    assert [c.env for c in cases] == [(), (("MPK_NVCC_EXTRA_FLAGS", "-DMPK_ROPE_NEAR=1"),)]
    assert {c.max_seq_len for c in cases} == {320}


def test_blocks_per_sm_variant_is_a_case_of_its_own(tune_sweep):
    """`i2` (two worker blocks per SM) sets MPK_BLOCKS_PER_SM and is a kernel of its own; `i2,k32` the same kernel
    with another program (32 KV ranges)."""
    variants = [(t, tune_sweep.parse_variant(t)) for t in ("base", "i2", "i2,k32")]
    assert variants[1][1] == ({"MPK_BLOCKS_PER_SM": "2"}, {})
    cases = tune_sweep.prebuild_cases(variants, "qwen3-0.6b", 1, 544)
    assert [(c.env, c.attn_splits) for c in cases] == [((), "auto"), ((("MPK_BLOCKS_PER_SM", "2"),), "auto"),
                                                       ((("MPK_BLOCKS_PER_SM", "2"),), 32)]


def test_record_level_switches_share_the_base_kernel(tune_sweep):
    """Switches that change only the task records or the launch (prebuild.TABLE_ONLY: w, g, h, x, z, e and the two
    named ones) are left out of a prebuild case's environment, so their variants build nothing of their own."""
    variants = [(t, tune_sweep.parse_variant(t)) for t in
                ("base", "MPK_PLAN_BEHIND_ATTENTION=1", "MPK_PREFETCH_NEXT_KB=256", "w0,g1,h1,x1,z1,e128",
                 "MPK_LAYER_ALIGNED_WORKERS=1", "MPK_PREFETCH_BEHIND_ATTENTION_KB=0",
                 "MPK_PREFETCH_NEXT_KB=256,u8")]
    cases = tune_sweep.prebuild_cases(variants, "qwen3-8b", 1, 544)
    assert [c.env for c in cases] == [(), (("MPK_LINEAR_UNROLL", "8"),)]


def test_table_only_names_every_record_level_switch():
    """prebuild.TABLE_ONLY maps each record-level Session keyword to the variable tuning_from_env reads it from."""
    from mpk_dist.runtime.megakernel_backend import tuning_from_env
    from mpk_dist.runtime.prebuild import TABLE_ONLY

    on = {"MPK_PREFETCH_PLAN": "0", "MPK_BULK_PREFETCH": "1", "MPK_PREFETCH_AHEAD": "1", "MPK_ATTN_STAGE_KV": "1",
          "MPK_MIN_CARVEOUT": "1", "MPK_PREFETCH_LEVEL_KB": "128", "MPK_PLAN_BEHIND_ATTENTION": "1",
          "MPK_PREFETCH_NEXT_KB": "256", "MPK_LAYER_ALIGNED_WORKERS": "1",
          "MPK_PREFETCH_BEHIND_ATTENTION_KB": "0", "MPK_MMA_PARTIAL_EXACT": "0"}
    for key, var in TABLE_ONLY.items():
        assert key in tuning_from_env(512, {var: on[var]}), (key, var)
    assert set(TABLE_ONLY.values()) == set(on)
