#!/usr/bin/env bash
# Run every GPU test and the mega-kernel checks on a machine with an NVIDIA GPU; print a short
# table last. Usage: scripts/gpu_check.sh [--runtime-only] [--no-sanitizer] [--bench] [--fusion-only|--no-fusion]
#   --runtime-only  only tests/runtime (the mega-kernel), not every gpu-marked test of the repo
#   --no-sanitizer  skip compute-sanitizer memcheck/racecheck on the 2-layer model
#   --bench         also run mpk-dist bench on qwen3-0.6b (megakernel vs torch-graph/compile)
#   --fusion-only   only the fused-linear section (tests/runtime/test_fusion_gpu.py, bench and trace
#                   with --fuse vs --no-fuse); --no-fusion skips that section. Limit: FUSION_LIMIT
#   --tp            ONLY the tensor-parallel checks (bounded, ~9 min): tp 2/4 local transport
#                   (tests/runtime/test_megakernel_tp_gpu.py), ipc transport under launch/mpirun.sh with
#                   a private MPS (test_megakernel_ipc_gpu.py, tests/comm IPC) and
#                   mpk-dist bench --tp 2 --transport local (exposed_comm_share). Limits (s): TP_LIMIT,
#                   IPC_LIMIT, TP_BENCH_LIMIT. Without --tp those two test files are left out.
#   --attn-split-only  only the split-KV attention section (tests/runtime/test_attn_split_gpu.py and a
#                   qwen3-0.6b bench with --attn-splits auto vs 1); --no-attn-split skips it. Limit: ATTN_LIMIT
#   --extras-only   only the newer sections: sampling, superoptimized bodies, MMA linear tiles +
#                   bench-linear (scalar, mma, tma, pipe), paged serving, the linear load variants designed
#                   bit-identical (MPK_LINEAR_TMA weight stream, MPK_LINEAR_PIPE pipelined loads), the attn_prep fusion, batch 32/64 row blocks, serving TTFT at 128/1024/4096-token
#                   prompts (+ persistent passes), and (2+ GPUs) bench-comm;
#                   --no-extras skips them.
#                   Limit per section: EXTRA_LIMIT
#   --all-gpus      one copy of this check per visible GPU side by side, the steps split between them
#                   (GPU_SPLIT below), after one install and one kernel prebuild; not with --tp
#   --perf          ONLY the issue-6 speed table: `mpk-dist bench --backend megakernel,torch-compile` at
#                   context ~512 for qwen3-8b, llama3-8b, qwen3-1.7b, qwen3-0.6b (batch 1) and qwen3-8b batch 8
#                   (tensor-core tiles, the default from batch 3), the cold and warm start-up, what 132 SMs read from HBM and from L2
#                   (csrc/bench/sm_read_bw.cu), how soon the SMs waiting on an event see its last signal, by polling
#                   method (csrc/bench/event_wake.cu), what a level boundary costs with the kernel's event and with
#                   flagged data words (csrc/bench/ll_boundary.cu), the knob sweep of the newest levers on qwen3-8b (PERF_VARIANTS,
#                   default "base;j0;u8;k9;y0;x1;z1;k1": silu in the down tiles' prologue instead of the gate|up tiles'
#                   epilogue (MPK_FUSE_SILU_EPI=0), 8 loads in flight per lane instead of the program's 16 (MPK_LINEAR_UNROLL),
#                   9 KV ranges instead of 16 (v0.13's split), the batch-1 x vectors loaded in the sum loop (MPK_LOAD_AHEAD=0), the
#                   split tiles' cache rows staged in shared memory (MPK_ATTN_STAGE_KV=1), the smallest
#                   shared-memory carveout (MPK_MIN_CARVEOUT=1), split-KV attention off), traced qwen3-8b runs at
#                   context ~480 (batch 1 and batch 8) with their trace-summary, and with NCU=1 an ncu profile per source line (scripts/ncu_lines.py).
#                   Limit per step: PERF_LIMIT
#   --ab            ONLY the A/B of the open code variants (docs/PERF.md leads): how soon waiting SMs see an event
#                   (csrc/bench/event_wake.cu, idle and --load), a level boundary's cost (csrc/bench/ll_boundary.cu) and
#                   what 132 SMs read from HBM and from L2 (csrc/bench/sm_read_bw.cu: on an H100 the ratio decides the
#                   open A/B) and what they read steadily within one launch by loads and by bulk copies
#                   (csrc/bench/l2_steady_bw.cu), what the unsplit attention walk's loads cost one SM (csrc/bench/walk_probe.cu),
#                   then per model of AB_MODELS (default qwen3-8b) at batch AB_BATCH (default 8)
#                   scripts/tune_sweep.py over AB_VARIANTS run twice in one process (its kernels prebuilt in parallel,
#                   AB_JOBS processes), then the variants' bitwise GPU tests (test_code_variants_gpu.py -k AB_TESTS).
#                   AB_WAKE=0 skips the two benches, AB_PROBES=0 the four probes (SM pairs, read bandwidth, steady reads, walk),
#                   AB_TESTS=none the tests, AB_BLOCKS=0 the two-blocks-per-SM tests
#                   (one call is 600 s: ~9 min for all of it).
#                   Limit per step: AB_LIMIT
#   --ab-prebuild   NO GPU: build the kernels of --ab (the sweeps' variants per AB_MODELS, and the bitwise tests' kernels
#                   AB_TEST_KERNELS names) into $MPK_CACHE_DIR and stop. Run it on the build machine with MPK_CACHE_DIR set to a
#                   folder that travels with the tree to the GPU machine (e.g. .kc, git-ignored; AB_PACK=.kc.tar.xz packs
#                   it), then --ab there with the same MPK_CACHE_DIR: its prebuild steps find every kernel (~30 s of
#                   nvcc each otherwise). The cache key holds nvcc's version (13.0.88 on both machines so far); a
#                   mismatch only rebuilds.
# Two GPUs: GPU_SPLIT=K/N splits one check's steps over N copies of this script (see below; not for --tp,
# whose ipc step wants both GPUs), or run two copies side by side, e.g. CUDA_VISIBLE_DEVICES=0 ... --runtime-only and
# CUDA_VISIBLE_DEVICES=1 ... --fusion-only, each with its own OUT and MPK_CACHE_DIR and MPK_SKIP_INSTALL=1.
# Logs and JSON go to $OUT (or ./gpu_check_out). Time limits (s): PYTEST_LIMIT, SAN_LIMIT, TRACE_LIMIT;
# PYTEST_K selects tests (pytest -k), SKIP_TRACE=1 skips the traced qwen3-0.6b run.
set -u
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPK_CACHE_DIR=${MPK_CACHE_DIR:-/tmp/mpk_cache}
# pytest keeps this cache too (tests/conftest.py): each test process would otherwise rebuild every kernel
# (~20 s of nvcc each) and redo the superoptimizer searches (qk_norm_rope: 30 s per shape).
export MPK_TEST_CACHE_DIR=${MPK_TEST_CACHE_DIR:-$MPK_CACHE_DIR}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RUNTIME_ONLY=0; SANITIZE=1; BENCH=0; FUSION=1; FUSION_ONLY=0; TP=0; ATTN=1; EXTRAS=1; PERF=0; ALL_GPUS=0; AB=0; AB_PREBUILD=0
PASS_ON=()  # the options a copy started by --all-gpus gets
for a in "$@"; do
  [ "$a" = --all-gpus ] || PASS_ON+=("$a")
  case "$a" in
    --all-gpus) ALL_GPUS=1 ;;
    --runtime-only) RUNTIME_ONLY=1 ;;
    --no-sanitizer) SANITIZE=0 ;;
    --bench) BENCH=1 ;;
    --fusion-only) FUSION_ONLY=1 ;;
    --no-fusion) FUSION=0 ;;
    --tp) TP=1 ;;
    --attn-split-only) FUSION_ONLY=1; FUSION=0 ;;  # skips the main and fusion sections
    --no-attn-split) ATTN=0 ;;
    --extras-only) FUSION_ONLY=1; FUSION=0; ATTN=0; EXTRAS=1 ;;
    --no-extras) EXTRAS=0 ;;
    --perf) PERF=1 ;;
    --ab) AB=1 ;;
    --ab-prebuild) AB_PREBUILD=1 ;;
    *) echo "gpu_check.sh: unknown option $a (expected --all-gpus, --runtime-only, --no-sanitizer, --bench, --fusion-only, --no-fusion, --tp, --attn-split-only, --no-attn-split, --extras-only, --no-extras, --perf, --ab, --ab-prebuild)" >&2; exit 2 ;;
  esac
