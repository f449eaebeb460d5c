#!/usr/bin/env bash
# Start a one-node Slurm cluster from Debian's packages (slurmctld, slurmd, munge) for tests.
#
#   eval "$(cluster/local/start.sh [DIR])"     # prints 'export SLURM_CONF=DIR/slurm.conf'
#   sbatch ...; squeue; ...
#   cluster/local/stop.sh DIR                  # stops every daemon and job process, removes DIR
#
# Everything (munge key and socket, slurm.conf, gres.conf, state, spool, logs, pid files) lives
# under DIR (default: a new temp dir). No systemd, no cgroups: proctrack/linuxproc, task/none.
# The node advertises MPK_SLURM_GPUS fake GPUs (default 2) backed by empty files, so --gres=gpu:N
# and --gpus-per-task work and Slurm sets CUDA_VISIBLE_DEVICES, and MPK_SLURM_CPUS CPUs
# (default 8, more than the host may have: SlurmdParameters=config_overrides).
# MPK_SLURM_INSTALL=1 installs missing packages with apt-get (CI runs as root).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
gpus="${MPK_SLURM_GPUS:-2}"
cpus="${MPK_SLURM_CPUS:-8}"
timeout_s="${MPK_SLURM_TIMEOUT_S:-30}"

log() { echo "start.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# Debian's mpi_pmix plugin dlopens pmix2/lib/libpmix.so, the unversioned name that only
# libpmix-dev ships; without it srun --mpi=pmix fails with "can not load PMIx library".
packages=(slurmctld slurmd slurm-client munge libpmix2 libpmix-dev)
missing=()
for bin in slurmctld slurmd sbatch munged; do command -v "$bin" >/dev/null 2>&1 || missing+=("$bin"); done
compgen -G "/usr/lib/*/pmix2/lib/libpmix.so" >/dev/null || missing+=(libpmix.so)
if [ ${#missing[@]} -gt 0 ]; then
  [ "${MPK_SLURM_INSTALL:-0}" = 1 ] || die "expected ${missing[*]}, got nothing; apt-get install ${packages[*]} (or set MPK_SLURM_INSTALL=1)"
  log "installing ${packages[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${packages[@]}" >&2 \
    || { apt-get update >&2 && apt-get install -y --no-install-recommends "${packages[@]}" >&2; } \
    || die "apt-get install ${packages[*]} failed"
fi

if [ $# -ge 1 ]; then dir="$1"; mkdir -p "$dir"; else dir="$(mktemp -d "${TMPDIR:-/tmp}/mpk-slurm.XXXXXX")"; fi
dir="$(cd "$dir" && pwd)"
[ -e "$dir/slurm.conf" ] && die "$dir already holds a cluster (slurm.conf); stop it with cluster/local/stop.sh $dir"
touch "$dir/.mpk-local-slurm"  # marker: stop.sh only deletes directories that carry it
mkdir -p "$dir/munge" "$dir/state" "$dir/spool" "$dir/log" "$dir/dev" "$dir/tmp"
chmod 700 "$dir/munge"
# munged refuses keys readable by others and sockets in world-writable directories.
head -c 1024 /dev/urandom > "$dir/munge/munge.key"
chmod 400 "$dir/munge/munge.key"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ctld_port="$(free_port)"
slurmd_port="$(free_port)"
while [ "$slurmd_port" = "$ctld_port" ]; do slurmd_port="$(free_port)"; done
node="$(hostname -s)"
user="$(id -un)"
# Slurm wants character devices: links to /dev/null named nvidiaN (N becomes the device index).
for i in $(seq 0 $((gpus - 1))); do ln -sf /dev/null "$dir/dev/nvidia$i"; done

"$here/slurm_conf.sh" "$dir" "$node" "$user" "$ctld_port" "$slurmd_port" "$cpus" "$gpus"

export SLURM_CONF="$dir/slurm.conf"
# Daemons (and the slurmstepd they spawn) carry MPK_LOCAL_SLURM so stop.sh can find them by id.
export MPK_LOCAL_SLURM="$dir"
munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" --force \
  || die "munged failed; see $dir/log/munged.log"
slurmctld -f "$SLURM_CONF" || die "slurmctld failed; see $dir/log/slurmctld.log"
slurmd -f "$SLURM_CONF" -N "$node" || die "slurmd failed; see $dir/log/slurmd.log"

unset MPK_LOCAL_SLURM
deadline=$(( $(date +%s) + timeout_s ))
state=""
until state="$(timeout 5 sinfo -h -N -o %T 2>/dev/null | head -1)"; [ "$state" = idle ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    log "expected node $node idle within ${timeout_s}s, got '${state:-no answer}'; logs:"
    tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    "$here/stop.sh" "$dir" >&2 || true
    exit 1
  fi
  sleep 0.5
done
echo "export SLURM_CONF=$SLURM_CONF" > "$dir/env.sh"
echo "export SLURM_CONF=$SLURM_CONF"
log "one-node cluster up in $dir (node $node, $cpus CPUs, $gpus fake GPUs)"
