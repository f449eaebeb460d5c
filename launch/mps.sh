#!/usr/bin/env bash
# Start, stop or query a *private* CUDA MPS control daemon (own pipe and log directories).
#
#   eval "$(launch/mps.sh start [DIR])"   # starts it, prints the exports its clients need
#   launch/mps.sh status [DIR]            # exit 0 when its daemon runs
#   launch/mps.sh stop [DIR]              # asks it to quit, waits (bounded) until it has exited
#
# DIR defaults to $MPK_MPS_DIR, else /tmp/mpk-mps-<uid>. Pipes live in DIR/pipe, logs in DIR/log.
# Ranks sharing a GPU need MPS: without it their contexts time-slice and a flag round trip between
# two persistent kernels takes milliseconds instead of microseconds (docs/CLUSTER.md).
# MPK_MPS_CONTROL overrides the control binary (tests use a fake one).
set -euo pipefail

control="${MPK_MPS_CONTROL:-nvidia-cuda-mps-control}"
timeout_s="${MPK_MPS_TIMEOUT_S:-10}"

usage() {
  echo "usage: $0 start|stop|status [DIR]" >&2
  exit 2
}

[ $# -ge 1 ] || usage
action="$1"
dir="${2:-${MPK_MPS_DIR:-/tmp/mpk-mps-$(id -u)}}"
export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe"
export CUDA_MPS_LOG_DIRECTORY="$dir/log"

# Running = the daemon's pid file names a live process. (CUDA 13's daemon makes 'control' a
# socket that stays behind after quit, so the pipe alone proves nothing; drivers without a pid
# file use a fifo that goes away with the daemon.)
running() {
  local pidfile="$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid" pid state
  if [ -f "$pidfile" ]; then
    pid="$(tr -dc 0-9 < "$pidfile" 2>/dev/null)"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
    state="$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo R)"
    [ "$state" != Z ]
    return
  fi
  [ -p "$CUDA_MPS_PIPE_DIRECTORY/control" ]
}

# Poll until "running" returns $1 (0 = up, 1 = down) or the timeout passes.
wait_for() {
  local want="$1" deadline=$(( $(date +%s) + timeout_s ))
  while :; do
    if running; then state=0; else state=1; fi
    [ "$state" = "$want" ] && return 0
    [ "$(date +%s)" -ge "$deadline" ] && return 1
    sleep 0.1
  done
}

case "$action" in
  start)
    if ! command -v "$control" >/dev/null 2>&1; then
      echo "mps.sh: expected $control on PATH, got nothing; install the NVIDIA driver utilities" >&2
      exit 2
    fi
    if running; then
      echo "mps.sh: an MPS daemon already listens in $CUDA_MPS_PIPE_DIRECTORY; reusing it" >&2
    else
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      "$control" -d
      if ! wait_for 0; then
        echo "mps.sh: expected a running MPS control daemon in $CUDA_MPS_PIPE_DIRECTORY within ${timeout_s}s, got none; see $CUDA_MPS_LOG_DIRECTORY/control.log" >&2
        exit 1
      fi
    fi
    echo "export CUDA_MPS_PIPE_DIRECTORY=$CUDA_MPS_PIPE_DIRECTORY"
    echo "export CUDA_MPS_LOG_DIRECTORY=$CUDA_MPS_LOG_DIRECTORY"
    ;;
  stop)
    running || exit 0
    echo quit | "$control" || true
    if ! wait_for 1; then
      echo "mps.sh: MPS daemon in $CUDA_MPS_PIPE_DIRECTORY did not quit within ${timeout_s}s; clients may still be attached" >&2
      exit 1
    fi
    ;;
  status)
    if running; then echo "MPS running ($CUDA_MPS_PIPE_DIRECTORY)"; else echo "MPS not running ($CUDA_MPS_PIPE_DIRECTORY)"; exit 1; fi
    ;;
  *) usage ;;
esac
