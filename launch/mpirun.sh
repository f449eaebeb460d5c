#!/usr/bin/env bash
# Run mpk-dist with one process per GPU on this node, through mpirun (Open MPI or MPICH/hydra).
#
#   launch/mpirun.sh [options] [--] MPK_DIST_ARGS...     e.g.  launch/mpirun.sh bench --model tiny --tp 4
#   launch/mpirun.sh [options] --exec CMD [ARGS...]      any command instead of mpk-dist
#
# options:
#   -n, --ranks N     processes (default: number of GPUs)
#   --gpus N          GPUs on this node (default: $MPK_NUM_GPUS, CUDA_VISIBLE_DEVICES, nvidia-smi -L)
#   --mps auto|on|off private MPS daemon: auto = when ranks > GPUs (default auto)
#   --bind POLICY     mpirun binding: numa (default), socket, core, none
#   --dry-run         print what would run, run nothing
#
# Every rank gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# (NVLink multicast stays off: it can take a shared host's GPUs out of service), every MPK_*
# variable, PYTHONPATH, and the MPS pipe directory when MPS runs. The MPS daemon is stopped when
# the job ends, fails, or is interrupted (Ctrl-C / SIGTERM). Environment: MPK_MPIRUN (mpirun
# binary), MPK_DIST (mpk-dist command), MPK_PYTHON (python for 'python -m mpk_dist'),
# MPK_MPIRUN_ARGS (extra mpirun arguments), MPK_MPS_DIR.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
mpirun_bin="${MPK_MPIRUN:-mpirun}"
ranks="" gpus="${MPK_NUM_GPUS:-}" mps_mode="auto" bind="numa" dry_run=0 exec_mode=0

die() { echo "mpirun.sh: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    -n|--ranks) ranks="${2:?}"; shift 2 ;;
    --gpus) gpus="${2:?}"; shift 2 ;;
    --mps) mps_mode="${2:?}"; shift 2 ;;
    --bind) bind="${2:?}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --exec) exec_mode=1; shift; break ;;
    --) shift; break ;;
    -h|--help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done

# GPUs on this node: explicit, else CUDA_VISIBLE_DEVICES entries, else nvidia-smi, else 0.
if [ -z "$gpus" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    gpus=$(awk -F, '{n=0; for (i=1;i<=NF;i++) { if ($i=="" || $i ~ /^-/) break; n++ } print n}' <<<"$CUDA_VISIBLE_DEVICES")
  elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  else
    gpus=0
  fi
fi
[[ "$gpus" =~ ^[0-9]+$ ]] || die "--gpus: expected a number of GPUs, got '$gpus'"
if [ -z "$ranks" ]; then
  [ "$gpus" -gt 0 ] || die "ranks: expected -n N (no GPU found to count), got nothing; pass -n N or --gpus N"
  ranks="$gpus"
fi
[[ "$ranks" =~ ^[1-9][0-9]*$ ]] || die "-n: expected a positive number of processes, got '$ranks'"
case "$mps_mode" in auto|on|off) ;; *) die "--mps: expected auto, on or off, got '$mps_mode'" ;; esac

use_mps=0
if [ "$mps_mode" = on ] || { [ "$mps_mode" = auto ] && [ "$gpus" -gt 0 ] && [ "$ranks" -gt "$gpus" ]; }; then
  use_mps=1
elif [ "$gpus" -gt 0 ] && [ "$ranks" -gt "$gpus" ]; then
  die "--mps off: expected at most one rank per GPU without MPS, got $ranks ranks on $gpus GPU(s); use --mps auto"
fi

# The program each rank runs.
if [ "$exec_mode" = 1 ]; then
  [ $# -gt 0 ] || die "--exec: expected a command, got nothing"
  program=("$@")
elif [ -n "${MPK_DIST:-}" ]; then
  read -r -a program <<<"$MPK_DIST"; program+=("$@")
elif command -v mpk-dist >/dev/null 2>&1; then
  program=(mpk-dist "$@")
else
  program=("${MPK_PYTHON:-python3}" -m mpk_dist "$@")
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mps_dir="" mps_created=0
if [ "$use_mps" = 1 ]; then
  if [ -n "${MPK_MPS_DIR:-}" ]; then mps_dir="$MPK_MPS_DIR"; else mps_dir="${TMPDIR:-/tmp}/mpk-mps.$$"; mps_created=1; fi
  export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
fi

# Variables every rank must see (Open MPI only forwards what -x names to remote daemons).
forward=(NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS)
while IFS= read -r name; do forward+=("$name"); done < <(compgen -e | grep -E '^(MPK_|CUDA_MPS_)' || true)
[ -n "${PYTHONPATH:-}" ] && forward+=(PYTHONPATH)

flavour=ompi
version_text="$("$mpirun_bin" --version 2>&1 || true)"
if grep -qiE 'hydra|intel\(r\) mpi' <<<"$version_text"; then flavour=hydra; fi

cmd=("$mpirun_bin")
if [ "$flavour" = ompi ]; then
  [ "$(id -u)" = 0 ] && cmd+=(--allow-run-as-root)
  # Consecutive ranks on consecutive slots, so a TP group (consecutive ranks) shares a node.
  cmd+=(-n "$ranks" --map-by slot --bind-to "$bind")
  [ "$ranks" -gt "$(nproc)" ] && cmd+=(--oversubscribe)
  for name in "${forward[@]}"; do cmd+=(-x "$name"); done
else
  cmd+=(-n "$ranks" -bind-to "$bind")
  for name in "${forward[@]}"; do cmd+=(-genv "$name" "${!name}"); done
fi
if [ -n "${MPK_MPIRUN_ARGS:-}" ]; then read -r -a extra <<<"$MPK_MPIRUN_ARGS"; cmd+=("${extra[@]}"); fi
cmd+=("${program[@]}")

if [ "$dry_run" = 1 ]; then
  echo "mpi: $flavour, ranks: $ranks, gpus: $gpus, mps: $([ "$use_mps" = 1 ] && echo "start in $mps_dir" || echo off)"
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi

child=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then
    # mpirun forwards SIGTERM to its ranks; give them 10 s, then kill the whole launch.
    kill -TERM "$child" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$child" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$child" 2>/dev/null || true
  fi
  if [ "$use_mps" = 1 ]; then
    if "$here/mps.sh" stop "$mps_dir"; then
      [ "$mps_created" = 1 ] && rm -rf "$mps_dir"
    else
      echo "mpirun.sh: MPS daemon in $mps_dir did not stop; its logs stay there" >&2
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "$use_mps" = 1 ]; then
  "$here/mps.sh" start "$mps_dir" >/dev/null
fi
# Run in the background and wait, so a signal interrupts 'wait' and the trap runs at once.
"${cmd[@]}" &
child=$!
set +e
wait "$child"
rc=$?
set -e
child=""
exit "$rc"
