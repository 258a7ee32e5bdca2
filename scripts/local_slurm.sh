#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, and Open MPI beside it: what the tests of the
# launch recipes in docs/distributed.md run on, and a way to try those recipes by hand.
#
#   bash scripts/local_slurm.sh install         # as root: the Debian packages (setup.sh --test)
#   bash scripts/local_slurm.sh start           # as root: installs what is missing, starts it
#   bash scripts/local_slurm.sh run sbatch train.sbatch   # any command, inside the cluster
#   bash scripts/local_slurm.sh run squeue
#   bash scripts/local_slurm.sh stop
#
# What it starts: munged (SLURM's authentication, a Unix socket), slurmctld and slurmd (SLURM
# 22.05 from Debian's slurm-wlm). The two daemons bind every interface of their network
# namespace, so they run in one of their own, LOCAL_SLURM_NETNS, whose only interface is
# loopback: nothing outside this machine can reach them, nor the JAX coordinators and the
# Open MPI daemons of the jobs they start. `run` enters that namespace, with SLURM_CONF set.
#
# The node is `localhost` with 8 CPUs whatever this machine has (SlurmdParameters=
# config_overrides), so the recipes' 8 tasks a node fit on a 2-core machine; the partition
# lets 4 jobs share a CPU (OverSubscribe=FORCE:4). Its files (slurm.conf, the daemons' logs
# and state) are in LOCAL_SLURM_DIR. `start` is a no-op when the cluster answers already;
# otherwise it starts from an empty state (no job of a cluster killed earlier comes back);
# it exits 1 with the daemons' logs when the cluster does not come up within 60 s.
set -euo pipefail

dir="${LOCAL_SLURM_DIR:-/tmp/transformer_jax_slurm}"
netns="${LOCAL_SLURM_NETNS:-transformer_jax_slurm}"
conf="$dir/slurm.conf"
packages=(slurm-wlm munge openmpi-bin)

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

# nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the cgroup mounts under it.
in_netns() { SLURM_CONF="$conf" nsenter --net="/run/netns/$netns" "$@"; }

# The node's state when slurmctld answers (idle, mixed, allocated, completing, ...).
node_state() {
  [ -f "$conf" ] && ip netns list 2>/dev/null | grep -qw "$netns" \
    && in_netns sinfo -h -o %T 2>/dev/null | head -1
}

answers() {
  local state
  state="$(node_state)"
  [ -n "$state" ] && [[ ! "$state" =~ ^(down|drain|fail|unknown) ]]
}

install() {
  local missing=()
  for package in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'
    then
      missing+=("$package")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" -eq 0 ] || die "missing Debian packages: ${missing[*]}. Install them with:
  sudo apt-get update && sudo apt-get install -y ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
    echo "Installed: ${missing[*]}"
  fi
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  # As root (containers often have no munge user to switch to): --force.
  munged --force 2>"$dir/munged.err" || die "munged did not start: $(cat "$dir/munged.err")"
}

write_conf() {
  mkdir -p "$dir/state" "$dir/spool"
  cat >"$conf" <<EOF
# Written by scripts/local_slurm.sh: one node, this machine, reachable only on loopback.
ClusterName=transformer_jax
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
# With IPv4 alone SLURM asks getaddrinfo for AI_ADDRCONFIG addresses, and a namespace with
# loopback only has none; with IPv6 enabled it asks for any family, and binds both.
CommunicationParameters=EnableIPv6
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
# Seconds between SIGTERM and SIGKILL at a time limit or scancel (SLURM's default: 30).
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=local Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

start() {
  [ "$(id -u)" -eq 0 ] || die "start needs root (it installs Debian packages and starts \
munged, slurmctld and slurmd as root); run it with sudo."
  if answers; then
    echo "The local SLURM cluster is up: bash scripts/local_slurm.sh run sinfo"
    return
  fi
  install
  mkdir -p "$dir"
  start_munge
  stop_daemons
  # A cluster whose daemons were killed (a session or a test run ended hard) leaves its jobs in
  # the saved state: a restart would recover them, and the node would stay busy with jobs
  # nothing runs. Start from nothing.
  kill_leftovers
  if ! ip netns list | grep -qw "$netns"; then
    ip netns add "$netns"
  fi
  rm -rf "$dir/state" "$dir/spool"
  ip netns exec "$netns" ip link set lo up
  write_conf
  in_netns slurmctld -f "$conf"
  in_netns slurmd -N localhost -f "$conf"
  for _ in $(seq 120); do
    if [ "$(node_state)" = idle ]; then
      echo "The local SLURM cluster is up (node localhost, partition local, files in $dir)."
      echo "Try: bash scripts/local_slurm.sh run srun -n 2 hostname"
      return
    fi
    sleep 0.5
  done
  echo "local_slurm.sh: the cluster did not come up within 60 s. Its logs:" >&2
  tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd.log >&2 || true
  in_netns sinfo >&2 || true
  exit 1
}

# Every process left in the namespace once the daemons are gone: the job steps of a cluster
# whose daemons were killed.
kill_leftovers() {
  if ip netns list 2>/dev/null | grep -qw "$netns"; then
    ip netns pids "$netns" | xargs -r kill -9 2>/dev/null || true
  fi
}

stop_daemons() {
  local pids=()
  local pid
  for daemon in slurmd slurmctld; do
    # Read first: a daemon removes its pid file as it exits.
    pid="$(cat "$dir/$daemon.pid" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      pids+=("$pid")
    fi
  done
  for _ in $(seq 40); do
    [ ${#pids[@]} -gt 0 ] && kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.25
  done
  [ ${#pids[@]} -gt 0 ] && kill -9 "${pids[@]}" 2>/dev/null || true
  rm -f "$dir/slurmd.pid" "$dir/slurmctld.pid"
}

stop() {
  if answers; then
    in_netns scancel --full --signal=KILL --user=root 2>/dev/null || true
  fi
  stop_daemons
  rm -rf "$dir/state" "$dir/spool"
  kill_leftovers
  if ip netns list 2>/dev/null | grep -qw "$netns"; then
    ip netns del "$netns"
  fi
  echo "The local SLURM cluster is stopped (munged is left running)."
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) if answers; then in_netns sinfo; else die "not running: run start first."; fi ;;
  run)
    shift
    answers || die "the local SLURM cluster is not running: bash scripts/local_slurm.sh start"
    # exec: the command keeps this process id, so a signal to it reaches the command.
    SLURM_CONF="$conf" exec nsenter --net="/run/netns/$netns" "$@" ;;
  *) die "usage: bash scripts/local_slurm.sh install|start|stop|status|run COMMAND..." ;;
esac
