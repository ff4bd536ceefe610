#!/usr/bin/env bash
# A real libvirt host (qemu:///system) on a machine without systemd, for vmlet's
# integration tests and demo. Needs root and Debian's libvirt-daemon-system,
# libvirt-clients and qemu-system-x86.
#
#   hack/libvirtd.sh up     start virtlogd + libvirtd unless qemu:///system answers
#                           already; wait until `virsh list` works (up to 60 s);
#                           then (as root) the test network below
#   hack/libvirtd.sh down   remove the test network and its probe namespace, stop
#                           the daemons `up` started (and nothing else)
#   hack/libvirtd.sh uri    print the connection URI (for VMLET_LIBVIRT_QEMU_URI)
#   hack/libvirtd.sh env    print `export VMLET_LIBVIRT_QEMU_URI=...` and, while the
#                           probe namespace exists, the test network's exports
#                           (VMLET_LIBVIRT_QEMU_NETWORK{,_PROBE,_GATEWAY}), for eval
#   hack/libvirtd.sh status one line for the daemon, one for the network; exit 1
#                           unless both are up
#
# Test network: an isolated libvirt network `vmlet-lan` (no <forward>: nothing
# is routed or NATed anywhere; its DHCP hands out no router and no DNS server,
# and its dnsmasq serves no DNS) on the bridge vmlet-lan0 with the host address
# 10.239.0.1/24 and libvirt's DHCP for 10.239.0.100-199. Guests join it with
# <interface type='network'><source network='vmlet-lan'/>. Tests reach guests
# from the network namespace `vmlet-lan-probe` (`ip netns exec vmlet-lan-probe
# ...`): a veth pair whose root end (vmlet-lan-prb) is a port of vmlet-lan0 and
# whose end in the namespace (lan0) has 10.239.0.2/24, no default route. The
# host answers guests at 10.239.0.1 (DHCP, and whatever listens on 0.0.0.0);
# its 127.0.0.1 is not reachable from there (the kernel drops packets for
# 127.0.0.0/8 that arrive on another interface). libvirt 9.0 needs dnsmasq-base
# and iptables to start any network (hack/deps.sh). Its dnsmasq runs with
# no-ping, so a new guest's first lease comes at once, and leases last 10
# minutes (each test guest has a new MAC; 100 addresses must not run out
# behind the leases of guests long gone). `up` re-adds the probe
# port to the bridge each time (libvirt recreates the bridge when the network
# restarts).
#
# One libvirtd (no split daemons), as on Debian 12. Pid files of the daemons this
# script started live in $VMLET_LIBVIRT_STATE (default /run/vmlet-libvirt); daemon
# logs go to /var/log/libvirt/{libvirtd,virtlogd}.log. `down` leaves running qemu
# guests alone, as libvirtd itself does when it stops.
#
# KVM: where /dev/kvm exists, `up` makes it usable by the qemu user (group kvm,
# mode 0660, what Debian's udev rule does on a machine with udev) before libvirtd
# starts. Without that, libvirtd's QEMU capability probe (run as root) and its
# validity check (as libvirt-qemu) disagree about KVM, libvirtd re-probes QEMU
# every ~2 s and every define waits minutes behind the capability cache. After
# the start, `up` checks that a define answers within $VMLET_LIBVIRT_DEFINE_WAIT
# seconds (default 30) and prints libvirtd's log tail if it does not.
set -euo pipefail

URI=qemu:///system
STATE=${VMLET_LIBVIRT_STATE:-/run/vmlet-libvirt}
WAIT_SECONDS=${VMLET_LIBVIRT_WAIT:-60}
DEFINE_WAIT=${VMLET_LIBVIRT_DEFINE_WAIT:-30}
# The test network (see above). Interface names stay within 15 characters.
LAN=vmlet-lan
LAN_BRIDGE=vmlet-lan0
LAN_GATEWAY=10.239.0.1
LAN_DHCP_START=10.239.0.100
LAN_DHCP_END=10.239.0.199
LAN_PROBE=vmlet-lan-probe
LAN_PROBE_PORT=vmlet-lan-prb
LAN_PROBE_LINK=lan0
LAN_PROBE_ADDR=10.239.0.2

log() { echo "libvirtd: $*" >&2; }

# shellcheck source=hack/lib/libvirt.sh
source "$(dirname "$0")/lib/libvirt.sh"

answers() { timeout 10 virsh -c "$URI" version >/dev/null 2>&1; }

