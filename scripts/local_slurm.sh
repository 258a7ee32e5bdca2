#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, and Open MPI beside it: what the tests of the
# launch recipes in docs/distributed.md run on, and a way to try those recipes by hand.
#
#   bash scripts/local_slurm.sh install         # as root: the Debian packages (setup.sh --test)
#   bash scripts/local_slurm.sh start           # as root: installs what is missing, starts it
#   bash scripts/local_slurm.sh start --nodes=2 # two hosts: node1 and node2, see below
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
# it exits 1 with the daemons' logs when the cluster does not come up within 60 s. When
# slurmctld answers but a node's slurmd is gone (a host that died), `start` starts that
# slurmd again and nothing else: the node comes back and the cluster keeps its jobs.
#
# `start --nodes=2` makes two hosts of this machine instead: node1 (slurmctld and a slurmd)
# and node2 (a slurmd), each in a network namespace of its own (LOCAL_SLURM_NETNS and
# LOCAL_SLURM_NETNS_2) with its own address on a virtual link between the two (a veth pair,
# eth0 in each: 10.231.0.1 and 10.231.0.2; nothing is routed anywhere else) and its own host
# name (a UTS namespace). Both see a hosts file that names the two (a mount namespace whose
# /etc/hosts is LOCAL_SLURM_DIR/hosts; the machine's own is untouched), so SLURM, JAX's
# coordinator and gloo resolve node1 and node2 as they would separate hosts. `run` enters
# node1. Each node keeps its files apart (slurmd-node1.log, spool/node1, ...).
set -euo pipefail

dir="${LOCAL_SLURM_DIR:-/tmp/transformer_jax_slurm}"
netns="${LOCAL_SLURM_NETNS:-transformer_jax_slurm}"
netns2="${LOCAL_SLURM_NETNS_2:-${netns}_2}"
conf="$dir/slurm.conf"
ns_dir="$dir/namespaces"  # node1's and node2's UTS namespaces and the mount namespace.
packages=(slurm-wlm munge openmpi-bin iproute2)

die() { echo "local_slurm.sh: $*" >&2; exit 1; }

two_hosts() { [ "$(cat "$dir/nodes" 2>/dev/null)" = 2 ]; }

# The namespaces of node N (1 or 2) for nsenter: with one node, its network namespace alone.
node_namespaces() {
  if two_hosts; then
    local net="$netns"
    [ "$1" = 2 ] && net="$netns2"
    echo "--net=/run/netns/$net --uts=$ns_dir/uts$1 --mount=$ns_dir/mnt"
  else
    echo "--net=/run/netns/$netns"
  fi
}

# nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the cgroup mounts under it.
# shellcheck disable=SC2046  # node_namespaces gives several words.
in_node() { local node="$1"; shift; SLURM_CONF="$conf" nsenter $(node_namespaces "$node") "$@"; }
in_netns() { in_node 1 "$@"; }

# The nodes' states, one a line, when slurmctld answers (idle, mixed, allocated, ...).
node_states() {
  [ -f "$conf" ] && ip netns list 2>/dev/null | grep -qw "$netns" \
    && in_netns sinfo -h -N -o %T 2>/dev/null
}

answers() {
  local states
  states="$(node_states)"
  [ -n "$states" ] && ! grep -qE '^(down|drain|fail|unknown)' <<<"$states"
}

node_names() { if two_hosts; then echo node1 node2; else echo localhost; fi; }

