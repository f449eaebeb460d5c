"""-DMPK_ROPE_NEAR=1 (csrc/tasks/common.cuh rope_cos_sin; a measurement variant, off): the inlined sincosf loses its
large-argument path (the double-precision reduction), which moves into the one non-inlined rope_cos_sin_far. Read off
the PTX of a probe kernel (nvcc -ptx; no GPU): without the define the probe itself holds f64 code, with it none, so
the __builtin_assume keeps folding the branch away with this nvcc. Its bits and speed are measured on the GPU
(test_code_variants_gpu.py, docs/PERF.md)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from mpk_dist.runtime.build import CSRC

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")

PROBE = """#include "common.cuh"
extern "C" __global__ void probe(const float* a, float* c, float* s) {
  float cc, ss;
  mpk::rope_cos_sin(a[threadIdx.x], cc, ss);
  c[threadIdx.x] = cc;
  s[threadIdx.x] = ss;
}
"""


def _ptx_functions(tmp_path, defines: list[str]) -> dict[str, str]:
    """{entry or function name: its PTX body} of the probe built with ``defines``."""
    src, out = tmp_path / "probe.cu", tmp_path / "probe.ptx"
    src.write_text(PROBE)
    res = subprocess.run(["nvcc", "-ptx", "-arch=sm_90a", "-std=c++17", *defines, f"-I{CSRC / 'tasks'}",
                          f"-I{CSRC / 'runtime'}", "-o", str(out), str(src)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    text = out.read_text()
    heads = list(re.finditer(r"^\.(?:visible )?\.?(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)", text, re.M))
    return {m.group(1): text[m.start():(heads[i + 1].start() if i + 1 < len(heads) else len(text))]
            for i, m in enumerate(heads)}


@needs_nvcc
def test_near_rope_inlines_no_large_argument_path(tmp_path):
    default = _ptx_functions(tmp_path, [])
    assert ".f64" in default["probe"], "the default sincosf no longer inlines its f64 path: this test reads nothing"
    near = _ptx_functions(tmp_path, ["-DMPK_ROPE_NEAR=1"])
    assert ".f64" not in near["probe"], "MPK_ROPE_NEAR=1: the inlined sincosf still holds its large-argument path"
    far = [name for name in near if "rope_cos_sin_far" in name]
    assert len(far) == 1 and ".f64" in near[far[0]], sorted(near)
