"""scripts/tune_sweep.py's row labels: the kernel shape each variant ran, read from the cubin the backend reports."""

from __future__ import annotations

from mpk_dist.runtime.codegen import KernelShape


def test_kernel_shape_name_is_the_shape_of_the_cubin(tune_sweep, tmp_path):
    """A variant's row names the shape it built (threads, rows, unroll): `r2` at a program's unroll 4 shows u4 beside
    r2, which is how two rows of two loads differ from two rows of four (docs/PERF.md v0.31)."""
    shape = KernelShape(batch=1, worker_threads=256, schedule="aot", linear_rows=2, linear_unroll=4, prefetch_kb=64)
    cubin = tmp_path / "kernels" / f"{shape.name()}-73ca850a04851f14d050f471ed2f42ff.cubin"
    assert tune_sweep.kernel_shape_name(str(cubin)) == shape.name() == "mk_b1_t256_aot_r2_u4_p64"
    assert tune_sweep.kernel_shape_name("") == "-"  # a backend that reports no cubin
    assert tune_sweep.kernel_shape_name(str(tmp_path / "trace.json")) == "-"
