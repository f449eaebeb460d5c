"""The standalone GPU micro-benchmarks (csrc/bench/*.cu whose header says "Standalone"; scripts/gpu_check.sh --perf
runs them) compile for sm_90a with nvcc, so a device call does not spend its time on a build error. Their figures
come from the GPU. (comm_bench.cu is built by its driver with the layout defines; tests/bench/test_comm.py.)"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mpk_dist.runtime.build import CSRC

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
SOURCES = sorted(p.name for p in (CSRC / "bench").glob("*.cu") if "\n// Standalone (not built by the package)" in p.read_text())


def test_the_benchmarks_are_found():
    expected = {"sm_read_bw.cu", "event_wake.cu", "ll_boundary.cu", "sm_pairs.cu", "walk_probe.cu", "l2_steady_bw.cu"}
    assert expected <= set(SOURCES), SOURCES


@needs_nvcc
@pytest.mark.parametrize("name", SOURCES)
def test_benchmark_compiles_for_sm90a(name, tmp_path):
    out = tmp_path / (name + ".o")
    res = subprocess.run(["nvcc", "-c", "-O3", "-arch=sm_90a", "-o", str(out), str(CSRC / "bench" / name)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    assert out.stat().st_size > 0
