"""Code generation from chosen µGraphs (mpk_dist.superopt.codegen): the rendered CUDA bodies are
deterministic, name their µGraph ops, keep the hand-written kinds' ABI, build for sm_90a with nvcc,
and their logic (the µGraph, and the operand the generated body stages) matches the kinds' CPU
references."""

from __future__ import annotations

import copy
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mpk_dist.backends import torch_ops as T
from mpk_dist.superopt.codegen import KINDS, render, write_if_changed
from mpk_dist.superopt.codegen_emulate import operand
from mpk_dist.superopt.codegen_plan import CodegenError, plan
from mpk_dist.taskgraph.tasks.norm_linear import normed_rows
from mpk_dist.runtime.build import CSRC

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")
PATTERN = {"norm_linear": "rmsnorm_linear", "silu_linear": "silu_mul_linear"}


@pytest.fixture()
def best(results):
    """kind -> the chosen µGraph of its pattern (conftest's small-shape searches)."""
    return lambda kind: results(PATTERN[kind])[1].best


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_render_is_deterministic_readable_and_keeps_the_abi(best, kind, tmp_path):
    ug = best(kind)
    text = render(ug, kind)
    assert text == render(ug.to_dict(), kind), "rendering differs between the UGraph and its dict"
    assert f"__device__ void {kind}({KINDS[kind].signature}) {{" in text
    body_ops = ug.kernel_ops[0].block.body + ug.kernel_ops[0].block.post
    for op in body_ops:  # every µGraph op is named in a comment, with its origin
        assert f"{op.out} = " in text and f"# {op.origin}" in text, op.out
    path = tmp_path / "generated" / f"{kind}.cuh"
    assert write_if_changed(path, text) is True
    mtime = path.stat().st_mtime_ns
    assert write_if_changed(path, text) is False and path.stat().st_mtime_ns == mtime
    assert write_if_changed(path, text + "\n") is True and path.read_text() == text + "\n"


def test_norm_linear_body_lowers_the_post_division_to_a_row_factor(best):
    text = render(best("norm_linear"), "norm_linear")
    assert "tile::row_sum_sq(x + (size_t)b * ldx, K" in text
    assert "rsqrtf(((a3 / (float)K) + eps))" in text or "/ (float)K) + eps))" in text
    # the operand bf16(bf16(x r) g): x r rounded to bf16 before the weight multiply (tile::scale_mul8, every method)
    assert text.count("tile::scale_mul8(v_i0, r, ") == 3 and "round_bf(v_i0[e] * r)" not in text


def test_norm_operand_splits_its_parameter_load_for_the_one_round_prologue(best):
    """The norm_linear operand copies its one parameter (the norm weights) apart from the arithmetic
    (params_at / finish, for stage_row_fetch_first under MPK_NORM_ONE_ROUND) and keeps its one-step load8 (the
    default build's code: the row's loads, then the parameter's); the silu operand (no row factor) keeps one step
    and has no such branch."""
    text = render(best("norm_linear"), "norm_linear")
    assert "const bf16* params_at(int k) const { return i1 + k; }" in text
    finish = text[text.index("uint4 finish(uint4 p, int k, float r) const {"):]
    assert finish.index("tile::load8(i0 + k, v_i0);") < finish.index("return tile::scale_mul8(v_i0, r, p);")
    load8 = text[text.index("uint4 load8(int k) const {"):]
    assert load8.index("tile::load8(i0 + k, v_i0);") < load8.index("tile::load_param16(i1 + k)")
    assert "if constexpr (kB == 1 && MPK_NORM_ONE_ROUND) {" in text and "stage_row_fetch_first(st, K," in text
    silu = render(best("silu_linear"), "silu_linear")
    assert "params_at" not in silu and "MPK_NORM_ONE_ROUND" not in silu and "uint4 load8(int k) const {" in silu


