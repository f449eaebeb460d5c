"""GPU tests of the tensor-core linear tiles (csrc/tasks/linear_mma.cuh, MPK_LINEAR_MMA=1). Their
summation order differs from the scalar tile's, so every check is tolerance-based, not bitwise:

- the tile alone (mpk_dist.bench.linear_alone.LinearTileKernel, one tile per block as the lowering
  tiles a linear) against torch's fp32 matmul for B in {2, 4, 8, 16} on qwen3-0.6b / qwen3-8b layer
  shapes, with and without split-K, with several (unit, slice) pairs a warp (192- and 48-row tiles),
  ragged tiles and K not a multiple of 32;
- qwen3-0.6b teacher-forced logits at batch 4 against torch (compare_logits), fused and unfused
  programs (every fused kind, hand-written or generated, reaches the MMA tile through fused_gemv.cuh's
  gemv_fused), and at batch 8 (fused, and fused with silu_mul as the gate|up epilogue: the pair tiles'
  halves and their sums in shared memory below the split-K partials);
- greedy tokens at batch 4 and 8 equal to torch's for 32 steps.

    python3 -m pytest -q -m gpu tests/runtime/test_linear_mma_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.backends.base import GenerateRequest  # noqa: E402
from mpk_dist.runtime.testing import MAX_SEQ, compare_logits, median, model, rand_ids, ref  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # the reference accumulates in fp32
BATCHES = (2, 4, 8, 16)
TOL = {torch.bfloat16: 4e-3, torch.float32: 1e-4}
"""max |y - ref| / max |ref|: a bf16 output is within half an ulp (2^-9 of its value) of the fp32 sum;
an fp32 output differs only by the summation order."""
_KERNELS: dict = {}
_BACKENDS: dict = {}


def kernel(batch: int, mma: bool):
    from mpk_dist.bench.linear_alone import LinearTileKernel

    if (batch, mma) not in _KERNELS:
        _KERNELS[batch, mma] = LinearTileKernel(batch, mma, threads=512)
    return _KERNELS[batch, mma]


def run_tile(k, x, w, tiles, out_dtype, smem: int | None = None):
    """y = the tile kernel over ``tiles`` [(n0, cols)]; ``smem`` overrides the dynamic shared memory
    (0: no room for split-K partials, so the tile runs unsplit)."""
    y = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=out_dtype)
    t = torch.tensor(tiles, dtype=torch.int32, device="cuda")
    saved = k.smem
    if smem is not None:
        k._set_smem(smem)
    k.launch(x, t, w, y)
    torch.cuda.synchronize()
    k._set_smem(saved)
    return y


def rel_err(y, ref) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def shapes():
    from mpk_dist.bench.linear_alone import matrix_shapes
    from mpk_dist.models.presets import get_preset

    out = []
    for name in ("qwen3-0.6b", "qwen3-8b"):
        for m, (N, K) in matrix_shapes(get_preset(name), 1).items():
            if m != "lm_head" or name == "qwen3-0.6b":
                out.append((f"{name}:{m}", N, K, torch.float32 if m == "lm_head" else torch.bfloat16))
    return out + [("ragged", 200, 4008, torch.bfloat16)]  # 13-column tiles, K % 32 != 0


@pytest.mark.parametrize("batch", BATCHES)
def test_mma_tile_matches_torch(batch, gpu_results):
    """Every shape: the MMA tile within TOL of torch, split-K (the lowering's tiles) and unsplit (72-row
    tiles, no shared memory for partials), like the scalar tile; and not the scalar tile's bits."""
    from mpk_dist.taskgraph.lowering import col_tiles

    g = torch.Generator(device="cuda").manual_seed(batch)
    worst, differs = 0.0, False
    for label, N, K, dt in shapes():
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
        x = torch.randn(batch, K, device="cuda", generator=g).bfloat16()
        ref = x.float() @ w.float().T
        tiles = [(c, min(13, N - c)) for c in range(0, N, 13)] if label == "ragged" else col_tiles(N, 132)
        big = [(c, min(72, N - c)) for c in range(0, N, 72)]  # 9 units >= half of 16 warps: MMA without split
        # 24 and 6 units (qwen3-8b batch-8 gate_up / qkv tiles): several (unit, slice) pairs a warp
        wide = [(c, min(192, N - c)) for c in range(0, N, 192)]
        narrow = [(c, min(48, N - c)) for c in range(0, N, 48)]
        outs = {"mma": run_tile(kernel(batch, True), x, w, tiles, dt),
                "mma unsplit": run_tile(kernel(batch, True), x, w, big, dt, smem=0),
                "mma 192-row": run_tile(kernel(batch, True), x, w, wide, dt),
                "mma 48-row": run_tile(kernel(batch, True), x, w, narrow, dt),
                "scalar": run_tile(kernel(batch, False), x, w, tiles, dt)}
        for variant, y in outs.items():
            assert torch.isfinite(y).all(), f"{label} b{batch} {variant}: unwritten or non-finite outputs"
            err = rel_err(y, ref)
            worst = max(worst, err) if variant != "scalar" else worst
            assert err <= TOL[dt], f"{label} N={N} K={K} b{batch} {variant}: rel err {err:.2e} > {TOL[dt]:g}"
        differs |= not torch.equal(outs["mma"], outs["scalar"])
    gpu_results.append({"case": f"mma tile rel err b{batch}", "max_err/std": f"{worst:.2e}", "ok": differs})
    assert differs, "the MMA kernel gave the scalar tile's bits on every shape: is the MMA path taken?"


