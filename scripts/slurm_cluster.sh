#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for trying and testing the cluster commands (README "Running on a
# cluster"; docs/cluster.md): Debian's slurm-wlm and munge, one slurmctld and two slurmd acting as nodes n1 and n2.
#
#   bash scripts/slurm_cluster.sh start     # (as root) install the packages if missing, write the config, start; idempotent
#   bash scripts/slurm_cluster.sh status    # the nodes and partitions (sinfo); exit 1 when it is not up
#   bash scripts/slurm_cluster.sh stop      # stop the daemons (the config and logs stay in $SLURM_CLUSTER_DIR)
#
# Partitions: `debug` (default; PreemptMode=REQUEUE with GraceTime) and `urgent` (higher PriorityTier: a job there
# preempts debug's jobs; PreemptType=preempt/partition_prio). No accounting (no slurmdbd): sacct has nothing, as on
# many small clusters. Needs root (the daemons, /etc/hosts, /etc/slurm/slurm.conf); it refuses to overwrite a
# slurm.conf it did not write.
# Environment: SLURM_CLUSTER_INSTALL (missing: apt-get only when a package is missing, the default; always: apt-get
# update and install every time, as CI does), SLURM_CLUSTER_DIR (state, spool and logs; default
# /tmp/dp-scaling-slurm), SLURM_CLUSTER_CPUS (CPUs each node offers; default 4), SLURM_CLUSTER_GRACE_S (preemption
# GraceTime; default 30), SLURM_CLUSTER_PORT (slurmctld's port; n1 and n2 use the next two; default 16817).
set -euo pipefail

DIR="${SLURM_CLUSTER_DIR:-/tmp/dp-scaling-slurm}"
CPUS="${SLURM_CLUSTER_CPUS:-4}"
GRACE_S="${SLURM_CLUSTER_GRACE_S:-30}"
PORT="${SLURM_CLUSTER_PORT:-16817}"
CONF=/etc/slurm/slurm.conf
MARK="# written by dp-scaling scripts/slurm_cluster.sh"
NODES=(n1 n2)

say() { echo "slurm_cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "must run as root (it starts daemons and writes /etc/slurm/slurm.conf and /etc/hosts)"
}

install_packages() {
  if [ "${SLURM_CLUSTER_INSTALL:-missing}" != always ] && command -v slurmctld >/dev/null \
    && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get to install them"
  say "installing slurm-wlm and munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q slurm-wlm munge >/dev/null
}

write_config() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; move it away first (this script never overwrites it)"
  fi
  mkdir -p "$DIR"/{state,log} /etc/slurm
  for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
  local mem_mb=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2))
  cat > "$CONF.tmp" <<EOF
$MARK
ClusterName=dpscaling
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire seconds before it starts again (slurm.conf(5)); the minimum, for tests
AuthInfo=cred_expire=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
ReturnToService=2
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobRequeue=1
KillWait=30
MinJobAge=300
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
InactiveLimit=0
EOF
  local i=1
  for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeAddr=127.0.0.1 NodeHostname=$n Port=$((PORT + i)) CPUs=$CPUS RealMemory=$mem_mb State=UNKNOWN" \
      >> "$CONF.tmp"
    i=$((i + 1))
  done
  cat >> "$CONF.tmp" <<EOF
PartitionName=debug Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=$GRACE_S OverSubscribe=NO
PartitionName=urgent Nodes=$(IFS=,; echo "${NODES[*]}") MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF OverSubscribe=NO
EOF
  mv "$CONF.tmp" "$CONF"
  # JAX takes the first node's name as the coordinator's host: the node names must resolve
  for n in "${NODES[@]}"; do
    grep -qE "^127\.0\.0\.1[[:space:]]+(.*[[:space:]])?$n([[:space:]]|$)" /etc/hosts || echo "127.0.0.1 $n" >> /etc/hosts
  done
}

running() {  # running PIDFILE: the process named in PIDFILE is alive
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || /usr/sbin/create-munge-key -f; }
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start (see /var/log/munge/munged.log)"
}

up() {  # every node idle or allocated, none down
  local states
  states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  [ "$(echo "$states" | grep -cE ' (idle|alloc|mix|comp)')" -ge "${#NODES[@]}" ]
}

start() {
  need_root
  install_packages
  write_config
  start_munge
  running "$DIR/slurmctld.pid" || slurmctld -c -f "$CONF"  # -c: no jobs or node states of an earlier start
  for n in "${NODES[@]}"; do
    running "$DIR/slurmd-$n.pid" || slurmd -f "$CONF" -N "$n"
  done
  for _ in $(seq 150); do
    if up; then
      scontrol update nodename="$(IFS=,; echo "${NODES[*]}")" state=resume >/dev/null 2>&1 || true
      say "up: nodes ${NODES[*]}, partitions debug (default) and urgent; config $CONF, logs $DIR/log"
      return
    fi
    sleep 0.2
  done
  sinfo -N >&2 || true
  die "the nodes did not come up within 30 s (logs: $DIR/log)"
}

stop() {
  need_root
  if command -v scancel >/dev/null && [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then
    scancel --full --quiet --signal=KILL "--user=$(id -un)" 2>/dev/null || true
  fi
  for f in "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"; do
    [ -f "$f" ] || continue
    local pid
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$f"
  done
  say "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) if up; then sinfo; else sinfo 2>&1 >&2 || true; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
