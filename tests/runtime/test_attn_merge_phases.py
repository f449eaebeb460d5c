"""The unsplit attention tiles' block merge in phases (MPK_ATTN_MERGE_PHASES; csrc/tasks/attention.cuh
attention_seq, attn_block_merge under MPK_ATTN_PHASED_MERGE): the host's shared-memory formula is the kernel's, the
kernel takes the fewest phases the launch's shared memory holds, the switch picks the kernel with the phased merge
(the default kernel keeps the one-phase code) and bad values are refused. The bits are checked on the GPU
(tests/runtime/test_code_variants_gpu.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import tables
from mpk_dist.runtime.build import CSRC
from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env, tuning_from_env
from mpk_dist.runtime.codegen import KernelShape, render_source
from mpk_dist.runtime.prebuild import TABLE_ONLY
from mpk_dist.runtime.session import kernel_shape
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.lowering_attention import ATTN_MERGE_PHASES, merge_smem_bytes

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")

SHAPES = [(nw, g, d) for nw in (4, 8, 16, 32) for g in (1, 2, 4, 8) for d in (64, 128, 256)]


def _fewest_phases(nwarps: int, G: int, D: int, nbytes: int) -> int:
    return next((p for p in ATTN_MERGE_PHASES if merge_smem_bytes(nwarps, G, D, p) <= nbytes), 0)


@needs_nvcc
def test_the_kernels_formula_and_phase_choice_are_the_hosts(tmp_path):
    """attention_merge_smem_bytes / attention_merge_phases compiled from csrc/tasks/attention.cuh (host side of their
    __host__ __device__ definitions) against lowering_attention.merge_smem_bytes over warps, heads, head sizes and
    shared-memory sizes, incl. the byte below and at each phase's need."""
    rows = []
    for nw, g, d in SHAPES:
        for p in ATTN_MERGE_PHASES:
            need = merge_smem_bytes(nw, g, d, p)
            rows += [(nw, g, d, p, need - 1), (nw, g, d, p, need)]
    table = ",\n".join("{%d, %d, %d, %d, %d}" % r for r in rows)
    src = tmp_path / "merge_phases.cu"
    src.write_text(f"""#include <cstdio>
#include "attention.cuh"
int main() {{
  const int rows[][5] = {{{table}}};
  for (const auto& r : rows)
    std::printf("%d %d\\n", mpk::attention_merge_smem_bytes(r[0], r[1], r[2], r[3]),
                mpk::attention_merge_phases(r[0], r[1], r[2], (unsigned)r[4]));
  return 0;
}}
""")
    exe = tmp_path / "merge_phases"
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-DMPK_ATTN_PHASED_MERGE=1", f"-I{CSRC / 'tasks'}",
                    f"-I{CSRC / 'runtime'}",
                    "-o", str(exe), str(src)], check=True, capture_output=True, text=True, timeout=300)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for (nw, g, d, p, nbytes), line in zip(rows, out):
        need, phases = map(int, line.split())
        assert need == merge_smem_bytes(nw, g, d, p), (nw, g, d, p)
        assert phases == _fewest_phases(nw, g, d, nbytes), (nw, g, d, p, nbytes)


def test_phases_cut_the_merge_and_keep_a_slot_per_phase():
    # qwen3-8b at 512 threads: 16 warps, 4 heads of 128: 33,280 B in one phase; 8 slots + (m, l) + running sums in
    # two; 4 slots in four
    assert merge_smem_bytes(16, 4, 128, 1) == 16 * 4 * 130 * 4 == 33280
    assert merge_smem_bytes(16, 4, 128, 2) == (8 * 4 * 130 + 16 * 4 * 2 + 4 * 128) * 4 == 19200
    assert merge_smem_bytes(16, 4, 128, 4) == (4 * 4 * 130 + 16 * 4 * 2 + 4 * 128) * 4 == 10880
    assert merge_smem_bytes(6, 2, 64, 4) == (2 * 2 * 66 + 6 * 2 * 2 + 2 * 64) * 4  # slots round up: ceil(6 / 4)
    with pytest.raises(ValueError, match="merge phases: expected one of"):
        merge_smem_bytes(16, 4, 128, 3)


