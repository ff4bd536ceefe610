#!/usr/bin/env bash
# A real libvirt host (qemu:///system) on a machine without systemd, for vmlet's
# integration tests and demo. Needs root and Debian's libvirt-daemon-system,
# libvirt-clients and qemu-system-x86.
#
#   hack/libvirtd.sh up     start virtlogd + libvirtd unless qemu:///system answers
#                           already; wait until `virsh list` works (up to 60 s)
#   hack/libvirtd.sh down   stop the daemons `up` started (and nothing else)
#   hack/libvirtd.sh uri    print the connection URI (for VMLET_LIBVIRT_QEMU_URI)
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

up() {
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

# Stop the daemons this script started (their pid files are in $STATE).
down() {
  stop_pid "$STATE/libvirtd.pid" libvirtd
  stop_pid "$STATE/virtlogd.pid" virtlogd
}

case ${1:-} in
  up) up ;;
  down) down ;;
  uri) echo "$URI" ;;
  *)
    echo "usage: $0 up|down|uri" >&2
    exit 64
    ;;
esac