# start <daemon>: start it with a pid file in $STATE unless it runs already,
# whether started by us or by the system (its own pid file in /run).
start() {
  local daemon=$1
  if pid_alive "$STATE/$daemon.pid" "$daemon"; then
    log "$daemon already running (pid $(<"$STATE/$daemon.pid"), started by this script)"
    return 0
  fi
  if pid_alive "/run/$daemon.pid" "$daemon"; then
    log "$daemon already running (pid $(<"/run/$daemon.pid"), not started by this script)"
    return 0
  fi
  rm -f "$STATE/$daemon.pid"
  LIBVIRT_LOG_OUTPUTS="3:file:/var/log/libvirt/$daemon.log" \
    "/usr/sbin/$daemon" --daemon --pid-file "$STATE/$daemon.pid"
  log "$daemon started (log /var/log/libvirt/$daemon.log)"
}

up_daemons() {
  if answers; then
    log "$URI answers already"
    [[ $(id -u) == 0 ]] && prepare_kvm
    check_define "$URI" "$DEFINE_WAIT" /var/log/libvirt/libvirtd.log
    return 0
  fi
  [[ $(id -u) == 0 ]] || { log "must run as root"; exit 1; }
  prepare_host
  mkdir -p "$STATE"
  start virtlogd
  start libvirtd
  wait_answering "$URI" "$WAIT_SECONDS" /var/log/libvirt/libvirtd.log
  check_define "$URI" "$DEFINE_WAIT" /var/log/libvirt/libvirtd.log
  log "$URI ready: $(timeout 10 virsh -c "$URI" version 2>/dev/null | sed -n 's/^Running hypervisor: //p')"
}

up() {
  up_daemons
  if [[ $(id -u) == 0 ]]; then
    up_lan
  else
    log "not root: test network $LAN and namespace $LAN_PROBE not set up"
  fi
}

# --- the test network ------------------------------------------------------------

k() { timeout 20 "$@"; }
v() { timeout 60 virsh -q -c "$URI" "$@"; }

lan_defined() { v net-info "$LAN" >/dev/null 2>&1; }
# (No `| grep -q`: under pipefail, virsh killed by SIGPIPE would read as false.)
lan_active() { local names; names=$(v net-list --name) && [[ $'\n'$names$'\n' == *$'\n'"$LAN"$'\n'* ]]; }
has_netns() { [[ -e /run/netns/$1 ]]; }

# no-ping (libvirt's dnsmasq namespace): dnsmasq offers a new address at once
# instead of pinging it first and waiting ~3 s, which made a guest's first
# lease miss its boot-time wait.
lan_xml() {
  cat <<XML
<network xmlns:dnsmasq='http://libvirt.org/schemas/network/dnsmasq/1.0'>
  <name>$LAN</name>
  <bridge name='$LAN_BRIDGE' stp='off' delay='0'/>
  <dns enable='no'/>
  <ip address='$LAN_GATEWAY' netmask='255.255.255.0'>
    <dhcp>
      <range start='$LAN_DHCP_START' end='$LAN_DHCP_END'>
        <lease expiry='10' unit='minutes'/>
      </range>
    </dhcp>
  </ip>
  <dnsmasq:options>
    <dnsmasq:option value='no-ping'/>
  </dnsmasq:options>
</network>
XML
}