# A host that died (its slurmd killed) and came back: start its slurmd again, in its own
# namespaces, and let slurmctld take the node back (ReturnToService=2). Nothing else restarts.
restart_lost_nodes() {
  local n=0 name pid
  for name in $(node_names); do
    n=$((n + 1))
    pid="$(cat "$dir/slurmd-$name.pid" 2>/dev/null || true)"
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
      in_node "$n" slurmd -N "$name" -f "$conf"
      echo "Restarted slurmd on $name (its daemon was gone)."
    fi
  done
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
  local about controller nodes names slurmd_timeout=300
  if two_hosts; then
    slurmd_timeout=20
    about='start --nodes=2: two hosts of this machine, node1 and node2, joined by a virtual
# link inside network namespaces; nothing outside can reach them.'
    controller='node1(10.231.0.1)'
    nodes='NodeName=node1 NodeAddr=10.231.0.1 CPUs=8 State=UNKNOWN
NodeName=node2 NodeAddr=10.231.0.2 CPUs=8 State=UNKNOWN'
    names=node1,node2
  else
    about='one node, this machine, reachable only on loopback.'
    controller='localhost(127.0.0.1)'
    nodes='NodeName=localhost NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN'
    names=localhost
  fi
  cat >"$conf" <<EOF
# Written by scripts/local_slurm.sh $about
ClusterName=transformer_jax
SlurmctldHost=$controller
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
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
# Seconds a node may not answer before slurmctld marks it DOWN and fails its jobs: SLURM's
# default (300) on one node; 20 with two hosts, so that a host that died or lost its link
# ends its job in seconds, not minutes.
SlurmdTimeout=$slurmd_timeout
$nodes
PartitionName=local Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
}

# node1 and node2: network namespaces joined by a veth pair (eth0 in each), UTS namespaces
# named after them, and one mount namespace whose /etc/hosts names both.
make_two_hosts() {
  local n
  mkdir -p "$ns_dir"
  # A persistent mount namespace must be bound to a file on a private mount.
  if ! mountpoint -q "$ns_dir"; then
    mount --bind "$ns_dir" "$ns_dir"
    mount --make-private "$ns_dir"
  fi
  for n in 1 2; do
    touch "$ns_dir/uts$n"
    unshare --uts="$ns_dir/uts$n" hostname "node$n"
  done
  ip netns add "$netns"
  ip netns add "$netns2"
  ip link add eth0 netns "$netns" type veth peer name eth0 netns "$netns2"
  ip -n "$netns" addr add 10.231.0.1/24 dev eth0
  ip -n "$netns2" addr add 10.231.0.2/24 dev eth0
  for n in "$netns" "$netns2"; do
    ip -n "$n" link set lo up
    ip -n "$n" link set eth0 up
  done
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n10.231.0.1\tnode1\n10.231.0.2\tnode2\n' \
    >"$dir/hosts"
  touch "$ns_dir/mnt"
  unshare --mount="$ns_dir/mnt" --propagation=private mount --bind "$dir/hosts" /etc/hosts
}

remove_two_hosts() {
  local file
  for file in "$ns_dir/uts1" "$ns_dir/uts2" "$ns_dir/mnt"; do
    umount "$file" 2>/dev/null || true
  done
  umount "$ns_dir" 2>/dev/null || true
  rm -rf "$ns_dir"
  if ip netns list 2>/dev/null | grep -qw "$netns2"; then
    ip netns del "$netns2"
  fi
}