def mk(fuse):
    """qwen3-0.6b mega-kernel with MPK_LINEAR_MMA=1 (cached; the env is read at construction). ``fuse``: True,
    False, or "epi" (fused, and its programs keep silu_mul as the gate|up epilogue: the pair tiles on tensor
    cores; the caller sets MPK_FUSE_SILU_EPI=1 while the programs are made)."""
    from mpk_dist.runtime.megakernel_backend import MegakernelBackend

    if fuse not in _BACKENDS:
        m = model("qwen3-0.6b")
        mp = pytest.MonkeyPatch()
        mp.setenv("MPK_LINEAR_MMA", "1")
        try:
            _BACKENDS[fuse] = MegakernelBackend(m.config, m.weights, device="cuda", max_seq_len=MAX_SEQ,
                                                fuse=bool(fuse))
        finally:
            mp.undo()
    return _BACKENDS[fuse]


@pytest.mark.parametrize("batch,fuse", [(4, True), (4, False), (8, True), (8, "epi")])
def test_teacher_forced_logits(batch, fuse, gpu_results, monkeypatch):
    """128 teacher-forced steps: logits within 3% of their std of torch's, argmax >= 99%."""
    vocab = model("qwen3-0.6b").config.vocab_size
    req = GenerateRequest([rand_ids(4, vocab, 2)] * batch, 129, force_tokens=rand_ids(128, vocab, 3), want_logits=True)
    if fuse == "epi":
        monkeypatch.setenv("MPK_FUSE_SILU_EPI", "1")
    b = mk(fuse)
    got = b.generate(req)
    assert "#define MPK_LINEAR_MMA 1" in b.session(batch).source, "the kernel that ran is not the MMA variant"
    kinds = {o["kind"] for o in b.group(batch).sessions[0].cg.meta["ops"]}
    assert ("norm_linear_silu" in kinds) == (fuse == "epi"), sorted(kinds)  # the pair tiles ran, or did not
    want = ref("qwen3-0.6b").generate(req)
    err, agree = compare_logits(got.logits, want.logits)
    gpu_results.append({"case": f"mma forced qwen3-0.6b b{batch} fuse={fuse}", "steps": got.logits.shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}",
                        "ms/token": f"{median(got.per_token_ms):.3f}", "ok": err <= 0.03 and agree >= 0.99})
    assert got.logits.shape[0] >= 128
    assert err <= 0.03, f"max |err| / std = {err:.4f} > 0.03"
    assert agree >= 0.99, f"argmax agreement {agree:.4f} < 0.99"


@pytest.mark.parametrize("batch", [4, 8])
def test_greedy_tokens(batch, gpu_results):
    """Greedy decoding with the MMA tiles: 32 tokens equal to torch's."""
    vocab = model("qwen3-0.6b").config.vocab_size
    req = GenerateRequest([rand_ids(8, vocab, 10 + b) for b in range(batch)], 32)
    got = mk(True).generate(req)
    want = ref("qwen3-0.6b").generate(req)
    same = got.tokens == want.tokens
    gpu_results.append({"case": f"mma greedy qwen3-0.6b b{batch}", "steps": 32, "tokens_equal": same,
                        "ms/token": f"{median(got.per_token_ms):.3f}", "ok": same})
    assert same, [(s, i, a, b) for s, (ta, tb) in enumerate(zip(got.tokens, want.tokens))
                  for i, (a, b) in enumerate(zip(ta, tb)) if a != b][:3]