def test_the_launch_shrinks_only_for_unsplit_attention():
    """qwen3-0.6b's unsplit program (attention_prep tiles, 256 threads) launches with the phased merge's bytes; its
    split program (the batch-1 default: attention_split_prep, another merge) does not change."""
    cfg, fuse = get_preset("qwen3-0.6b"), fusions_for_batch(fusions_from_env(), 1)  # the backend's fusions
    unsplit = compile_rank_programs(cfg, 1, batch=1, sms=132, max_seq_len=320, attn_splits=1, fuse=fuse)[0]
    assert "attention_prep" in {o["kind"] for o in unsplit.meta["ops"]}
    sizes = {p: tables.smem_bytes(unsplit, 256, attn_merge_phases=p) for p in ATTN_MERGE_PHASES}
    assert sizes[1] == 8 * 2 * 130 * 4
    assert sizes[1] > sizes[2] > sizes[4]
    assert sizes[4] >= merge_smem_bytes(8, 2, 128, 4)
    # Session and the prebuild ask kernel_shape, which picks the phased kernel for more than one phase
    assert kernel_shape(unsplit, 256, "aot", attn_merge_phases=4).attn_phased_merge
    assert not kernel_shape(unsplit, 256, "aot", attn_merge_phases=1).attn_phased_merge
    assert not kernel_shape(unsplit, 256, "aot").attn_phased_merge
    split = compile_rank_programs(cfg, 1, batch=1, sms=132, max_seq_len=320, attn_splits="auto", fuse=fuse)[0]
    assert "attention_prep" not in {o["kind"] for o in split.meta["ops"]}
    assert len({tables.smem_bytes(split, 256, attn_merge_phases=p) for p in ATTN_MERGE_PHASES}) == 1


def test_the_switch_picks_the_phased_kernel_with_clear_errors():
    assert "attn_merge_phases" not in tuning_from_env(None, environ={})
    assert tuning_from_env(None, environ={"MPK_ATTN_MERGE_PHASES": "4"})["attn_merge_phases"] == 4
    assert "attn_merge_phases" not in TABLE_ONLY  # it builds a kernel of its own (prebuild.py maps it to the shape)
    for bad in ("3", "x", "-1"):
        with pytest.raises(InputError, match=r"MPK_ATTN_MERGE_PHASES: expected one of 1, 2, 4 .*got"):
            tuning_from_env(None, environ={"MPK_ATTN_MERGE_PHASES": bad})
    phased, plain = KernelShape(batch=1, attn_phased_merge=True), KernelShape(batch=1)
    assert phased.name().endswith("_apm") and not plain.name().endswith("_apm")
    assert "#define MPK_ATTN_PHASED_MERGE 1" in render_source(phased)
    assert "MPK_ATTN_PHASED_MERGE" not in render_source(plain)  # the default kernel's source as before


def test_the_default_kernel_keeps_the_one_phase_merge():
    """MPK_ATTN_PHASED_MERGE defaults to 0: attention_seq as it was (one phase), kAttnMaxMergePhases 1, so the default
    kernel's code and its ptxas tripwires (tests/runtime/test_attn_prep_build.py) are unchanged until the GPU A/B."""
    text = (CSRC / "tasks" / "attention.cuh").read_text()
    assert "#ifndef MPK_ATTN_PHASED_MERGE\n#define MPK_ATTN_PHASED_MERGE 0\n#endif" in text
    assert "constexpr int kAttnMaxMergePhases = MPK_ATTN_PHASED_MERGE ? 4 : 1;" in text
    assert text.count("__device__ __noinline__ void attention_seq(") == 2
