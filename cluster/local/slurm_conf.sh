#!/usr/bin/env bash
# Write slurm.conf and gres.conf of the local test cluster (called by start.sh).
#   slurm_conf.sh DIR NODE USER CTLD_PORT SLURMD_PORT CPUS GPUS
set -euo pipefail
dir="$1" node="$2" user="$3" ctld_port="$4" slurmd_port="$5" cpus="$6" gpus="$7"

cat > "$dir/slurm.conf" <<EOF
# Local one-node test cluster written by cluster/local/slurm_conf.sh; all paths under $dir.
ClusterName=mpklocal
SlurmctldHost=$node(127.0.0.1)
SlurmUser=$user
SlurmdUser=$user
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
TmpFS=$dir/tmp
# No cgroups, no systemd: plain process tracking and no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=1000 Gres=gpu:$gpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

# Fake GPUs: links to /dev/null named like /dev/nvidiaN, so Slurm derives CUDA_VISIBLE_DEVICES indices.
if [ "$gpus" -gt 0 ]; then
  echo "NodeName=$node Name=gpu File=$dir/dev/nvidia[0-$((gpus - 1))]" > "$dir/gres.conf"
else
  : > "$dir/gres.conf"
fi
