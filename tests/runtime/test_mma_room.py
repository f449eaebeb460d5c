"""The launch's room for the tensor-core tiles' split-K partials (mpk_dist/runtime/mma_room.py), on the CPU: the
mirror of csrc/tasks/linear_mma.cuh mma_slices, the least room that keeps every tile's slices, and the constants
the mirror shares with the CUDA source. The GPU's bitwise check is tests/runtime/test_code_variants_gpu.py
(-k exact_partial)."""

import re
from pathlib import Path

import pytest

from mpk_dist.models.presets import get_preset
from mpk_dist.runtime import mma_room, tables
from mpk_dist.runtime.megakernel_backend import fusions_for_batch, fusions_from_env, tuning_from_env
from mpk_dist.taskgraph import fusion
from mpk_dist.taskgraph.compiler import compile_rank_programs

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "tasks"
THREADS, UNROLL = 512, 8  # the batch-8 kernels' (mk_b8_t512_..., MPK_LINEAR_UNROLL 8)


def _program(model, batch, silu_epi):
    env = {"MPK_FUSE_SILU_EPI": "1"} if silu_epi else {}
    fuse = fusions_for_batch(fusions_from_env(), batch, environ=env)
    return compile_rank_programs(get_preset(model), tp=1, batch=batch, sms=132, ranks=[0], fuse=fuse,
                                 max_seq_len=544)[0]


@pytest.fixture(scope="module")
def qwen3_8b_b8():
    return _program("qwen3-8b", 8, False)


@pytest.fixture(scope="module")
def qwen3_8b_b8_epi():
    return _program("qwen3-8b", 8, True)