# up_lan: define the network if missing, start it if inactive, then the probe
# namespace and its port on the bridge. Each step checks first: a second `up`
# changes nothing.
up_lan() {
  local xml defined
  if ! lan_defined; then
    xml=$(mktemp)
    lan_xml >"$xml"
    v net-define "$xml" >/dev/null || { rm -f "$xml"; log "virsh net-define $LAN failed"; return 1; }
    rm -f "$xml"
    log "network $LAN defined (isolated, bridge $LAN_BRIDGE, $LAN_GATEWAY/24, DHCP $LAN_DHCP_START-$LAN_DHCP_END)"
  fi
  # A network of that name defined by someone else would put guests elsewhere.
  defined=$(v net-dumpxml --inactive "$LAN")
  if [[ $defined == *"<forward"* || $defined != *"name='$LAN_BRIDGE'"* || $defined != *"address='$LAN_GATEWAY'"* ]]; then
    log "network $LAN exists with another definition (a <forward>, or not bridge $LAN_BRIDGE / $LAN_GATEWAY);"
    log "remove it (virsh net-destroy $LAN; virsh net-undefine $LAN) or run $0 down, then up again"
    return 1
  fi
  if ! lan_active; then
    v net-start "$LAN" >/dev/null || { log "virsh net-start $LAN failed (dnsmasq-base and iptables installed? hack/deps.sh)"; return 1; }
    log "network $LAN started"
  fi

  has_netns "$LAN_PROBE" || { k ip netns add "$LAN_PROBE"; log "namespace $LAN_PROBE created"; }
  k ip -n "$LAN_PROBE" link set lo up
  # A port left over from an earlier namespace of that name has no peer in this one.
  if k ip link show "$LAN_PROBE_PORT" >/dev/null 2>&1 && ! k ip -n "$LAN_PROBE" link show "$LAN_PROBE_LINK" >/dev/null 2>&1; then
    k ip link delete "$LAN_PROBE_PORT"
  fi
  if ! k ip link show "$LAN_PROBE_PORT" >/dev/null 2>&1; then
    k ip link add "$LAN_PROBE_PORT" type veth peer name "$LAN_PROBE_LINK" netns "$LAN_PROBE"
    log "veth $LAN_PROBE_PORT (port of $LAN_BRIDGE) <-> $LAN_PROBE_LINK (in $LAN_PROBE)"
  fi
  k ip link set "$LAN_PROBE_PORT" master "$LAN_BRIDGE" up
  if [[ $(k ip -n "$LAN_PROBE" -4 -o addr show dev "$LAN_PROBE_LINK") != *"inet $LAN_PROBE_ADDR/24 "* ]]; then
    k ip -n "$LAN_PROBE" addr add "$LAN_PROBE_ADDR/24" dev "$LAN_PROBE_LINK"
  fi
  k ip -n "$LAN_PROBE" link set "$LAN_PROBE_LINK" up
  log "network $LAN up; probe namespace $LAN_PROBE at $LAN_PROBE_ADDR"
}

# down_lan: the namespace (its veth end takes the bridge port along), then the
# network. Needs libvirtd for the network; leaves it when libvirtd does not answer.
down_lan() {
  [[ $(id -u) == 0 ]] || { log "not root: test network left in place"; return 0; }
  if has_netns "$LAN_PROBE"; then
    k ip netns delete "$LAN_PROBE"
    log "namespace $LAN_PROBE removed"
  fi
  if k ip link show "$LAN_PROBE_PORT" >/dev/null 2>&1; then
    k ip link delete "$LAN_PROBE_PORT"
  fi
  if ! answers; then
    log "$URI does not answer: network $LAN (if any) left in place"
    return 0
  fi
  if lan_active; then
    v net-destroy "$LAN" >/dev/null
    log "network $LAN stopped"
  fi
  if lan_defined; then
    v net-undefine "$LAN" >/dev/null
    log "network $LAN undefined"
  fi
}

# Remove the test network, then stop the daemons this script started (their
# pid files are in $STATE).
down() {
  down_lan
  stop_pid "$STATE/libvirtd.pid" libvirtd
  stop_pid "$STATE/virtlogd.pid" virtlogd
}

env_exports() {
  echo "export VMLET_LIBVIRT_QEMU_URI=$URI"
  # Only once `up` made them: tests that need the network skip without it.
  if has_netns "$LAN_PROBE"; then
    echo "export VMLET_LIBVIRT_QEMU_NETWORK=$LAN"
    echo "export VMLET_LIBVIRT_QEMU_NETWORK_PROBE=$LAN_PROBE"
    echo "export VMLET_LIBVIRT_QEMU_NETWORK_GATEWAY=$LAN_GATEWAY"
  else
    log "no namespace $LAN_PROBE (hack/libvirtd.sh up, as root): the test network's exports left out"
  fi
}

status() {
  local ok=0 net
  if answers; then
    echo "libvirtd $URI answers, $(v list --all --name 2>/dev/null | grep -c . || true) domain(s)"
  else
    echo "libvirtd $URI does not answer"
    ok=1
  fi
  if ! answers; then
    net="unknown"
    ok=1
  elif lan_active; then
    net="active, $(v net-dhcp-leases "$LAN" 2>/dev/null | grep -c ipv4 || true) lease(s)"
  elif lan_defined; then
    net="inactive"
    ok=1
  else
    net="not defined"
    ok=1
  fi
  if has_netns "$LAN_PROBE"; then
    net+=", probe namespace $LAN_PROBE"
  else
    net+=", no probe namespace"
    ok=1
  fi
  echo "network $LAN (bridge $LAN_BRIDGE, $LAN_GATEWAY/24): $net"
  return "$ok"
}

case ${1:-} in
  up) up ;;
  down) down ;;
  uri) echo "$URI" ;;
  env) env_exports ;;
  status) status ;;
  *)
    echo "usage: $0 up|down|uri|env|status" >&2
    exit 64
    ;;
esac