done
# --ab's variants (docs/PERF.md v0.33: the code-size variants off where they are on (o0), the v0.32 defaults' old
# paths, the attention split count (k8, k32) and staged cache rows (x1), 2 rows x 8 loads; session 38: the residual
# stream as flagged words (q1, polled back to back and with the wait's 32 ns sleep; q2 also the bf16 vectors) and the
# kernels of its bitwise tests (test_code_variants_gpu.py's model, batch 1, testing.MAX_SEQ = 320: the default build and each flag set the
# tests of AB_TESTS compare with it).
# Session 42: two worker blocks per SM (i2) measured slower (docs/PERF.md v0.37). Session 43 (v0.38, H100): u8 +6%,
# 6-row long tiles even, the shared-memory weight ring primed before the wait (b1) +45%, the whole-tile L2 prefetch
# cap (p128) +1.7%, pipelined one-row loads (l1) +14% at qwen3-0.6b. Session 44 (v0.39, H100, the 8B presets at
# batch 1): the whole-tile o_proj plan behind their 8 unsplit attention tiles (MPK_PLAN_BEHIND_ATTENTION=1) even, the
# gate|up heads prefetched during o_proj's wait (MPK_PREFETCH_NEXT_KB=128 / 256, also with d1) within +0.4 / -0.3%
# (sm_read_bw above: 132 SMs read L2 only ~10% faster than HBM there), split-KV 2-16 ranges 2.6-9% slower (with the
# tensor-core split walk, -DMPK_ATTN_SPLIT_MMA_WALK=1, still 1.6% slower at best), the same workers for an op in every
# layer (MPK_LAYER_ALIGNED_WORKERS=1) and d1 within -0.2%. Session 48 (v0.43, H100, qwen3-8b batch 8): the silu
# epilogue (j1) +4.3%; the norm prologue's two passes ~2.4% each (side branch diag-norm-prologue). Session 50 (v0.45,
# H100, qwen3-8b batch 8): the norm weights copied before the rows' statistic +0.9%, the rows copied into shared memory
# +3.9% (both removed since). Session 51 (v0.46, H100, qwen3-8b batch 8): the norm prologue's rows read once
# (MPK_NORM_ROWS_IN_REGS, the default now) -0.6 / -0.75% against the two passes; the silu epilogue (j1) in the exact
# split-K partial room still +2.8%. Session 52 (v0.47, H100, qwen3-8b batch 8): the prologue's operand in bf16x2
# (MPK_NORM_BF16X2) and its rows' totals and factors by one thread (MPK_ROW_TOTALS_BY_ONE) -0.9% each against either
# off. Session 53 (v0.48, H100, qwen3-8b batch 8): the prologue's row reads taken away (a diagnostic on a side tree)
# +0.1 / +0.5%: not the critical path, so the cluster-shared reads were not built. Session 55 (v0.50, H100,
# qwen3-8b batch 1): the o_proj tiles behind attention through a 2-stage bulk-copy ring +11% (removed; readable at
# d393188). Session 56 (v0.51, not run: no machine came): the unsplit attention tiles' block merge in 4 / 2 phases
# (MPK_ATTN_MERGE_PHASES: the kernel with the phased merge), so the 8B presets' batch-1 launch drops to the 16 / 32 KB
# carveout step, against the default kernel and the phased code at one phase (-DMPK_ATTN_PHASED_MERGE=1), and with
# MPK_MIN_CARVEOUT=1. The default below is that A/B, with its bitwise tests (qwen3-0.6b batch 1 unsplit: k1; the
# phased code at one phase, batches 1 and 4);
# session 52's was AB_VARIANTS="base;-DMPK_NORM_BF16X2=0;-DMPK_ROW_TOTALS_BY_ONE=0" AB_BATCH=8 with AB_TESTS="ROWS_IN_REGS
# or rows_in_regs or BF16X2 or ROW_TOTALS or equals_the_rms_norm_task" and AB_TEST_KERNELS="8:m1;m1,-DMPK_NORM_BF16X2=0;
# m1,-DMPK_ROW_TOTALS_BY_ONE=0;m1,MPK_FUSE_NORM=0|4:base;-DMPK_NORM_ROWS_IN_REGS=0". Every variant above still in the
# code was measured (docs/PERF.md v0.32-v0.50) and stays reachable through AB_VARIANTS, AB_MODELS and AB_BATCH
# (AB_MODELS=qwen3-0.6b AB_BATCH=1 for the small-preset ones; AB_TESTS="one_round or ..." for their bitwise tests).
AB_VARIANTS=${AB_VARIANTS:-"base;MPK_ATTN_MERGE_PHASES=4;-DMPK_ATTN_PHASED_MERGE=1;MPK_ATTN_MERGE_PHASES=2;MPK_ATTN_MERGE_PHASES=4,MPK_MIN_CARVEOUT=1"}
AB_MODELS=${AB_MODELS:-"qwen3-8b llama3-8b"}
AB_BATCH=${AB_BATCH:-1}
# AB_TEST_KERNELS: the bitwise tests' qwen3-0.6b kernel variants to prebuild, groups "BATCH:V1;V2;..." joined by
# "|" (a group without "BATCH:" is batch 1; session 38-47's were "base;-DMPK_NORM_ONE_ROUND=0;
# -DMPK_SUPEROPT_NORM_LINEAR=0;-DMPK_LONG_ROWS=1;o0;q1"; session 50's "8:m1,j1;m1,j1,MPK_MMA_PARTIAL_EXACT=0"); none:
# none. The default: the v0.47 prologue's tests (batch 8 on tensor cores with each switch off and without the norm
# fusion; batch 4 with and without the rows in registers).
AB_TEST_KERNELS=${AB_TEST_KERNELS:-"base;k1;k1,MPK_ATTN_MERGE_PHASES=4;-DMPK_ATTN_PHASED_MERGE=1|4:base;-DMPK_ATTN_PHASED_MERGE=1"}
if [ $AB_PREBUILD -eq 1 ]; then
  mkdir -p "$MPK_CACHE_DIR"
  rc=0
  for m in $AB_MODELS; do
    echo "== --ab-prebuild: $m batch $AB_BATCH, the sweep's variants (max_seq_len 544)"
    python3 scripts/tune_sweep.py --model "$m" --batch "$AB_BATCH" --prompt-len 480 --output-len 64 --prebuild-only \
      ${AB_JOBS:+--prebuild-jobs "$AB_JOBS"} --variants "$AB_VARIANTS" || rc=1
  done
  if [ "${AB_TESTS:-}" != none ] && [ -n "$AB_TEST_KERNELS" ] && [ "$AB_TEST_KERNELS" != none ]; then
    IFS='|' read -r -a groups <<< "$AB_TEST_KERNELS"
    for g in "${groups[@]}"; do
      b=1; v=$g
      case "$g" in [0-9]*:*) b=${g%%:*}; v=${g#*:} ;; esac
      echo "== --ab-prebuild: qwen3-0.6b batch $b, the bitwise tests' kernels (max_seq_len 320)"
      python3 scripts/tune_sweep.py --model qwen3-0.6b --batch "$b" --prompt-len 200 --output-len 48 --max-seq-len 320 \
        --prebuild-only ${AB_JOBS:+--prebuild-jobs "$AB_JOBS"} --variants "$v" || rc=1
    done
  fi
  echo "--ab-prebuild: $(du -sh "$MPK_CACHE_DIR" | cut -f1) in $MPK_CACHE_DIR"
  # AB_PACK=FILE.tar.xz: the cache in one archive (cubins shrink ~7x: 1.8 MB -> 0.24 MB), for a carry limit; on the
  # GPU machine `mkdir -p D && tar xJf FILE.tar.xz -C D` and MPK_CACHE_DIR=D.
  if [ -n "${AB_PACK:-}" ]; then
    tar cJf "$AB_PACK" -C "$MPK_CACHE_DIR" . || rc=1
    echo "--ab-prebuild: packed into $AB_PACK ($(du -h "$AB_PACK" | cut -f1))"
  fi
  exit $rc
fi
# Kernels to prebuild (scripts/prebuild_kernels.py): the --perf benches' (four models at batch 1, qwen3-8b at batch 8:
# a second prebuild, so the other models' batch-8 kernels are not built for nothing), else its defaults (the GPU tests').
PREBUILD_ARGS=(); PREBUILD_ARGS_B8=()
if [ $PERF -eq 1 ]; then
  PREBUILD_ARGS=(--models qwen3-8b,llama3-8b,qwen3-1.7b,qwen3-0.6b --batches 1 --schedules aot --tp 1 --attn-splits auto)
  PREBUILD_ARGS_B8=(--models qwen3-8b --batches 8 --schedules aot --tp 1 --attn-splits auto)
fi
# --all-gpus: install and prebuild once, then one copy per visible GPU, each running every N-th step
# (GPU_SPLIT), side by side; their summaries follow. Not with --tp (its ipc step wants every GPU).
if [ $ALL_GPUS -eq 1 ]; then
  [ $TP -eq 0 ] || { echo "gpu_check.sh: --all-gpus does not split --tp (its ipc step uses every GPU)" >&2; exit 2; }
  N=$(nvidia-smi -L | wc -l)
  [ "${MPK_SKIP_INSTALL:-0}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || { cat "$OUT/install.log"; exit 1; }
  if [ "${PREBUILD:-1}" = 1 ]; then
    python3 scripts/prebuild_kernels.py "${PREBUILD_ARGS[@]}" > "$OUT/prebuild.log" 2>&1
    [ ${#PREBUILD_ARGS_B8[@]} -eq 0 ] || python3 scripts/prebuild_kernels.py "${PREBUILD_ARGS_B8[@]}" >> "$OUT/prebuild.log" 2>&1
  fi
  tail -n 1 "$OUT/prebuild.log" 2>/dev/null
  for k in $(seq 0 $((N - 1))); do
    CUDA_VISIBLE_DEVICES=$k GPU_SPLIT=$k/$N OUT="$OUT/gpu$k" PREBUILD=0 MPK_SKIP_INSTALL=1 \
      bash "$0" "${PASS_ON[@]}" > "$OUT/gpu$k.log" 2>&1 &
  done
  wait
  for k in $(seq 0 $((N - 1))); do echo "==================== GPU $k ===================="; sed -n '/====================/,$p' "$OUT/gpu$k.log"; done
  exit 0
fi
declare -A STATUS
# GPU_SPLIT=K/N: run only every N-th step starting at K (the prebuild always), so N copies of this script
# on N GPUs (CUDA_VISIBLE_DEVICES, own OUT, same MPK_CACHE_DIR) share one check, e.g. on two GPUs:
#   GPU_SPLIT=0/2 CUDA_VISIBLE_DEVICES=0 OUT=o0 scripts/gpu_check.sh & GPU_SPLIT=1/2 CUDA_VISIBLE_DEVICES=1 OUT=o1 ...
GPU_SPLIT=${GPU_SPLIT:-0/1}; SPLIT_K=${GPU_SPLIT%/*}; SPLIT_N=${GPU_SPLIT#*/}
case "$SPLIT_K/$SPLIT_N" in
  [0-9]*/[1-9]*) [ "$SPLIT_K" -lt "$SPLIT_N" ] || { echo "GPU_SPLIT: expected K/N with K < N, got $GPU_SPLIT" >&2; exit 2; } ;;
  *) echo "GPU_SPLIT: expected K/N (e.g. 0/2), got $GPU_SPLIT" >&2; exit 2 ;;
esac
STEP_NO=0
step() {  # step NAME TIMEOUT_S CMD...: run with a time limit, log to $OUT/NAME.log, record pass/fail
  local name=$1 limit=$2; shift 2
  if [ "${name#prebuild}" = "$name" ]; then  # prebuild steps run in every copy
    STEP_NO=$((STEP_NO + 1))
    if [ $(( (STEP_NO - 1) % SPLIT_N )) -ne "$SPLIT_K" ]; then STATUS[$name]="other part (GPU_SPLIT)"; return 0; fi
  fi
  local t0=$(date +%s)
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1  # INT first: pytest still prints what failed
  local rc=$?
  STATUS[$name]="$([ $rc -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)") $(( $(date +%s) - t0 ))s"
  tail -n 25 "$OUT/$name.log"
}
summary() {  # summary TITLE JSON...: the result rows of the GPU tests (missing files skipped), then each step's status
  local title=$1; shift
  echo
  echo "==================== $title ===================="
  python3 - "$@" <<'PY'
import json, sys
rows = []
for path in sys.argv[1:]:
    try:
        rows += json.load(open(path))
    except (OSError, ValueError):
        pass
keys = ["case", "steps", "max_err/std", "argmax_agree", "tokens_equal", "ms/token", "ok"]
print(f"{keys[0]:<34}" + "".join(f"{k:>13}" for k in keys[1:]))
for r in rows:
    print(f"{str(r.get('case')):<34}" + "".join(f"{str(r.get(k, '-')):>13}" for k in keys[1:]))
PY
  for k in "${!STATUS[@]}"; do printf '%-14s %s\n' "$k" "${STATUS[$k]}"; done | sort
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# MPK_SKIP_INSTALL=1: the caller installed already (two copies of this script run side by side, one per GPU).
if [ "${MPK_SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
fi
python3 -c "import torch, cuda.bindings; print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__)"

# --ab: this section only (tune_sweep prebuilds the variants' kernels itself), then the summary.
if [ $AB -eq 1 ]; then
  [ "${AB_WAKE:-1}" = 1 ] && step ab_event_wake "${AB_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/event_wake csrc/bench/event_wake.cu \
    && $OUT/event_wake && $OUT/event_wake --load"
  [ "${AB_WAKE:-1}" = 1 ] && step ab_ll_boundary "${AB_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/ll_boundary csrc/bench/ll_boundary.cu \
    && $OUT/ll_boundary && $OUT/ll_boundary --load && $OUT/ll_boundary --load --n 4096"
  # Where the hardware puts two blocks per SM (whether blockIdx.x alone would pair them as worker_index.cuh does).
  [ "${AB_PROBES:-1}" = 1 ] && step ab_sm_pairs "${AB_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/sm_pairs csrc/bench/sm_pairs.cu && $OUT/sm_pairs"
  # What 132 SMs read from HBM and from L2 on this GPU (the open A/B pays only where L2 is much the faster).
  [ "${AB_PROBES:-1}" = 1 ] && step ab_read_bw "${AB_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/sm_read_bw csrc/bench/sm_read_bw.cu \
    && for m in hbm l2; do $OUT/sm_read_bw \$([ \$m = l2 ] && echo --l2) > $OUT/sm_read_bw_\$m.log \
    && grep -E 'reading|per block|^ 132' $OUT/sm_read_bw_\$m.log || exit 1; done"
  # What 132 SMs read steadily from L2 and from HBM within one launch, by register loads and by bulk copies
  # (csrc/bench/l2_steady_bw.cu, built in docs/PERF.md v0.48: can a tile prefetched into L2 stream faster?).
  [ "${AB_PROBES:-1}" = 1 ] && step ab_l2_steady "${AB_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/l2_steady_bw \
    csrc/bench/l2_steady_bw.cu && $OUT/l2_steady_bw"
  # What the unsplit attention walk's loads cost one SM, from HBM and from L2 (csrc/bench/walk_probe.cu, built in docs/PERF.md v0.41, read in v0.42).
  [ "${AB_PROBES:-1}" = 1 ] && step ab_walk_probe "${AB_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/walk_probe \
    csrc/bench/walk_probe.cu && $OUT/walk_probe"
  for m in $AB_MODELS; do
    step "ab_sweep_$m" "${AB_LIMIT:-540}" python3 scripts/tune_sweep.py --model "$m" --batch "$AB_BATCH" --prompt-len 480 \
      --output-len 64 --iters 2 --prebuild-jobs "${AB_JOBS:-8}" --variants "$AB_VARIANTS;$AB_VARIANTS" \
      --output-json "$OUT/ab_sweep_$m.json"
  done
  [ "${AB_TESTS:-}" != none ] && step ab_bitwise "${AB_LIMIT:-540}" python3 -m pytest -q -m gpu tests/runtime/test_code_variants_gpu.py -k \
    "${AB_TESTS:-merge_phases or PHASED_MERGE}"
  # AB_BLOCKS=0 skips the two-blocks-per-SM tests (their kernels build on the GPU machine: ~1-2 min)
  [ "${AB_TESTS:-}" != none ] && [ "${AB_BLOCKS:-1}" = 1 ] && step ab_blocks_per_sm "${AB_LIMIT:-300}" python3 -m pytest -q -m gpu tests/runtime/test_blocks_per_sm_gpu.py
  summary "gpu_check --ab summary"
  exit 0
fi

# Every kernel the runs below need, built in parallel first (nvcc is single-threaded: ~20 s per kernel
# when each test builds its own in turn). PREBUILD=0 skips it.
[ "${PREBUILD:-1}" = 1 ] && step prebuild "${PREBUILD_LIMIT:-300}" python3 scripts/prebuild_kernels.py "${PREBUILD_ARGS[@]}"
[ "${PREBUILD:-1}" = 1 ] && [ ${#PREBUILD_ARGS_B8[@]} -gt 0 ] && step prebuild_b8 "${PREBUILD_LIMIT:-300}" \
  python3 scripts/prebuild_kernels.py "${PREBUILD_ARGS_B8[@]}"

# ---- speed (--perf): this section only, then its table ----
if [ $PERF -eq 1 ]; then
  CTX="--prompt-len 480 --output-len 64 --max-seq-len 576 --iters 2 --no-progress"
  for m in qwen3-8b llama3-8b qwen3-1.7b qwen3-0.6b; do
    step "perf_$m" "${PERF_LIMIT:-150}" python3 -m mpk_dist bench --model "$m" --backend megakernel,torch-compile $CTX \
      --output-json "$OUT/perf_$m.json"
  done
  step perf_qwen3-8b_b8 "${PERF_LIMIT:-150}" python3 -m mpk_dist bench --model qwen3-8b --batch 8 \
    --backend megakernel,torch-compile $CTX --output-json "$OUT/perf_qwen3-8b_b8.json"
  # Issue 6's start-up figures: cold (empty cache: superoptimizer searches + nvcc) then warm (cached), qwen3-8b.
  step perf_startup "${PERF_LIMIT:-150}" bash -c 'D=$(mktemp -d); for i in 1 2; do MPK_CACHE_DIR=$D python3 -m mpk_dist run \
    --model qwen3-8b --backend megakernel --prompt-ids 1,2,3 --max-new-tokens 4 --no-stop | grep start-up || exit 1; done'
  # What the SMs read from HBM and from L2 (csrc/bench/sm_read_bw.cu; docs/PERF.md v0.24, v0.30): the 132-block rows.
  step perf_read_bw "${PERF_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/sm_read_bw csrc/bench/sm_read_bw.cu \
    && for m in hbm l2; do $OUT/sm_read_bw \$([ \$m = l2 ] && echo --l2) > $OUT/sm_read_bw_\$m.log \
    && grep -E 'reading|per block|^ 132' $OUT/sm_read_bw_\$m.log || exit 1; done"
  # How long after an event's last signal the waiting SMs see it, by polling method (csrc/bench/event_wake.cu).
  step perf_event_wake "${PERF_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/event_wake csrc/bench/event_wake.cu \
    && for m in idle load; do $OUT/event_wake \$([ \$m = load ] && echo --load) > $OUT/event_wake_\$m.log && cat $OUT/event_wake_\$m.log || exit 1; done"
  # What a level boundary costs, the kernel's event vs flagged data words (csrc/bench/ll_boundary.cu).
  step perf_ll_boundary "${PERF_LIMIT:-150}" bash -c "nvcc -O3 -arch=sm_90a -o $OUT/ll_boundary csrc/bench/ll_boundary.cu \
    && $OUT/ll_boundary && $OUT/ll_boundary --load && $OUT/ll_boundary --load --n 4096"
  step perf_sweep "${PERF_LIMIT:-150}" python3 scripts/tune_sweep.py --model qwen3-8b --prompt-len 480 --output-len 64 \
    --variants "${PERF_VARIANTS:-base;j0;u8;k9;y0;x1;z1;k1}" --output-json "$OUT/perf_sweep.json"
  # NCU=1: PC samples of one qwen3-0.6b launch (480-token prompt + 16 tokens) per source line: the kernel built with
  # -lineinfo, Nsight Compute's source counters exported per line and SASS instruction, scripts/ncu_lines.py's
  # top lines (the mega-kernel's SASS names no task kinds; the source lines do). ~3 minutes.
  if [ "${NCU:-0}" = 1 ]; then
    IDS=$(python3 -c "print(','.join(str(7 + (i * 37) % 5000) for i in range(480)))")
    step perf_ncu "${NCU_LIMIT:-300}" bash -c "MPK_NVCC_EXTRA_FLAGS=-lineinfo ncu --clock-control none --set none \
      --section SourceCounters --section WarpStateStats -k regex:mpk -c 1 -f -o $OUT/ncu_qwen3_06b \
      python3 -m mpk_dist run --model qwen3-0.6b --backend megakernel --prompt-ids $IDS --max-new-tokens 16 --no-stop \
      --max-seq-len 576 > $OUT/ncu_run.log 2>&1 && ncu --import $OUT/ncu_qwen3_06b.ncu-rep --page source --csv \
      --print-source cuda,sass | gzip > $OUT/ncu_cuda_sass.csv.gz && python3 scripts/ncu_lines.py \
      $OUT/ncu_cuda_sass.csv.gz --top 25"
  fi
  # The last 32 steps (megakernel_backend.TRACE_STEPS) of a 480-token prompt + 8 tokens: decode at context ~484.
  step perf_trace "${PERF_LIMIT:-150}" bash -c "python3 -m mpk_dist bench --model qwen3-8b --backend megakernel \
    --prompt-len 480 --output-len 8 --max-seq-len 576 --iters 1 --warmup 0 --no-progress \
    --trace $OUT/trace_qwen3_8b.json > /dev/null \
    && python3 -m mpk_dist trace-summary $OUT/trace_qwen3_8b.json | head -16 \
    && python3 -m mpk_dist trace-summary --levels 484 $OUT/trace_qwen3_8b.json | sed -n '1,9p' && gzip -f $OUT/trace_qwen3_8b.json"
  # Batch 8 the same way: its unsplit attention_prep tiles (25-28 us, docs/PERF.md v0.26) set marks 0 (prep done)
  # and 1 (walk done), shown in the --levels table's mark columns.
  step perf_trace_b8 "${PERF_LIMIT:-150}" bash -c "python3 -m mpk_dist bench --model qwen3-8b --batch 8 --backend megakernel \
    --prompt-len 480 --output-len 8 --max-seq-len 576 --iters 1 --warmup 0 --no-progress \
    --trace $OUT/trace_qwen3_8b_b8.json > /dev/null \
    && python3 -m mpk_dist trace-summary --levels 484 $OUT/trace_qwen3_8b_b8.json | sed -n '1,10p' \
    && gzip -f $OUT/trace_qwen3_8b_b8.json"
  echo
  echo "==================== gpu_check --perf summary ===================="
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
print(f"{'case':<26}{'backend':>15}{'p50 ms':>10}{'floor ms':>10}{'/floor':>8}")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "perf_*.json"))):
    if path.endswith("perf_sweep.json"):
        continue
    try:
        rows = json.load(open(path))
    except (OSError, ValueError):
        continue
    case = os.path.basename(path)[5:-5]
    for r in rows:
        print(f"{case:<26}{r['backend']:>15}{r['ms_per_token_p50']:>10.3f}{r['floor_ms_per_token']:>10.3f}"
              f"{r['ratio_to_floor']:>8.2f}")
try:
    for r in json.load(open(os.path.join(sys.argv[1], "perf_sweep.json"))):
        print(f"{'sweep qwen3-8b':<26}{r['variant']:>15}{r['p50_ms']:>10.3f}{r['floor_ms']:>10.3f}"
              f"{r['p50_ms'] / r['floor_ms']:>8.2f}  {'same tokens' if r['same_tokens'] else 'DIFFERS'}")
except (OSError, ValueError):
    pass
PY
  for k in "${!STATUS[@]}"; do printf '%-18s %s\n' "$k" "${STATUS[$k]}"; done | sort
  exit 0
fi

# ---- tensor parallelism (--tp): this section only, then the summary ----
TP_FILES=(tests/runtime/test_megakernel_tp_gpu.py tests/runtime/test_megakernel_ipc_gpu.py)
if [ $TP -eq 1 ]; then
  rm -f "$OUT/gpu_results_tp.json" "$OUT/gpu_results_ipc.json" "$OUT/ipc_jobs.log"
  # Local transport first (it warms the kernel cache for the mpirun ranks), then ipc in its own pytest
  # process: its mpirun jobs run before that process creates a CUDA context (MPS shares the GPU).
  step tp_local "${TP_LIMIT:-240}" env MPK_GPU_REPORT="$OUT/gpu_results_tp.json" python3 -m pytest -m gpu \
    tests/runtime/test_megakernel_tp_gpu.py -q -rs -p no:cacheprovider --tb=short -o addopts="--import-mode=importlib"
  step tp_ipc "${IPC_LIMIT:-250}" env MPK_GPU_REPORT="$OUT/gpu_results_ipc.json" MPK_IPC_LOG="$OUT/ipc_jobs.log" \
    python3 -m pytest -m "gpu and mpi" tests/runtime/test_megakernel_ipc_gpu.py tests/comm/test_symmetric.py -q -rs \
    -p no:cacheprovider --tb=short -o addopts="--import-mode=importlib"
  step tp_bench "${TP_BENCH_LIMIT:-75}" bash -c "mpk-dist bench --model qwen3-0.6b --backend megakernel --tp 2 \
    --transport local --prompt-len 64 --output-len 32 --iters 2 --no-progress --output-json $OUT/bench_tp2.json && \
    python3 -c \"import json; r = json.load(open('$OUT/bench_tp2.json'))[0]; \
print('exposed_comm_share', r.get('exposed_comm_share'), 'ms/token p50', r['ms_per_token_p50'])\""
  summary "gpu_check --tp summary" "$OUT/gpu_results_tp.json" "$OUT/gpu_results_ipc.json"
  exit 0
fi

TESTS=tests; [ $RUNTIME_ONLY -eq 1 ] && TESTS=tests/runtime
# The newer sections' files run in their own steps below (own limits and result files).
EXTRA_IGNORE=(--ignore=tests/runtime/test_sampling_gpu.py --ignore=tests/runtime/test_superopt_gpu.py
              --ignore=tests/runtime/test_linear_mma_gpu.py --ignore=tests/serving/test_megakernel_paged_gpu.py
              --ignore=tests/runtime/test_linear_variants_gpu.py --ignore=tests/runtime/test_attn_prep_gpu.py
              --ignore=tests/runtime/test_megakernel_b64_gpu.py)
KSEL=(); [ -n "${PYTEST_K:-}" ] && KSEL=(-k "$PYTEST_K")  # e.g. PYTEST_K="not 0.6b-16" to save time
if [ $FUSION_ONLY -eq 0 ]; then  # (closed after the bench step; the fusion section follows it)
step pytest_gpu "${PYTEST_LIMIT:-900}" env MPK_GPU_REPORT="$OUT/gpu_results.json" python3 -m pytest -m gpu "$TESTS" --ignore=tests/runtime/test_fusion_gpu.py --ignore=tests/runtime/test_attn_split_gpu.py --ignore="${TP_FILES[0]}" --ignore="${TP_FILES[1]}" "${EXTRA_IGNORE[@]}" "${KSEL[@]}" -q -rs -p no:cacheprovider --tb=short --maxfail=${MAXFAIL:-8} -o addopts="--import-mode=importlib"

if [ $SANITIZE -eq 1 ] && command -v compute-sanitizer > /dev/null; then
  SAN_PY='from mpk_dist.model_source import open_model
from mpk_dist.runtime.megakernel_backend import MegakernelBackend
from mpk_dist.backends.base import GenerateRequest
m = open_model("tiny", device="cuda")
for sch in ("aot", "jit"):
    b = MegakernelBackend(m.config, m.weights, max_seq_len=32, schedule=sch, timeout_s=120, sms=16)
    print(sch, b.generate(GenerateRequest([[1, 2, 3], [4, 5, 6]], 3)).tokens)'
  step memcheck "${SAN_LIMIT:-300}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -c "$SAN_PY"
  step racecheck "${SAN_LIMIT:-300}" compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 python3 -c "$SAN_PY"
fi

[ "${SKIP_TRACE:-0}" = 1 ] || step trace_0p6b "${TRACE_LIMIT:-300}" bash -c "mpk-dist run --model qwen3-0.6b --backend megakernel --prompt-ids 1,2,3,4 --max-new-tokens 8 \
  --trace $OUT/trace_qwen3_0p6b.json > /dev/null && mpk-dist trace-summary $OUT/trace_qwen3_0p6b.json | head -40 \
  && gzip -f $OUT/trace_qwen3_0p6b.json"

if [ "${SKIP_TRACE:-0}" = 1 ]; then STATUS[trace_0p6b]="skipped"; fi
if [ $BENCH -eq 1 ]; then
  step bench_0p6b 600 mpk-dist bench --model qwen3-0.6b --backend megakernel,torch-graph,torch-compile
fi
fi  # FUSION_ONLY

# ---- fused linears (issue 6: mpk_dist.taskgraph.fusion, docs/TASKGRAPH.md 'Fused linears') ----------
# GPU acceptance of MegakernelBackend(fuse=True) against torch and the unfused kernel, then the speed
# of qwen3-0.6b batch 1 with --fuse against --no-fuse (and torch-compile), and a fused trace summary.
rm -f "$OUT/gpu_results_fusion.json"  # no stale rows in the summary
if [ $FUSION -eq 1 ]; then
  step fusion_gpu "${FUSION_LIMIT:-900}" env MPK_GPU_REPORT="$OUT/gpu_results_fusion.json" python3 -m pytest -m gpu \
    tests/runtime/test_fusion_gpu.py "${KSEL[@]}" -q -rs -p no:cacheprovider --tb=short -o addopts="--import-mode=importlib"
  step fusion_bench_0p6b 600 bash -c "mpk-dist bench --model qwen3-0.6b --backend megakernel --no-fuse \
    --output-json $OUT/bench_0p6b_unfused.json && mpk-dist bench --model qwen3-0.6b --backend megakernel,torch-compile \
    --fuse --output-json $OUT/bench_0p6b_fused.json"
  step fusion_trace_0p6b 300 bash -c "mpk-dist run --model qwen3-0.6b --backend megakernel --fuse --prompt-ids 1,2,3,4 \
    --max-new-tokens 8 --trace $OUT/trace_qwen3_0p6b_fused.json > /dev/null \
    && mpk-dist trace-summary $OUT/trace_qwen3_0p6b_fused.json | head -40 && gzip -f $OUT/trace_qwen3_0p6b_fused.json"
fi

# ---- split-KV attention (docs/TASKGRAPH.md 'Split-KV attention') ----------------------------------
# GPU acceptance of MegakernelBackend(attn_splits='auto') (per-warp and staged paths) against torch
# and the unsplit kernel, then qwen3-0.6b batch 1 speed with --attn-splits auto vs 1 at a long context.
rm -f "$OUT/gpu_results_attn.json"
if [ $ATTN -eq 1 ] && { [ $FUSION_ONLY -eq 0 ] || [ $FUSION -eq 0 ]; }; then
  step attn_split_gpu "${ATTN_LIMIT:-600}" env MPK_GPU_REPORT="$OUT/gpu_results_attn.json" python3 -m pytest -m gpu \
    tests/runtime/test_attn_split_gpu.py "${KSEL[@]}" -q -rs -p no:cacheprovider --tb=short -o addopts="--import-mode=importlib"
  step attn_split_bench_0p6b 300 bash -c "mpk-dist bench --model qwen3-0.6b --backend megakernel --attn-splits 1 \
    --max-seq-len 4096 --prompt-len 2048 --output-len 32 --iters 2 --no-progress --output-json $OUT/bench_0p6b_attn1.json \
    && mpk-dist bench --model qwen3-0.6b --backend megakernel --attn-splits auto --max-seq-len 4096 --prompt-len 2048 \
    --output-len 32 --iters 2 --no-progress --output-json $OUT/bench_0p6b_attn_auto.json"
fi

# ---- newer sections (sampling, generated bodies, MMA linear tiles, paged serving, bench-comm) -------
EXTRA_JSON=()
if [ $EXTRAS -eq 1 ] && { [ $FUSION_ONLY -eq 0 ] || [ $FUSION -eq 0 ]; }; then
  for sec in sampling:tests/runtime/test_sampling_gpu.py superopt:tests/runtime/test_superopt_gpu.py \
             linear_mma:tests/runtime/test_linear_mma_gpu.py serving:tests/serving/test_megakernel_paged_gpu.py \
             linear_variants:tests/runtime/test_linear_variants_gpu.py attn_prep:tests/runtime/test_attn_prep_gpu.py \
             batch64:tests/runtime/test_megakernel_b64_gpu.py; do
    name=${sec%%:*}; file=${sec#*:}; rm -f "$OUT/gpu_results_$name.json"; EXTRA_JSON+=("$OUT/gpu_results_$name.json")
    step "$name" "${EXTRA_LIMIT:-240}" env MPK_GPU_REPORT="$OUT/gpu_results_$name.json" python3 -m pytest -m gpu "$file" \
      "${KSEL[@]}" -q -rs -p no:cacheprovider --tb=short -o addopts="--import-mode=importlib"
  done
  step bench_linear "${EXTRA_LIMIT:-240}" python3 -m mpk_dist bench-linear --model qwen3-8b --batches 1,8 \
    --output-json "$OUT/bench_linear.json"
  # Issue 10: TTFT of 128/1024/4096-token prompts (megakernel vs torch, one run each; 256 tokens a pass),
  # then the 1024-token workload with every pass posted into one resident launch (--persistent-passes), and
  # the 4096-token one with the scalar tiles for the 16-row blocks of prefill (MPK_LINEAR_MMA=0; tensor cores are the
  # default from 4 rows a tile since 2026-12-01, so the loop above runs them).
  step ttft "${EXTRA_LIMIT:-240}" bash -c 'for L in 128 1024 4096; do python3 -m mpk_dist serve-bench --model qwen3-0.6b \
    --backend megakernel,torch --synthetic 4 --prompt-len $L --output-len 16 --max-batch 4 --max-tokens-per-step 256 \
    --ignore-eos --check --device cuda --output-json "'"$OUT"'/ttft_$L.json" | tail -4 || exit 1; done; \
    python3 -m mpk_dist serve-bench --model qwen3-0.6b --backend megakernel --persistent-passes 4096 --synthetic 4 \
    --prompt-len 1024 --output-len 16 --max-batch 4 --max-tokens-per-step 256 --ignore-eos --check --device cuda \
    --output-json "'"$OUT"'/ttft_1024_persistent.json" | tail -3; \
    MPK_LINEAR_MMA=0 python3 -m mpk_dist serve-bench --model qwen3-0.6b --backend megakernel --synthetic 4 \
    --prompt-len 4096 --output-len 16 --max-batch 4 --max-tokens-per-step 256 --ignore-eos --check --device cuda \
    --output-json "'"$OUT"'/ttft_4096_scalar.json" | tail -3'
  if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step bench_comm "${EXTRA_LIMIT:-240}" launch/mpirun.sh -n 2 bench-comm --output-json "$OUT/bench_comm.json"
  fi
fi

summary "gpu_check summary" "$OUT/gpu_results.json" "$OUT/gpu_results_fusion.json" "$OUT/gpu_results_attn.json" \
  "${EXTRA_JSON[@]}"
