#!/usr/bin/env bash
# Two real libvirt hosts on one machine, mig-a and mig-b, for vmlet's migration
# and resize tests: one libvirtd (with its virtlogd) per host, each in a network
# namespace and a mount namespace of its own. Needs root, iproute2, util-linux
# (unshare), libvirt-daemon-system and qemu-system-x86 (hack/deps.sh installs them).
#
#   hack/hosts.sh up       create what is missing and start the daemons that do not
#                          run; reuses running ones; waits until each answers and
#                          a define works (up to $VMLET_HOSTS_WAIT s, default 60)
#   hack/hosts.sh down     stop everything running in the hosts' namespaces (the
#                          daemons and their guests) and in the guest LAN's (its
#                          dnsmasq), remove the namespaces, the links, the bridges
#                          and the hosts' directories
#   hack/hosts.sh uris     print `export VMLET_LIBVIRT_MIG_A_URI=...`,
#                          `..._MIG_B_URI=...` and the guest LAN's
#                          VMLET_MIG_LAN_{BRIDGE,PROBE,GATEWAY} (for eval)
#   hack/hosts.sh status   one line per host and one for the guest LAN; exit 1
#                          unless both answer and the LAN is complete
#
# Network: a bridge vmlet-mig0 in the root namespace with 10.237.0.1/24, and per
# host a veth pair from the bridge into the host's namespace (netns vmlet-mig-a
# with 10.237.0.11/24, vmlet-mig-b with 10.237.0.12/24). Nothing is routed
# anywhere else. libvirtd listens only on its host's address, TCP without
# authentication (qemu+tcp://10.237.0.11/system): reachable from the root
# namespace, where vmlet and the tests run, and from the other host, which
# peer-to-peer migration needs. Each qemu.conf sets migration_host and
# migration_address to the host's own address.
#
# Guest LAN: one layer-2 segment that guests of both hosts share, apart from the
# migration link above. A harness namespace vmlet-mig-lan holds a bridge lan0
# with 10.240.0.1/24 and a dnsmasq (DHCP only: 10.240.0.100-199, 10-minute
# leases, no router, no DNS, bound to lan0; pid, lease and log files in
# $VMLET_HOSTS_DIR/mig-lan/).
# Per host a veth pair runs from lan0 (port mig-a / mig-b) into the host's
# namespace, where its end (lan-uplink) is a port of the bridge vmlan0 (up, no
# address; IPv6 off on both, so the host itself is not on that segment). Guests
# join with <interface type='bridge'><source bridge='vmlan0'/>, get leases from
# that dnsmasq and reach each other; tests reach them from the namespace
# (`ip netns exec vmlet-mig-lan ...`). Nothing there is routed anywhere, and a
# guest that migrates keeps its address: both hosts' vmlan0 are the same LAN.
#
# Private to each host (mount namespace; bind mounts of directories under
# $VMLET_HOSTS_DIR/<host>, default /var/lib/vmlet/hosts/<host>): /etc/libvirt
# (a minimal libvirtd.conf and qemu.conf, nothing else: no default network),
# /run/libvirt (a tmpfs), /var/lib/libvirt, /var/cache/libvirt, /var/log/libvirt
# (libvirtd.log and virtlogd.log are there, seen from the root namespace as
# $VMLET_HOSTS_DIR/<host>/log/). Everything else, e.g. /var/lib/vmlet where the
# tests put guest images, is shared, so both hosts' QEMU see a file at the same
# path. Each host has a fixed host_uuid (this kind of machine has no DMI UUID, and
# two hosts with the same one refuse to migrate to each other) and no cgroup
# controllers (both daemons would share one cgroup tree). KVM is used where
# /dev/kvm exists (made root:kvm 0660 first, see hack/lib/libvirt.sh).
set -euo pipefail

HACK=$(cd "$(dirname "$0")" && pwd)
SELF=$HACK/$(basename "$0")