def test_norm_prologue_reads_the_rows_once_above_one_row(best):
    """Above one row the staged norm prologue runs norm_linear_rows_in_regs where a thread's share of a row is one
    vector (MPK_NORM_ROWS_IN_REGS): a function of its own (not inlined) that loads the parameter's and every row's
    vector, sums the statistic from those registers and computes the operand from them (from_regs), with no second
    read of the rows; else, and under MPK_STAGE_ROWS_TOGETHER=0 or MPK_NORM_ROWS_IN_REGS=0, the two passes. The
    silu body (no statistic) has neither."""
    text = render(best("norm_linear"), "norm_linear")
    sig = "const float* x, int ldx, const bf16* nw, int K, float eps, float* smem, int tid, int nt"
    assert f"__device__ __noinline__ void norm_linear_rows_in_regs({sig}) {{" in text
    assert f"__device__ __forceinline__ void norm_linear_two_passes({sig}) {{" in text
    regs = text[text.index("void norm_linear_rows_in_regs("):]
    regs = regs[:regs.index("\n}\n")]
    order = ["tile::load_param16(", "tile::load8(x + (size_t)b * ldx + k, v[b]);",
             "tile::rows_share_sum_sq<kB>(v, mine, smem, r, tid, nt, factor);", "if (!mine) return;",
             "{x + (size_t)b * ldx, nw, r[b]}.from_regs(v[b], p);"]
    at = [regs.index(s) for s in order]
    assert at == sorted(at), at
    assert "ldx + k" not in regs[at[2]:] and "tile::load8" not in regs[at[2]:]  # the rows are not read again
    assert "uint4 from_regs(const float* v_i0, uint4 p) const {" in text
    # each row's factor computed by one thread inside the statistic's reduction (tile::rows_block_sum's finish),
    # in both prologues
    factor = "const auto factor = [&](float a3) { return rsqrtf(((a3 / (float)K) + eps)); };"
    assert text.count(factor) == 2 and factor in regs and "rsqrtf" not in regs[at[2]:]
    assert "tile::rows_sum_sq<kB>([&](int b) { return x + (size_t)b * ldx; }, K, smem, r, tid, nt, factor);" in text
    # the norm operand bf16(bf16(x * r) * g) in bf16x2 arithmetic (tile::scale_mul8: the same bits)
    assert "return tile::scale_mul8(v_i0, r, p);" in text
    staged = text[text.index("void norm_linear_staged("):]
    assert "} else if constexpr (kB > 1 && MPK_NORM_ROWS_IN_REGS && MPK_STAGE_ROWS_TOGETHER) {" in staged
    assert staged.index("if (tile::share_is_one_vector(K, nt))") < staged.index("norm_linear_rows_in_regs<kB>(x, ldx,")
    assert staged.count("norm_linear_two_passes<kB>(x, ldx, nw, K, eps, smem, tid, nt);") == 2
    silu = render(best("silu_linear"), "silu_linear")
    assert "rows_in_regs" not in silu and "from_regs" not in silu and "two_passes" not in silu


def test_unsupported_block_graph_is_a_clear_error(best):
    d = best("norm_linear").to_dict()
    bad = copy.deepcopy(d)
    bad["kernel_ops"][0]["block"]["grid"] = [["m", 2]]
    with pytest.raises(CodegenError, match="grid: expected one axis over the output columns"):
        plan(bad)
    bad = copy.deepcopy(d)
    bad["kernel_ops"][0]["block"]["accs"][0]["kind"] = "max"
    with pytest.raises(CodegenError, match="accumulators: expected sum"):
        plan(bad)
    with pytest.raises(CodegenError, match="expected the silu_mul_linear µGraph's inputs"):
        render(d, "silu_linear")
    with pytest.raises(CodegenError, match="kind: expected one of"):
        render(d, "linear")


TU = """#include <type_traits>
#include "norm_linear.cuh"
#include "silu_linear.cuh"
#include "generated/norm_linear.cuh"
#include "generated/silu_linear.cuh"
// The generated bodies have exactly the hand-written kinds' signatures (dispatch.cuh calls either).
static_assert(std::is_same<decltype(&mpk::norm_linear), decltype(&mpk::gen::norm_linear)>::value, "norm_linear ABI");
static_assert(std::is_same<decltype(&mpk::silu_linear), decltype(&mpk::gen::silu_linear)>::value, "silu_linear ABI");
extern "C" __global__ void probe(const float* x, const mpk::bf16* nw, const mpk::bf16* gu, const mpk::bf16* w,
                                 void* y, int K, int n) {
  extern __shared__ float smem[];
  const mpk::Epi epi{y, nullptr, n, mpk::kEpiBf16};
  mpk::gen::norm_linear(MPK_BATCH, x, K, nw, w, epi, K, n, 1e-6f, smem, threadIdx.x, blockDim.x);
  mpk::gen::silu_linear(MPK_BATCH, gu, 2 * K, K, w, epi, K, n, smem, threadIdx.x, blockDim.x);
}
"""


