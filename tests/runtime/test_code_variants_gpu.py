"""GPU test of compile-time code variants designed to leave every sum as it is: each flag below (passed through
MPK_NVCC_EXTRA_FLAGS, which is part of the kernel's cache key) changes how the code is laid out or issued, never
the arithmetic, so the logits must equal the default build's bit for bit and stay within tolerance of torch.

- ``-DMPK_ATTN_GUARD_HEADS=1``: the attention walk's heads one after another, each behind its ``j < G`` branch
  (the default interleaves their warp sums; csrc/tasks/attention.cuh attn_warp_step).
- ``-DMPK_PARAMS_SMEM=0``: every block reads RuntimeParams from global memory instead of its shared-memory
  copy (csrc/runtime/megakernel.cuh).
- ``-DMPK_ROPE_EXACT_PAIRS=0 -DMPK_PREP_ONE_SITE=0``: the q/k norm + rope bodies with 8 pair slots for every head
  size and the prep's q and k heads through two inlined copies (the default instantiates the head size's pair
  count, csrc/tasks/common.cuh MPK_ROPE_PAIRS, and runs one copy, csrc/tasks/attention_prep.cuh).
- ``-DMPK_PREP_POS_LATE=0``: the split prep tile checks every position before its prep (the default reads the
  position inside the prep, beside the head's loads, and checks it after; csrc/runtime/dispatch.cuh).
- ``-DMPK_STAGE_ROWS_TOGETHER=0``: the generated fused bodies' staged path row by row (the default computes every
  batch row's norm statistic in one block reduction and issues several rows' operand loads before their stores;
  csrc/tasks/tile_primitives.cuh rows_sum_sq, stage_rows). Also at batch 8 under MPK_LINEAR_MMA=1.
- ``-DMPK_NORM_ROWS_IN_REGS=0``: the generated norm prologue above one row in two passes over the rows (the default
  reads them once where a thread's share of a row is one vector, each thread keeping its vectors in registers
  across the statistic; csrc/tasks/tile_primitives.cuh rows_share_sum_sq, the generated body's
  norm_linear_rows_in_regs), batch 4 and batch 8 on tensor cores; and the same prologue against the program without
  the norm fusion (the rms_norm task's statistic and rounding), batch 8.
- ``-DMPK_NORM_BF16X2=0``: every norm prologue's operand bf16(bf16(x * r) * g) in fp32 arithmetic (the default
  computes it in bf16x2, fused_gemv.cuh norm8_of, which tile_primitives.cuh scale_mul8 and the hand-written norm8 call):
  batch 1 (the one-round prologue's finish), batch 4 (the rows in registers) and batch 8 on tensor cores;
  ``-DMPK_ROW_TOTALS_BY_ONE=0``: every thread sums every row's warp partials (the default: thread b sums row b's and
  hands the total over; rows_block_sum). Batch 8 on tensor cores.
- ``-DMPK_ROPE_SINCOS=0``: the rope angle's cosine and sine from cosf and sinf (the default calls sincosf once;
  csrc/tasks/common.cuh rope_cos_sin).
- ``-DMPK_MERGE_LOADS_AHEAD=0``: the split-KV head merge's loop as it was, each range's acc and l loads behind its m
  test (the default unrolls 16 ranges and drops an empty range's sum by a select; csrc/tasks/attention_merge.cuh).
- ``-DMPK_PREFETCH_ONE_SITE=0``: each linear kind's L2 weight prefetch inlined in its own branch of prefetch_task
  (the default issues it from one non-inlined function; csrc/runtime/dispatch.cuh).
- ``-DMPK_SMALL_KINDS_OUTLINED=0``: the kinds without a run_* function of their own (step_begin, silu_mul, argmax,
  nucleus) inlined into the kernel entry (the default runs them in one non-inlined function, csrc/runtime/dispatch.cuh
  run_small_kind).
- ``-DMPK_SPLIT_PREP_SEQ_OUTLINED=0``: one sequence of a split prep tile inlined into the tile's function (the
  default at 256 threads runs it as a function of its own that reads its parameters again; csrc/runtime/dispatch.cuh
  split_prep_sequence). Batch 1 only runs split tiles (the attention is unsplit from batch 2).
- ``-DMPK_ATTN_PHASED_MERGE=1``: the unsplit attention's block merge with its phases' code, at one phase (csrc/tasks/
  attention.cuh attention_seq; batch 4 runs it, batch 1 is split); ``MPK_ATTN_MERGE_PHASES=2`` and ``=4`` (that kernel
  with less shared memory) merge the warps a slice at a time, batch 1 unsplit.
- ``-DMPK_ATTN_WALK_PREFETCH=1 -DMPK_ATTN_WALK_MARKS=1`` (off; a measurement variant): the unsplit tensor-core walk
  prefetches a block's value rows and the next block's key rows into L1 with its key loads, and stamps two trace
  marks (csrc/tasks/attention_mma_walk.cuh); batch 4 runs it (batch 1 is split there).
- ``-DMPK_MMA_X_AHEAD=0`` under MPK_LINEAR_MMA=1, batch 8: the tensor-core tile loads each x vector inside its
  mma loop (the default loads a round's x vectors right after its weights; csrc/tasks/linear_mma.cuh mma_unit).
- ``-DMPK_LINEAR_RESIDUAL_STAGE=1`` (off; a measurement variant): linear_residual tiles with 2-3 rows copy their x rows
  into shared memory before summing (csrc/tasks/linear_residual.cuh), batch 2 and 3 (batch 4 runs tensor-core tiles),
  with the silu epilogue asked for so that the down projection is a linear_residual too.

- The code-size variants (mpk_dist.runtime.codegen.CODE_SIZE_DEFINES, on together in batch-1 programs at unroll 4
  since v0.33: KernelShape.compact_code): ``-DMPK_ROPE_NEAR=1``, sincosf inlined only for rope angles up to 65,536
  with its large-argument path assumed away, larger angles through one non-inlined sincosf (csrc/tasks/common.cuh
  rope_cos_sin); ``-DMPK_ROWWISE_OUTLINED=1``, the fused bodies' per-element fallback (gemv_rowwise, never run when
  the staged rows fit) called instead of inlined (csrc/tasks/fused_gemv.cuh); ``-DMPK_STAGE_ROW_ROLLED=1``, the
  staging loop of a row's prologue not unrolled (fused_gemv.cuh stage_row, tile_primitives.cuh tile::stage_row).
  Batch 4 (off there): each flag against the default; batch 1 (qwen3-0.6b runs at unroll 4, so on): the switch
  ``MPK_COMPACT_CODE=0`` (all three off) against the default.
- ``-DMPK_NORM_ONE_ROUND=0``, batch 1: the norm prologue's two rounds (the default since v0.32 copies the norm weights
  into their staging slots before the row statistic, csrc/tasks/fused_gemv.cuh stage_row_fetch_first), and
  ``-DMPK_SUPEROPT_NORM_LINEAR=0``: the hand-written norm body's one-round prologue against the generated one's.
- ``-DMPK_LONG_ROWS=1``: one weight row a warp in the batch-1 fused tiles (the default since v0.32 sums 4 rows a warp
  at once with the whole unroll each in tiles of at least 4 rows a warp, csrc/tasks/fused_gemv.cuh gemv_rows).

- ``MPK_FLAG_WORDS=1`` and ``=2`` (off; measurement variants): the fp32 residual stream (=2: also the bf16 vectors
  o_proj and down read) handed over as flagged words (mpk_dist/taskgraph/flag_words.py: the producers also write
  (value, step tag) words, the next level's tiles poll them instead of waiting on their producers' event), batch 1
  and 2 (the silu epilogue asked for, so the down projection is a linear_residual there too): another program and
  kernel, the same sums.
- ``MPK_FUSE_SILU_EPI=0``: silu_mul in the down projection's prologue instead of the gate|up projection's epilogue
  (another program and kernel: fusion 'silu_epi' off), batch 1 (the epilogue is the default there) and 2 (asked for
  with MPK_FUSE_SILU_EPI=1).

qwen3-0.6b (default fusions and attention splits: split-KV at batch 1, unsplit at batch 4 since v0.28), 200-token
prompt, batch 1 and 4 (batch 4 on tensor cores, the default from 4 rows a tile; the MMA variants: batch 8).
Run: ``python -m pytest -q -m gpu tests/runtime/test_code_variants_gpu.py`` (about a minute on an H200 with the
kernels prebuilt).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from mpk_dist.runtime.testing import check_bitwise, forced_request, megakernel_with_env  # noqa: E402

torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
NAME = "qwen3-0.6b"
PROMPT = 200
STEPS = 48
VARIANTS = ["-DMPK_ATTN_GUARD_HEADS=1", "-DMPK_PARAMS_SMEM=0", "-DMPK_ROPE_EXACT_PAIRS=0 -DMPK_PREP_ONE_SITE=0",
            "-DMPK_PREP_POS_LATE=0", "-DMPK_STAGE_ROWS_TOGETHER=0", "-DMPK_ROPE_SINCOS=0", "-DMPK_PREFETCH_ONE_SITE=0",
            "-DMPK_SMALL_KINDS_OUTLINED=0", "-DMPK_MERGE_LOADS_AHEAD=0", "-DMPK_LONG_ROWS=1",
            "-DMPK_SPLIT_PREP_SEQ_OUTLINED=0", "-DMPK_ATTN_WALK_PREFETCH=1 -DMPK_ATTN_WALK_MARKS=1",
            "-DMPK_NORM_BF16X2=0", "-DMPK_ATTN_PHASED_MERGE=1"]
CODE_SIZE_VARIANTS = ["-DMPK_STAGE_ROW_ROLLED=1", "-DMPK_ROPE_NEAR=1", "-DMPK_ROWWISE_OUTLINED=1"]  # batch 4: off there
# kernel switches of the same kind (environment, not -D), batch 1; MPK_COMPACT_CODE=0: the code-size variants off
SWITCHES = [{"MPK_WEIGHT_EVICT_FIRST": "1"}, {"MPK_COMPACT_CODE": "0"}]
MMA_VARIANTS = ["-DMPK_MMA_X_AHEAD=0", "-DMPK_STAGE_ROWS_TOGETHER=0", "-DMPK_NORM_ROWS_IN_REGS=0", "-DMPK_NORM_BF16X2=0",
                "-DMPK_ROW_TOTALS_BY_ONE=0"]


def session_with_flags(backend, batch: int, flags: str):
    """``backend``'s session for ``batch``, its kernel built (or found in the cache) under MPK_NVCC_EXTRA_FLAGS =
    ``flags`` ('' = none): the build reads the variable when the session is made, not the backend."""
    from mpk_dist.runtime.megakernel_backend import scoped_env

    with scoped_env({"MPK_NVCC_EXTRA_FLAGS": flags}):
        return backend.session(batch)


@pytest.mark.parametrize("flags", VARIANTS)
@pytest.mark.parametrize("batch", [1, 4])
def test_code_variant_leaves_the_logits_bitwise(flags, batch, gpu_results):
    variant, default = megakernel_with_env(NAME, {"MPK_NVCC_EXTRA_FLAGS": flags}), megakernel_with_env(NAME, {})
    assert session_with_flags(variant, batch, flags).build.path != session_with_flags(default, batch, "").build.path, \
        f"{flags} did not make another binary"
    check_bitwise(f"{flags} vs default, {NAME} b{batch} prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, batch, 70), gpu_results)


@pytest.mark.parametrize("flags", CODE_SIZE_VARIANTS)
def test_code_size_variant_leaves_the_logits_bitwise(flags, gpu_results):
    """Batch 4, where the code-size variants are off by default (at batch 1 the switch MPK_COMPACT_CODE=0 below)."""
    variant, default = megakernel_with_env(NAME, {"MPK_NVCC_EXTRA_FLAGS": flags}), megakernel_with_env(NAME, {})
    assert f"#define {flags[2:].split('=')[0]} 1" not in default.session(4).source, "batch 4 builds it by default"
    assert session_with_flags(variant, 4, flags).build.path != session_with_flags(default, 4, "").build.path, \
        f"{flags} did not make another binary"
    check_bitwise(f"{flags} vs default, {NAME} b4 prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, 4, 70), gpu_results)


@pytest.mark.parametrize("flags", ["-DMPK_NORM_ONE_ROUND=0", "-DMPK_SUPEROPT_NORM_LINEAR=0"])
def test_norm_one_round_leaves_the_logits_bitwise(flags, gpu_results):
    """Batch 1 only: the variant's path is the batch-1 staged prologue (larger batches keep theirs)."""
    variant, default = megakernel_with_env(NAME, {"MPK_NVCC_EXTRA_FLAGS": flags}), megakernel_with_env(NAME, {})
    assert session_with_flags(variant, 1, flags).build.path != session_with_flags(default, 1, "").build.path, \
        f"{flags} did not make another binary"
    check_bitwise(f"{flags} vs default, {NAME} b1 prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, 1, 70), gpu_results)


@pytest.mark.parametrize("flags", MMA_VARIANTS)
def test_mma_variant_leaves_the_logits_bitwise(flags, gpu_results):
    mma = {"MPK_LINEAR_MMA": "1"}
    variant, default = megakernel_with_env(NAME, {**mma, "MPK_NVCC_EXTRA_FLAGS": flags}), megakernel_with_env(NAME, mma)
    assert session_with_flags(variant, 8, flags).build.path != session_with_flags(default, 8, "").build.path, \
        f"{flags} did not make another binary"
    assert "#define MPK_LINEAR_MMA 1" in default.session(8).source, "the default build is not the tensor-core one"
    check_bitwise(f"{flags} vs default, MPK_LINEAR_MMA=1, {NAME} b8 prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, 8, 70), gpu_results)


@pytest.mark.parametrize("env", SWITCHES, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_switch_leaves_the_logits_bitwise(env, gpu_results):
    """A kernel switch that changes only how bytes move or the code's size (MPK_WEIGHT_EVICT_FIRST: the weight loads'
    L2 policy; MPK_COMPACT_CODE=0: the code-size variants off) gives the default build's logits bit for bit, batch 1."""
    variant, default = megakernel_with_env(NAME, env), megakernel_with_env(NAME, {})
    assert variant.session(1).build.path != default.session(1).build.path, f"{env} did not make another binary"
    if "MPK_COMPACT_CODE" in env:  # the default batch-1 build at unroll 4 is the compact one, the variant not
        assert "#define MPK_ROPE_NEAR 1" in default.session(1).source
        assert "#define MPK_ROPE_NEAR 1" not in variant.session(1).source
    check_bitwise(f"{env} vs default, {NAME} b1 prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, 1, 70), gpu_results)


def test_norm_rows_in_regs_leaves_the_logits_bitwise_at_batch_4(gpu_results):
    """Batch 4 (the MMA_VARIANTS run it at batch 8): the norm prologue's two passes against the rows read once."""
    flags = "-DMPK_NORM_ROWS_IN_REGS=0"
    variant, default = megakernel_with_env(NAME, {"MPK_NVCC_EXTRA_FLAGS": flags}), megakernel_with_env(NAME, {})
    assert session_with_flags(variant, 4, flags).build.path != session_with_flags(default, 4, "").build.path, \
        f"{flags} did not make another binary"
    check_bitwise(f"{flags} vs default, {NAME} b4 prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, 4, 70), gpu_results)


def test_norm_rows_in_regs_equals_the_rms_norm_task(gpu_results):
    """Batch 8 on tensor cores: the fused norm prologue reading the rows once (the default) against the program
    without the norm fusion (MPK_FUSE_NORM=0: the rms_norm task, then plain linears): the same statistic order and
    rounding, so the same logits bit for bit."""
    mma = {"MPK_LINEAR_MMA": "1"}
    fused, plain = megakernel_with_env(NAME, mma), megakernel_with_env(NAME, {**mma, "MPK_FUSE_NORM": "0"})
    fused_kinds, plain_kinds = ({o["kind"] for o in b.session(8).cg.meta["ops"]} for b in (fused, plain))
    assert "norm_linear" in fused_kinds, sorted(fused_kinds)
    assert "rms_norm" in plain_kinds and "norm_linear" not in plain_kinds, sorted(plain_kinds)
    check_bitwise(f"MPK_FUSE_NORM=0 vs default, MPK_LINEAR_MMA=1, {NAME} b8 prompt {PROMPT}", NAME, plain, fused,
                  forced_request(NAME, PROMPT, STEPS, 8, 70), gpu_results)


def test_exact_partial_room_leaves_the_logits_bitwise(gpu_results):
    """The launch's exact room for the split-K partials (mpk_dist/runtime/mma_room.py, the default) is smaller than
    the fixed one (MPK_MMA_PARTIAL_EXACT=0) and every tensor-core tile takes the same slices in it: the same binary,
    the same logits bit for bit. Batch 8 on tensor cores with the silu epilogue, so plain, staged and pair tiles
    all run."""
    env = {"MPK_LINEAR_MMA": "1", "MPK_FUSE_SILU_EPI": "1"}
    exact, fixed = megakernel_with_env(NAME, env), megakernel_with_env(NAME, {**env, "MPK_MMA_PARTIAL_EXACT": "0"})
    a, b = exact.session(8), fixed.session(8)
    assert a.build.path == b.build.path, "a launch setting made another binary"
    assert a.smem < b.smem, f"the exact room ({a.smem} B) is not smaller than the fixed one ({b.smem} B)"
    assert "norm_linear_silu" in {o["kind"] for o in a.cg.meta["ops"]}
    check_bitwise(f"MPK_MMA_PARTIAL_EXACT=0 vs default, {env}, {NAME} b8 prompt {PROMPT}", NAME, fixed, exact,
                  forced_request(NAME, PROMPT, STEPS, 8, 70), gpu_results)


@pytest.mark.parametrize("phases", ["2", "4"])
def test_attention_merge_phases_leave_the_logits_bitwise(phases, gpu_results):
    """The unsplit attention tiles' block merge in phases (MPK_ATTN_MERGE_PHASES: the kernel with the phased merge,
    which takes the phases its shared memory holds) sums every output over the warps in the same order with the same
    factors as the default kernel's one-phase merge: less shared memory, the same logits bit for bit. Batch 1 unsplit
    (--attn-splits 1: the 8B presets' batch-1 form; at batch 4 the tensor-core tiles' room is larger than the merge)."""
    env = {"MPK_ATTN_MERGE_PHASES": phases}
    phased, default = megakernel_with_env(NAME, env, attn_splits=1), megakernel_with_env(NAME, {}, attn_splits=1)
    a, b = phased.session(1), default.session(1)
    assert "#define MPK_ATTN_PHASED_MERGE 1" in a.source and "MPK_ATTN_PHASED_MERGE" not in b.source
    assert a.smem < b.smem, f"{phases} phases ({a.smem} B) did not launch with less than one ({b.smem} B)"
    assert "attention_prep" in {o["kind"] for o in a.cg.meta["ops"]}
    check_bitwise(f"MPK_ATTN_MERGE_PHASES={phases} vs default, {NAME} b1 unsplit prompt {PROMPT}", NAME, phased,
                  default, forced_request(NAME, PROMPT, STEPS, 1, 70), gpu_results)


@pytest.mark.parametrize("batch", [1, 2])
def test_silu_epilogue_leaves_the_logits_bitwise(batch, gpu_results):
    """silu_mul as the gate|up projection's epilogue (norm_linear_silu tiles; the default at batch 1, asked for with
    MPK_FUSE_SILU_EPI=1 at batch 2) rounds where the gate|up linear and silu_mul round: MPK_FUSE_SILU_EPI=0's
    program (silu in the down tiles' prologue, a kernel with silu_linear instead) gives the same logits bit for bit."""
    epi = megakernel_with_env(NAME, {"MPK_FUSE_SILU_EPI": "1"} if batch > 1 else {})
    prologue = megakernel_with_env(NAME, {"MPK_FUSE_SILU_EPI": "0"})
    kinds = {o["kind"] for o in epi.session(batch).cg.meta["ops"]}
    assert "norm_linear_silu" in kinds and "silu_linear" not in kinds, sorted(kinds)
    assert "silu_linear" in {o["kind"] for o in prologue.session(batch).cg.meta["ops"]}
    check_bitwise(f"MPK_FUSE_SILU_EPI=0 vs default, {NAME} b{batch} prompt {PROMPT}", NAME, prologue, epi,
                  forced_request(NAME, PROMPT, STEPS, batch, 70), gpu_results)


@pytest.mark.parametrize("batch", [2, 3])
def test_staged_linear_residual_leaves_the_logits_bitwise(batch, gpu_results):
    """-DMPK_LINEAR_RESIDUAL_STAGE=1: the x rows staged in shared memory (o_proj, and down under the silu epilogue)
    give the default build's logits bit for bit."""
    flags, epi = "-DMPK_LINEAR_RESIDUAL_STAGE=1", {"MPK_FUSE_SILU_EPI": "1"}
    variant, default = megakernel_with_env(NAME, {**epi, "MPK_NVCC_EXTRA_FLAGS": flags}), megakernel_with_env(NAME, epi)
    assert session_with_flags(variant, batch, flags).build.path != session_with_flags(default, batch, "").build.path, \
        f"{flags} did not make another binary"
    assert "linear_residual" in {o["kind"] for o in default.session(batch).cg.meta["ops"]}
    check_bitwise(f"{flags} vs default, MPK_FUSE_SILU_EPI=1, {NAME} b{batch} prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, batch, 70), gpu_results)


@pytest.mark.parametrize("mode", ["1", "2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_flag_words_leave_the_logits_bitwise(batch, mode, gpu_results):
    """MPK_FLAG_WORDS=1: the residual stream's flagged copies (written by o_proj and down, polled by qkv, gate|up and
    the lm_head, read as the residual by the next o_proj and down) carry the values the plain buffers hold, so the
    logits equal the default build's bit for bit; =2 also the attention output (written by the head merge) and the
    gate|up product, polled by o_proj and down. Every layer's vectors are flagged and the polling tiles' records hold
    fewer waits."""
    epi = {"MPK_FUSE_SILU_EPI": "1"} if batch > 1 else {}
    variant, default = megakernel_with_env(NAME, {**epi, "MPK_FLAG_WORDS": mode}), megakernel_with_env(NAME, epi)
    sess = variant.session(batch)
    # =2 flags the head merge's output only where the attention is split (batch 1; unsplit from batch 2, v0.28)
    split = any(o["kind"] == "attention_split_prep" for o in sess.cg.meta["ops"])
    per_layer = 2 if mode == "1" else (4 if split else 3)
    assert len(sess.cg.meta["flag_words"]) == per_layer * sess.cg.meta["num_layers"] and sess.cg.meta["skip_waits"]
    assert "#define MPK_FLAG_WORDS 1" in sess.source and "MPK_FLAG_WORDS" not in default.session(batch).source
    check_bitwise(f"MPK_FLAG_WORDS={mode} vs default, {NAME} b{batch} prompt {PROMPT}", NAME, variant, default,
                  forced_request(NAME, PROMPT, STEPS, batch, 70), gpu_results)