log() { echo "hosts: $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=hack/lib/libvirt.sh
source "$HACK/lib/libvirt.sh"

DIR=${VMLET_HOSTS_DIR:-/var/lib/vmlet/hosts}
WAIT_SECONDS=${VMLET_HOSTS_WAIT:-60}
BRIDGE=vmlet-mig0
PREFIX=10.237.0
BRIDGE_ADDR=$PREFIX.1
HOSTS=(mig-a mig-b)
declare -A ADDRESS=([mig-a]=$PREFIX.11 [mig-b]=$PREFIX.12)
declare -A HOST_UUID=([mig-a]=7a3c5e10-9b2d-4f61-8e0a-1c2d3e4f5a01 [mig-b]=7a3c5e10-9b2d-4f61-8e0a-1c2d3e4f5a02)
# The guest LAN (see above); interface names stay within 15 characters.
LAN_NS=vmlet-mig-lan
LAN_BRIDGE=lan0
LAN_GATEWAY=10.240.0.1
LAN_DHCP_START=10.240.0.100
LAN_DHCP_END=10.240.0.199
HOST_LAN_BRIDGE=vmlan0
HOST_LAN_UPLINK=lan-uplink
LAN_DIR=$DIR/mig-lan
# Where QEMU writes guest consoles for vmlet's domains (see xml.rs); shared by both
# hosts, and created by vmlet only for a local URI.
CONSOLE_LOG_DIR=/var/log/vmlet/console

netns() { echo "vmlet-$1"; }
uri() { echo "qemu+tcp://${ADDRESS[$1]}/system"; }
host_dir() { echo "$DIR/$1"; }
env_name() { local h=${1^^}; echo "VMLET_LIBVIRT_${h//-/_}_URI"; }

# Short timeouts for commands that only talk to the kernel, longer for libvirt.
k() { timeout 20 "$@"; }

answers() { timeout 10 virsh -c "$(uri "$1")" version >/dev/null 2>&1; }

need_root() { [[ $(id -u) == 0 ]] || die "must run as root (namespaces, mounts, libvirtd)"; }

need_tools() {
  local tool missing=()
  for tool in ip unshare mount sysctl libvirtd virtlogd virsh qemu-system-x86_64 dnsmasq; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  ((${#missing[@]} == 0)) || die "missing ${missing[*]}: run hack/deps.sh (as root)"
}

# --- network -------------------------------------------------------------------------

has_netns() { [[ -e /run/netns/$1 ]]; }

# has_address <netns or ""> <link> <address>: the link has <address>/24.
has_address() {
  local ns=$1 link=$2 address=$3 shown
  if [[ -n $ns ]]; then
    shown=$(k ip -n "$ns" -4 -o addr show dev "$link")
  else
    shown=$(k ip -4 -o addr show dev "$link")
  fi
  [[ $shown == *"inet $address/24 "* ]]
}

up_network() {
  if ! k ip link show "$BRIDGE" >/dev/null 2>&1; then
    k ip link add "$BRIDGE" type bridge
    log "bridge $BRIDGE created"
  fi
  has_address "" "$BRIDGE" "$BRIDGE_ADDR" || k ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
  k ip link set "$BRIDGE" up
  local host ns
  for host in "${HOSTS[@]}"; do
    ns=$(netns "$host")
    has_netns "$ns" || k ip netns add "$ns"
    if ! k ip link show "$ns" >/dev/null 2>&1; then
      # The namespace's end is called mig0 inside it.
      k ip link add "$ns" type veth peer name mig0 netns "$ns"
    fi
    k ip link set "$ns" master "$BRIDGE" up
    k ip -n "$ns" link set lo up
    has_address "$ns" mig0 "${ADDRESS[$host]}" || k ip -n "$ns" addr add "${ADDRESS[$host]}/24" dev mig0
    k ip -n "$ns" link set mig0 up
  done
}

down_network() {
  local host ns
  for host in "${HOSTS[@]}"; do
    ns=$(netns "$host")
    # Deleting the namespace deletes mig0, and with it its peer on the bridge.
    if has_netns "$ns"; then
      k ip netns delete "$ns"
      log "namespace $ns removed"
    fi
    if k ip link show "$ns" >/dev/null 2>&1; then
      k ip link delete "$ns"
    fi
  done
  if k ip link show "$BRIDGE" >/dev/null 2>&1; then
    k ip link delete "$BRIDGE"
    log "bridge $BRIDGE removed"
  fi
}

# --- guest LAN -----------------------------------------------------------------------

has_link() { k ip -n "$1" link show "$2" >/dev/null 2>&1; }

# no_ipv6 <netns> <link>: no link-local address either, so the link's owner
# (a host's namespace) stays off the guests' segment.
no_ipv6() { k ip netns exec "$1" sysctl -q -w "net.ipv6.conf.$2.disable_ipv6=1" >/dev/null 2>&1 || true; }

up_lan() {
  local host ns
  has_netns "$LAN_NS" || { k ip netns add "$LAN_NS"; log "namespace $LAN_NS created"; }
  k ip -n "$LAN_NS" link set lo up
  if ! has_link "$LAN_NS" "$LAN_BRIDGE"; then
    k ip -n "$LAN_NS" link add "$LAN_BRIDGE" type bridge
    log "bridge $LAN_BRIDGE created in $LAN_NS"
  fi
  has_address "$LAN_NS" "$LAN_BRIDGE" "$LAN_GATEWAY" || k ip -n "$LAN_NS" addr add "$LAN_GATEWAY/24" dev "$LAN_BRIDGE"
  k ip -n "$LAN_NS" link set "$LAN_BRIDGE" up
  for host in "${HOSTS[@]}"; do
    ns=$(netns "$host")
    if ! has_link "$ns" "$HOST_LAN_BRIDGE"; then
      k ip -n "$ns" link add "$HOST_LAN_BRIDGE" type bridge
      log "$host: bridge $HOST_LAN_BRIDGE created in $ns"
    fi
    no_ipv6 "$ns" "$HOST_LAN_BRIDGE"
    k ip -n "$ns" link set "$HOST_LAN_BRIDGE" up
    # Half a pair (the other namespace was recreated) is useless: start afresh.
    if has_link "$LAN_NS" "$host" && ! has_link "$ns" "$HOST_LAN_UPLINK"; then
      k ip -n "$LAN_NS" link delete "$host"
    fi
    if has_link "$ns" "$HOST_LAN_UPLINK" && ! has_link "$LAN_NS" "$host"; then
      k ip -n "$ns" link delete "$HOST_LAN_UPLINK"
    fi
    if ! has_link "$LAN_NS" "$host"; then
      # The host's end is called lan-uplink inside its namespace.
      k ip -n "$LAN_NS" link add "$host" type veth peer name "$HOST_LAN_UPLINK" netns "$ns"
      log "$host: veth $host (port of $LAN_BRIDGE in $LAN_NS) <-> $HOST_LAN_UPLINK (port of $HOST_LAN_BRIDGE in $ns)"
    fi
    no_ipv6 "$ns" "$HOST_LAN_UPLINK"
    k ip -n "$LAN_NS" link set "$host" master "$LAN_BRIDGE" up
    k ip -n "$ns" link set "$HOST_LAN_UPLINK" master "$HOST_LAN_BRIDGE" up
  done
  start_dnsmasq
}

# start_dnsmasq: Debian's dnsmasq in the LAN's namespace, DHCP only, unless it
# runs already. It forks into a session of its own once it is up, so the
# timeout never reaches the daemon.
start_dnsmasq() {
  mkdir -p "$LAN_DIR"
  if pid_alive "$LAN_DIR/dnsmasq.pid" dnsmasq; then
    log "dnsmasq (pid $(<"$LAN_DIR/dnsmasq.pid")) already serving $LAN_NS"
    return 0
  fi
  rm -f "$LAN_DIR/dnsmasq.pid"
  touch "$LAN_DIR/dnsmasq.leases"
  # --conf-file=/dev/null: no /etc/dnsmasq.conf; --port=0: no DNS at all;
  # --dhcp-option=3: no router; --no-ping: offer a new address at once (by
  # default dnsmasq first pings it and waits ~3 s, so a guest's first lease
  # would miss its boot-time wait).
  k ip netns exec "$LAN_NS" dnsmasq \
    --conf-file=/dev/null \
    --port=0 \
    --no-ping \
    --interface="$LAN_BRIDGE" --except-interface=lo --bind-interfaces \
    --dhcp-range="$LAN_DHCP_START,$LAN_DHCP_END,255.255.255.0,10m" \
    --dhcp-option=3 \
    --dhcp-authoritative \
    --dhcp-leasefile="$LAN_DIR/dnsmasq.leases" \
    --pid-file="$LAN_DIR/dnsmasq.pid" \
    --log-facility="$LAN_DIR/dnsmasq.log" --log-dhcp
  log "dnsmasq (pid $(<"$LAN_DIR/dnsmasq.pid")) serving DHCP on $LAN_BRIDGE in $LAN_NS; log $LAN_DIR/dnsmasq.log"
}

down_lan() {
  stop_pid "$LAN_DIR/dnsmasq.pid" dnsmasq
  # Anything else left in the namespace (a test's shell) keeps it alive.
  stop_host mig-lan
  if has_netns "$LAN_NS"; then
    # Deleting it deletes lan0 and the ports, and with them their peers.
    k ip netns delete "$LAN_NS"
    log "namespace $LAN_NS removed"
  fi
  if [[ -d $LAN_DIR ]]; then
    rm -f -- "$LAN_DIR/dnsmasq.pid" "$LAN_DIR/dnsmasq.leases" "$LAN_DIR/dnsmasq.log"
    rmdir -- "$LAN_DIR" 2>/dev/null || log "$LAN_DIR not empty; left in place"
  fi
}

lan_status() {
  local host ns state="" ok=0 pid
  if has_netns "$LAN_NS"; then
    if has_address "$LAN_NS" "$LAN_BRIDGE" "$LAN_GATEWAY" 2>/dev/null; then
      state="bridge $LAN_BRIDGE $LAN_GATEWAY/24"
    else
      state="no bridge $LAN_BRIDGE with $LAN_GATEWAY/24"
      ok=1
    fi
    if pid_alive "$LAN_DIR/dnsmasq.pid" dnsmasq; then
      pid=$(<"$LAN_DIR/dnsmasq.pid")
      state+=", dnsmasq pid $pid, $(grep -c . "$LAN_DIR/dnsmasq.leases" 2>/dev/null || true) lease(s)"
    else
      state+=", no dnsmasq"
      ok=1
    fi
    for host in "${HOSTS[@]}"; do
      ns=$(netns "$host")
      if has_netns "$ns" && has_link "$ns" "$HOST_LAN_BRIDGE" && has_link "$LAN_NS" "$host"; then
        state+=", $host: $HOST_LAN_BRIDGE"
      else
        state+=", $host: not joined"
        ok=1
      fi
    done
  else
    state="no namespace"
    ok=1
  fi
  echo "guest LAN $LAN_NS: $state"
  return "$ok"
}

# --- daemons ---------------------------------------------------------------------------

write_config() {
  local host=$1 dir
  dir=$(host_dir "$host")
  mkdir -p "$dir"/{etc/qemu,lib,cache,log}
  cat >"$dir/etc/libvirtd.conf" <<EOF
# Written by hack/hosts.sh for host $host.
listen_tls = 0
listen_tcp = 1
listen_addr = "${ADDRESS[$host]}"
auth_tcp = "none"
host_uuid = "${HOST_UUID[$host]}"
log_outputs = "3:file:/var/log/libvirt/libvirtd.log"
EOF
  cat >"$dir/etc/qemu.conf" <<EOF
# Written by hack/hosts.sh for host $host.
migration_host = "${ADDRESS[$host]}"
migration_address = "${ADDRESS[$host]}"
cgroup_controllers = [ ]
EOF
}

# start_daemons <host>: virtlogd and libvirtd in the host's network namespace and
# a new mount namespace (see `private_mounts`).
start_daemons() {
  local host=$1 dir
  dir=$(host_dir "$host")
  write_config "$host"
  rm -f "$dir/libvirtd.pid" "$dir/virtlogd.pid"
  timeout 120 ip netns exec "$(netns "$host")" unshare --mount --propagation private -- "$SELF" __start "$host"
  log "$host: virtlogd (pid $(<"$dir/virtlogd.pid")) and libvirtd (pid $(<"$dir/libvirtd.pid")) started; logs in $dir/log/"
}

# Runs inside the host's namespaces (from start_daemons): the private mounts,
# then both daemons, which keep the mount namespace alive.
private_mounts_and_start() {
  local host=$1 dir
  dir=$(host_dir "$host")
  k mount --bind "$dir/etc" /etc/libvirt
  k mount -t tmpfs -o mode=0755,size=64m "vmlet-$host-run" /run/libvirt
  k mount --bind "$dir/lib" /var/lib/libvirt
  k mount --bind "$dir/cache" /var/cache/libvirt
  k mount --bind "$dir/log" /var/log/libvirt
  mkdir -p /var/lib/libvirt/qemu /var/cache/libvirt/qemu /var/log/libvirt/qemu
  # --daemon: each returns once its daemon is up (forked into a session of its
  # own, so the timeouts never reach the daemons).
  LIBVIRT_LOG_OUTPUTS="3:file:/var/log/libvirt/virtlogd.log" timeout 50 virtlogd --daemon --pid-file "$dir/virtlogd.pid"
  timeout 50 libvirtd --daemon --listen --pid-file "$dir/libvirtd.pid"
}

# stop_host <host>: stop every process in the host's network namespace (libvirtd,
# virtlogd, QEMU guests, a shell someone opened there): SIGTERM, SIGKILL after 15 s.
stop_host() {
  local host=$1 ns pids
  ns=$(netns "$host")
  has_netns "$ns" || return 0
  pids=$(k ip netns pids "$ns" | tr '\n' ' ')
  [[ -n ${pids// /} ]] || return 0
  log "$host: stopping pids $pids($(for p in $pids; do cat "/proc/$p/comm" 2>/dev/null; done | sort | uniq -c | tr -s ' \n' ' '))"
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 1 60); do
    [[ -z $(k ip netns pids "$ns") ]] && return 0
    sleep 0.25
  done
  pids=$(k ip netns pids "$ns" | tr '\n' ' ')
  log "$host: pids $pids ignored SIGTERM for 15s; killing them"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 1 40); do
    [[ -z $(k ip netns pids "$ns") ]] && return 0
    sleep 0.25
  done
  die "$host: processes $(k ip netns pids "$ns" | tr '\n' ' ')survive SIGKILL"
}

# --- commands --------------------------------------------------------------------------

up() {
  need_root
  need_tools
  prepare_host
  mkdir -p "$DIR" "$CONSOLE_LOG_DIR"
  up_network
  up_lan
  local host dir
  for host in "${HOSTS[@]}"; do
    dir=$(host_dir "$host")
    if pid_alive "$dir/libvirtd.pid" libvirtd && pid_alive "$dir/virtlogd.pid" virtlogd; then
      log "$host: libvirtd (pid $(<"$dir/libvirtd.pid")) already running"
      continue
    fi
    # One of the two died (or neither runs): start both afresh in a new mount
    # namespace, after stopping whatever is left in this host's namespace.
    stop_host "$host"
    start_daemons "$host"
  done
  for host in "${HOSTS[@]}"; do
    wait_answering "$(uri "$host")" "$WAIT_SECONDS" "$(host_dir "$host")/log/libvirtd.log"
    check_define "$(uri "$host")" "$WAIT_SECONDS" "$(host_dir "$host")/log/libvirtd.log"
  done
  log "ready: $(for host in "${HOSTS[@]}"; do printf '%s=%s ' "$host" "$(uri "$host")"; done)"
}

down() {
  need_root
  local host dir
  for host in "${HOSTS[@]}"; do
    stop_host "$host"
  done
  down_lan
  down_network
  for host in "${HOSTS[@]}"; do
    dir=$(host_dir "$host")
    # Only what `up` wrote there: the bind-mounted trees and pid files.
    if [[ -d $dir ]]; then
      rm -rf -- "${dir:?}/etc" "${dir:?}/lib" "${dir:?}/cache" "${dir:?}/log" "${dir:?}"/*.pid
      rmdir -- "$dir" 2>/dev/null || log "$dir not empty; left in place"
      log "$host: $dir removed"
    fi
  done
  rmdir -- "$DIR" 2>/dev/null || true
}

uris() {
  local host
  for host in "${HOSTS[@]}"; do
    echo "export $(env_name "$host")=$(uri "$host")"
  done
  echo "export VMLET_MIG_LAN_BRIDGE=$HOST_LAN_BRIDGE"
  echo "export VMLET_MIG_LAN_PROBE=$LAN_NS"
  echo "export VMLET_MIG_LAN_GATEWAY=$LAN_GATEWAY"
}

status() {
  local host dir ok=0 state
  for host in "${HOSTS[@]}"; do
    dir=$(host_dir "$host")
    if answers "$host"; then
      state="answers, $(timeout 10 virsh -c "$(uri "$host")" list --all --name 2>/dev/null | grep -c . || true) domain(s)"
    else
      state="does not answer"
      ok=1
    fi
    pid_alive "$dir/libvirtd.pid" libvirtd && state+=", libvirtd pid $(<"$dir/libvirtd.pid")"
    echo "$host $(uri "$host") $state"
  done
  lan_status || ok=1
  return "$ok"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  uris) uris ;;
  status) status ;;
  __start) private_mounts_and_start "$2" ;;
  *)
    echo "usage: $0 up|down|uris|status" >&2
    exit 64
    ;;
esac