@needs_nvcc
@pytest.mark.parametrize("defines", [["-DMPK_BATCH=2"], ["-DMPK_BATCH=1", "-DMPK_NORM_ONE_ROUND=1"]],
                         ids=["b2", "b1-one-round"])
def test_generated_bodies_compile_for_sm90a(best, defines, tmp_path):
    """At batch 2, and at batch 1 with the norm prologue's parameter copies ahead of the statistic (the branch a
    batch-1 kernel with -DMPK_NORM_ONE_ROUND=1 instantiates)."""
    for kind in KINDS:
        write_if_changed(tmp_path / "generated" / f"{kind}.cuh", render(best(kind), kind))
    (tmp_path / "tu.cu").write_text(TU)
    out = tmp_path / "tu.cubin"
    # the rendered bodies first on the include path (csrc/tasks/generated holds the checked-in fallbacks)
    cmd = ["nvcc", "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", *defines,
           f"-I{tmp_path}", f"-I{CSRC / 'runtime'}", f"-I{CSRC / 'tasks'}", "-o", str(out), str(tmp_path / "tu.cu")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    blob = out.read_bytes()
    assert blob[:4] == b"\x7fELF" and b"probe" in blob and b"gemv_tile" in blob


def _feeds(ug, rng):
    """Random inputs at the µGraph's shapes: rows of scale 2, norm weights near 1, small weights."""
    loc = {"G": 1.0}
    scale = {"X": 2.0, "A": 2.0, "B": 1.0, "G": 0.3, "W": 0.05}
    return {k: rng.normal(loc.get(k, 0.0), scale[k], v.shape) for k, v in ug.inputs.items()}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_chosen_ugraph_computes_the_fused_kinds_reference(best, kind):
    """float64 µGraph vs the kind's CPU reference at fp32 (no bf16 rounding): same function."""
    ug = best(kind)
    feeds = _feeds(ug, np.random.default_rng(7))
    got = ug.evaluate(feeds)[0]
    t = {k: torch.tensor(v, dtype=torch.float32) for k, v in feeds.items()}
    if kind == "norm_linear":
        ref = T.linear(normed_rows(t["X"], t["G"], 1e-6), t["W"].T.contiguous())
    else:
        ref = T.linear(F.silu(t["A"]) * t["B"], t["W"].T.contiguous())
    np.testing.assert_allclose(got, ref.double().numpy(), rtol=1e-4, atol=1e-4 * np.abs(got).max())
    wrong = ref.clone()
    wrong[0, 0] += 1e-2 * np.abs(got).max()
    assert not np.allclose(got, wrong.double().numpy(), rtol=1e-4, atol=1e-4 * np.abs(got).max())


@pytest.mark.parametrize("K", [512, 4096])
def test_norm_operand_rounds_as_the_reference(best, K):
    """The staged operand the generated norm_linear computes (emulated) equals, bit for bit, the
    normalised rows the kind's reference feeds its linear, also at a K other than the search's."""
    p = plan(best("norm_linear").to_dict())
    g = torch.Generator().manual_seed(K)
    x = torch.randn(4, K, generator=g) * 3
    nw = (torch.randn(K, generator=g) * 0.5 + 1).bfloat16()
    ours = operand(p, {"X": x, "G": nw}, K)
    assert torch.equal(ours, normed_rows(x, nw, 1e-6))
    assert not torch.equal(operand(p, {"X": x, "G": nw}, K, eps=0.5), normed_rows(x, nw, 1e-6))


def test_silu_operand_rounds_as_the_reference(best):
    p = plan(best("silu_linear").to_dict())
    gu = (torch.randn(3, 2 * 384, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    ours = operand(p, {"A": gu[:, :384], "B": gu[:, 384:]}, 384)
    assert torch.equal(ours, F.silu(gu[:, :384]) * gu[:, 384:])