def _slices(cg, dyn):
    return {t: mma_room.mma_slices(t[0], t[1], THREADS // 32, UNROLL, t[2], t[3], dyn) for t in mma_room.mma_tiles(cg)}


def _over(cg, dyn):
    """Per tile: whether its partials go over its operand rows at launch size ``dyn``."""
    return {t: mma_room.over_operand(t[1], t[2], S, dyn) for t, S in _slices(cg, dyn).items()}


def test_the_mirror_picks_the_documented_batch8_slices(qwen3_8b_b8):
    """docs/PERF.md v0.28: at qwen3-8b batch 8 the gate_up tiles (24 units) take 2 slices and the qkv tiles (6
    units) 8, 3 pairs a warp each, above the 64 KB of staged rows; o_proj and down (4 units, x from global memory) 4."""
    fixed = tables.smem_bytes(qwen3_8b_b8, THREADS, linear_mma=True, exact_partials=False)
    staged = 256 + 2 * 8 * 4096
    got = {(K, n): S for (K, n, _, _), S in _slices(qwen3_8b_b8, fixed).items()}
    assert got[(4096, 192)] == 2 and got[(4096, 48)] == 8
    assert got[(4096, 32)] == 4 and got[(12288, 32)] == 4
    assert {(K, n): r for K, n, r, _ in mma_room.mma_tiles(qwen3_8b_b8)}[(4096, 192)] == staged


def test_a_tile_takes_fewer_slices_when_its_partials_do_not_fit():
    """Below the room its 48 pairs need above 64 KB of staged rows, a gate_up-like tile falls back to one slice
    (more pairs than warps: the partials must sit above the staged rows); with one pair a warp they may go over."""
    staged, need2 = 65792, 24 * 2 * 512 + 16
    assert mma_room.mma_slices(4096, 192, 16, 8, staged, True, staged + need2) == 2
    assert mma_room.mma_slices(4096, 192, 16, 8, staged, True, staged + need2 - 1) == 1
    # 4 units x 4 slices = 16 pairs on 16 warps: allowed over the operand (over_ok); a pair tile may not, and one
    # slice keeps 4 of 16 warps streaming, so it runs the scalar tile (0)
    assert mma_room.mma_slices(4096, 32, 16, 8, 60000, True, 8208) == 4
    assert mma_room.mma_slices(4096, 32, 16, 8, 60000, False, 8208) == 0


@pytest.mark.parametrize("model,batch,silu_epi", [("qwen3-8b", 8, False), ("qwen3-8b", 8, True),
                                                  ("qwen3-0.6b", 8, False), ("qwen3-0.6b", 4, True),
                                                  ("llama3-8b", 4, False), ("qwen3-8b", 16, False)])
def test_the_exact_room_keeps_every_tiles_slices_in_no_more_bytes(model, batch, silu_epi):
    """Every tensor-core tile takes at the exact launch the slices it took at the fixed one (so the kernel sums in
    the same order: the same bits) and keeps its partials where they were (the same barriers), and the launch is no
    larger."""
    cg = _program(model, batch, silu_epi)
    fixed = tables.smem_bytes(cg, THREADS, linear_mma=True, exact_partials=False)
    exact = tables.smem_bytes(cg, THREADS, linear_mma=True)
    assert exact <= fixed
    assert _slices(cg, exact) == _slices(cg, fixed)
    assert _over(cg, exact) == _over(cg, fixed)
    assert any(S > 1 for S in _slices(cg, exact).values())  # the programs do split: the check is not vacuous


def test_the_exact_room_is_tight_where_the_partials_set_it(qwen3_8b_b8, qwen3_8b_b8_epi):
    """qwen3-8b batch 8: the launch is 88.4 KB (the fixed room: 96.4 KB), 91.4 KB with the silu epilogue (99.4 KB):
    with the kernel's 2.25 KB of static shared memory and the driver's 1 KB a block, the silu epilogue's program
    now fits the SM's 100 KB shared-memory step, where 32 KB more went to L1 (docs/PERF.md v0.45). One 128-byte
    step less and some tile would take fewer slices."""
    for cg, want, was in ((qwen3_8b_b8, 90496, 98688), (qwen3_8b_b8_epi, 93568, 101760)):
        exact = tables.smem_bytes(cg, THREADS, linear_mma=True)
        assert (exact, tables.smem_bytes(cg, THREADS, linear_mma=True, exact_partials=False)) == (want, was)
        assert _slices(cg, exact - 128) != _slices(cg, exact)


def test_the_switch_is_a_launch_setting():
    """MPK_MMA_PARTIAL_EXACT=0 reaches the Session as exact_partials=False; unset, nothing changes the tuning."""
    assert "exact_partials" not in tuning_from_env(None, environ={})
    assert tuning_from_env(None, environ={"MPK_MMA_PARTIAL_EXACT": "0"})["exact_partials"] is False


def test_the_mirror_shares_the_cuda_constants():
    """The mirror's constants are csrc/tasks/linear_mma.cuh's and fused_gemv.cuh's (a change there must show here)."""
    mma = (CSRC / "linear_mma.cuh").read_text()
    fused = (CSRC / "fused_gemv.cuh").read_text()

    def const(src, name):
        m = re.search(rf"constexpr \w+ {name} = (\d+);", src)
        assert m, name
        return int(m.group(1))

    assert const(mma, "kMmaPartialFloats") * 4 == tables.MMA_PARTIAL_BYTES
    assert const(mma, "kMmaPartialAlign") == mma_room.MMA_PARTIAL_ALIGN
    assert const(mma, "kMmaMaxSlices") == mma_room.MMA_MAX_SLICES
    assert const(fused, "kStageOffset") * 4 == fusion.STAGE_OFFSET_BYTES
    assert "const int units = (n_tile + 7) / 8, chunks = (K + 31) / 32;" in mma  # MMA_UNIT_ROWS, MMA_CHUNK
    assert "chunks / s >= MPK_LINEAR_UNROLL" in mma and "2 * min(units * S, nwarps) >= nwarps ? S : 0" in mma


def test_the_mirror_knows_every_caller_of_the_slice_choice():
    """The tiles mma_tiles models are the CUDA bodies that reach mma_slices: linear.cuh (reserved 0) and gemv_fused,
    called by the fused kinds' hand-written and generated bodies (reserved: their staged rows, or 0 for
    linear_residual's global x). A new caller passes bytes the mirror does not know: it must be added there first."""
    calls = {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.cuh") if "mma_slices(" in p.read_text()}
    assert calls == {"linear_mma.cuh", "linear.cuh", "fused_gemv.cuh"}
    fused = {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.cuh")
             if re.search(r"gemv_(fused|acc)<", p.read_text())}
    assert fused == {"norm_linear.cuh", "silu_linear.cuh", "linear_residual.cuh", "tile_primitives.cuh",
                     "generated/norm_linear.cuh", "generated/silu_linear.cuh"}
