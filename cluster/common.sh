# Sourced by the sbatch templates in cluster/: defaults, NVLink multicast off, the mpk-dist
# command, the results directory, and the bench arguments of one point.
#
# Every knob is an MPK_* environment variable (sbatch passes the submitter's environment):
#   MPK_REPO         checkout holding cluster/ and launch/ (default: the submit directory)
#   MPK_DIST         command that runs mpk-dist (default: mpk-dist if on PATH, else python3 -m mpk_dist)
#   MPK_MODEL        preset or checkpoint directory (default qwen3-8b)
#   MPK_BACKEND      bench backend(s), comma-separated (default auto)
#   MPK_TRANSPORT    ipc: one process per TP rank (default); local: one process holds a whole TP group
#   MPK_BATCH MPK_PROMPT_LEN MPK_OUTPUT_LEN MPK_ITERS   bench sizes (1, 512, 128, 5)
#   MPK_BENCH_EXTRA  more bench arguments (word-split), e.g. "--schedule aot"
#   MPK_RESULTS_DIR  where result JSON goes (default MPK_REPO/results/JOBID)
#   MPK_SRUN_MPI     srun --mpi= plugin (default pmix)

: "${MPK_REPO:=${SLURM_SUBMIT_DIR:-$PWD}}"
[ -f "$MPK_REPO/cluster/common.sh" ] || { echo "mpk: MPK_REPO=$MPK_REPO: expected the mpk_dist checkout, got no cluster/common.sh; submit from the repo root or set MPK_REPO" >&2; exit 2; }

# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

: "${MPK_MODEL:=qwen3-8b}" "${MPK_BACKEND:=auto}" "${MPK_TRANSPORT:=ipc}"
: "${MPK_BATCH:=1}" "${MPK_PROMPT_LEN:=512}" "${MPK_OUTPUT_LEN:=128}" "${MPK_ITERS:=5}"
: "${MPK_RESULTS_DIR:=$MPK_REPO/results/${SLURM_JOB_ID:-local}}"
: "${MPK_SRUN_MPI:=pmix}"
export MPK_REPO MPK_RESULTS_DIR
mkdir -p "$MPK_RESULTS_DIR"

if [ -n "${MPK_DIST:-}" ]; then
  read -r -a MPK_CMD <<<"$MPK_DIST"
elif command -v mpk-dist >/dev/null 2>&1; then
  MPK_CMD=(mpk-dist)
else
  MPK_CMD=(python3 -m mpk_dist)
  export PYTHONPATH="$MPK_REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
# The python that runs the preflight check (same interpreter as mpk-dist when it is python -m).
MPK_PY="${MPK_PYTHON:-python3}"

# mpk_bench_args TP BATCH OUT_JSON: the bench arguments of one point, into the array BENCH.
mpk_bench_args() {
  BENCH=(bench --model "$MPK_MODEL" --backend "$MPK_BACKEND" --tp "$1" --transport "$MPK_TRANSPORT"
         --batch "$2" --prompt-len "$MPK_PROMPT_LEN" --output-len "$MPK_OUTPUT_LEN" --iters "$MPK_ITERS"
         --no-progress --output-json "$3")
  if [ -n "${MPK_BENCH_EXTRA:-}" ]; then
    local extra
    read -r -a extra <<<"$MPK_BENCH_EXTRA"
    BENCH+=("${extra[@]}")
  fi
}

# mpk_banner NAME: one line describing the job, for the log.
mpk_banner() {
  echo "# mpk $1 | job ${SLURM_JOB_ID:-?} | nodes ${SLURM_JOB_NODELIST:-?} | tasks ${SLURM_NTASKS:-?} | model $MPK_MODEL | backend $MPK_BACKEND | transport $MPK_TRANSPORT | results $MPK_RESULTS_DIR"
}