start() {
  local nodes=1
  case "${1:-}" in
    '' | --nodes=1) ;;
    --nodes=2) nodes=2 ;;
    *) die "start takes --nodes=1 (the default) or --nodes=2, not '$1'." ;;
  esac
  [ "$(id -u)" -eq 0 ] || die "start needs root (it installs Debian packages and starts \
munged, slurmctld and slurmd as root); run it with sudo."
  if [ -n "$(node_states)" ]; then  # slurmctld answers: keep the cluster and its jobs.
    local running
    running="$(cat "$dir/nodes" 2>/dev/null || echo 1)"
    [ "$running" = "$nodes" ] || die "a cluster of $running node(s) is running in $dir; \
stop it first (bash scripts/local_slurm.sh stop), or start this one with another \
LOCAL_SLURM_DIR and LOCAL_SLURM_NETNS."
    restart_lost_nodes
    for _ in $(seq 120); do
      if answers; then
        echo "The local SLURM cluster is up: bash scripts/local_slurm.sh run sinfo"
        return
      fi
      sleep 0.5
    done
    echo "local_slurm.sh: a node is still down 60 s after its slurmd started:" >&2
    in_netns sinfo -N >&2 || true
    exit 1
  fi
  install
  mkdir -p "$dir"
  start_munge
  stop_daemons
  # A cluster whose daemons were killed (a session or a test run ended hard) leaves its jobs in
  # the saved state: a restart would recover them, and the node would stay busy with jobs
  # nothing runs. Start from nothing.
  kill_leftovers
  remove_two_hosts
  if ip netns list | grep -qw "$netns"; then
    ip netns del "$netns"
  fi
  rm -rf "$dir/state" "$dir/spool"
  echo "$nodes" >"$dir/nodes"
  local names=(localhost)
  if two_hosts; then
    make_two_hosts
    names=(node1 node2)
  else
    ip netns add "$netns"
    ip netns exec "$netns" ip link set lo up
  fi
  write_conf
  in_node 1 slurmctld -f "$conf"
  local n
  for n in "${!names[@]}"; do
    in_node $((n + 1)) slurmd -N "${names[$n]}" -f "$conf"
  done
  for _ in $(seq 120); do
    if [ "$(node_states | sort -u)" = idle ]; then
      echo "The local SLURM cluster is up (nodes ${names[*]}, partition local, files in $dir)."
      echo "Try: bash scripts/local_slurm.sh run srun -N ${#names[@]} -n 2 hostname"
      return
    fi
    sleep 0.5
  done
  echo "local_slurm.sh: the cluster did not come up within 60 s. Its logs:" >&2
  tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd*.log >&2 || true
  in_netns sinfo >&2 || true
  exit 1
}

# Every process left in the namespace once the daemons are gone: the job steps of a cluster
# whose daemons were killed.
kill_leftovers() {
  local n
  for n in "$netns" "$netns2"; do
    if ip netns list 2>/dev/null | grep -qw "$n"; then
      ip netns pids "$n" | xargs -r kill -9 2>/dev/null || true
    fi
  done
}

stop_daemons() {
  local pids=()
  local pid file
  for file in "$dir"/slurmd*.pid "$dir/slurmctld.pid"; do
    # Read first: a daemon removes its pid file as it exits.
    pid="$(cat "$file" 2>/dev/null || true)"
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then
      pids+=("$pid")
    fi
  done
  for _ in $(seq 40); do
    [ ${#pids[@]} -gt 0 ] && kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.25
  done
  [ ${#pids[@]} -gt 0 ] && kill -9 "${pids[@]}" 2>/dev/null || true
  rm -f "$dir"/slurmd*.pid "$dir/slurmctld.pid"
}

stop() {
  if answers; then
    in_netns scancel --full --signal=KILL --user=root 2>/dev/null || true
  fi
  stop_daemons
  rm -rf "$dir/state" "$dir/spool"
  kill_leftovers
  remove_two_hosts
  if ip netns list 2>/dev/null | grep -qw "$netns"; then
    ip netns del "$netns"
  fi
  rm -f "$dir/nodes"
  echo "The local SLURM cluster is stopped (munged is left running)."
}

case "${1:-}" in
  install) install ;;
  start) start "${@:2}" ;;
  stop) stop ;;
  # A node that is down (a host that died) leaves the cluster usable: slurmctld answers.
  status) if [ -n "$(node_states)" ]; then in_netns sinfo; else die "not running: run start first."; fi ;;
  run)
    shift
    [ -n "$(node_states)" ] \
      || die "the local SLURM cluster is not running: bash scripts/local_slurm.sh start"
    # exec: the command keeps this process id, so a signal to it reaches the command.
    # --wd: entering a mount namespace would start the command in /, and sbatch would run
    # the job there.
    # shellcheck disable=SC2046  # node_namespaces gives several words.
    SLURM_CONF="$conf" exec nsenter $(node_namespaces 1) --wd="$PWD" "$@" ;;
  *) die "usage: bash scripts/local_slurm.sh install|start [--nodes=2]|stop|status|run COMMAND..." ;;
esac
