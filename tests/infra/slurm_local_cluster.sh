#!/usr/bin/env bash
# A one-node Slurm cluster on this machine: munged, slurmctld and slurmd on localhost (Debian's slurm-wlm and munge),
# to try scripts/slurm/train.sbatch before a real cluster, and for tests/test_cluster.py.
#
#   tests/infra/slurm_local_cluster.sh start    # as root: installs slurm-wlm + munge if missing, writes the config, starts
#   tests/infra/slurm_local_cluster.sh stop
#   tests/infra/slurm_local_cluster.sh status
#
# The node is this machine with all its cores as "localhost". proctrack/linuxproc and task/none: no cgroups needed,
# so it also runs in containers and VMs. It writes /etc/slurm/slurm.conf only where none exists or where it wrote
# it before (the first line says so), and keeps its state and logs under $SLURM_LOCAL_STATE.
set -euo pipefail

STATE=${SLURM_LOCAL_STATE:-/var/lib/loadout-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by loadout tests/infra/slurm_local_cluster.sh"
OLD_MARK="# written by loadout scripts/slurm/local_cluster.sh"  # where this script lived before

log() { printf '[local_cluster] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

install_packages() {
  local need=()
  command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
  command -v munged >/dev/null 2>&1 || need+=(munge)
  ((${#need[@]})) || return 0
  [[ $(id -u) -eq 0 ]] || die "missing ${need[*]}: apt-get install ${need[*]} (as root), then run this again"
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

write_config() {
  if [[ -f $CONF ]] && [[ $(head -n 1 "$CONF") != "$MARK" && $(head -n 1 "$CONF") != "$OLD_MARK" ]]; then
    die "$CONF exists and was not written by this script: this machine has a Slurm config of its own"
  fi
  mkdir -p "$STATE/ctld" "$STATE/d" /etc/slurm
  local cpus mem
  cpus=$(nproc)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  cat >"$CONF" <<CONF
$MARK
ClusterName=loadout
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
# job credentials live 20 s (default 120): a requeued job may start again that much sooner
AuthInfo=cred_expire=20
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
# a stopped job gets 30 s between SIGTERM and SIGKILL, as on most clusters
KillWait=30
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
}

start() {
  install_packages
  [[ $(id -u) -eq 0 ]] || die "start needs root (the daemons run as root here)"
  write_config
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [[ -f /etc/munge/munge.key ]] || mungekey --create
    runuser -u munge -- /usr/sbin/munged
  fi
  if ! pgrep -x slurmctld >/dev/null; then slurmctld; else scontrol reconfigure; fi
  pgrep -x slurmd >/dev/null || slurmd -N localhost
  for _ in $(seq 60); do
    if sinfo -h -n localhost -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      log "up: $(sinfo -h -o '%P %D nodes %c cpus %t')"
      return 0
    fi
    sleep 0.5
  done
  die "slurmd did not register with slurmctld in 30 s; see $STATE/slurmctld.log and $STATE/slurmd.log"
}

stop() {
  local daemon
  for daemon in slurmd slurmctld; do
    pkill -x "$daemon" || true
    for _ in $(seq 100); do pgrep -x "$daemon" >/dev/null || break; sleep 0.1; done
  done
  log "stopped slurmctld and slurmd (munged left running)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
