#!/usr/bin/env bash
# Stop the local test cluster started by cluster/local/start.sh DIR and remove DIR.
#
#   cluster/local/stop.sh DIR        (MPK_SLURM_KEEP=1 keeps DIR, e.g. to read its logs)
#
# Order: cancel jobs (SIGKILL to their tasks), 'scontrol shutdown', then every remaining process
# that belongs to this cluster. Those are found by id: the pids in DIR's pid files, and processes
# whose environment holds MPK_LOCAL_SLURM=DIR (start.sh sets it on the daemons only, and
# slurmstepd inherits it from slurmd; a user's shell never has it). Each wait is bounded;
# stragglers get SIGKILL.
set -uo pipefail

dir="${1:-}"
[ -n "$dir" ] && [ -d "$dir" ] || { echo "stop.sh: expected the cluster directory given to start.sh, got '${dir}'" >&2; exit 2; }
dir="$(cd "$dir" && pwd)"
conf="$dir/slurm.conf"
timeout_s="${MPK_SLURM_TIMEOUT_S:-15}"

# Pids whose environment names this cluster's slurm.conf, plus the pid files' contents.
ours() {
  local pid
  for pid in $(cat "$dir"/slurmctld.pid "$dir"/slurmd.pid "$dir"/munge/munged.pid 2>/dev/null); do
    [ -d "/proc/$pid" ] && echo "$pid"
  done
  for env_file in /proc/[0-9]*/environ; do
    pid="${env_file#/proc/}"; pid="${pid%/environ}"
    [ "$pid" = "$$" ] && continue
    if { tr '\0' '\n' < "$env_file"; } 2>/dev/null | grep -qxF "MPK_LOCAL_SLURM=$dir"; then echo "$pid"; fi
  done | sort -u
}

# A zombie (dead, waiting for a parent that may never reap it) counts as gone.
alive() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

if [ -f "$conf" ]; then
  SLURM_CONF="$conf" timeout 10 scancel --full --signal=KILL --user="$(id -un)" >/dev/null 2>&1 || true
  SLURM_CONF="$conf" timeout 10 scontrol shutdown >/dev/null 2>&1 || true
fi

deadline=$(( $(date +%s) + timeout_s ))
while :; do
  left=()
  for pid in $(ours); do alive "$pid" && left+=("$pid"); done
  [ ${#left[@]} -eq 0 ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "stop.sh: killing leftover processes ${left[*]}" >&2
    kill -KILL "${left[@]}" 2>/dev/null || true
    sleep 0.5
    break
  fi
  # munged does not listen to scontrol; ask it (and anything else of ours) to stop.
  kill -TERM "${left[@]}" 2>/dev/null || true
  sleep 0.3
done

remaining=()
for pid in $(ours); do alive "$pid" && remaining+=("$pid"); done
if [ ${#remaining[@]} -gt 0 ]; then
  echo "stop.sh: processes ${remaining[*]} survived SIGKILL" >&2
  exit 1
fi
if [ "${MPK_SLURM_KEEP:-0}" != 1 ] && [ -e "$dir/.mpk-local-slurm" ]; then
  rm -rf "$dir"
fi
exit 0
