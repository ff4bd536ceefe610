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
set -euo pipefail

URI=qemu:///system
STATE=${VMLET_LIBVIRT_STATE:-/run/vmlet-libvirt}
WAIT_SECONDS=${VMLET_LIBVIRT_WAIT:-60}

log() { echo "libvirtd: $*" >&2; }

answers() { virsh -c "$URI" version >/dev/null 2>&1; }

# pid_alive <pid file> <process name>: the pid in the file runs that program.
pid_alive() {
  local file=$1 name=$2 pid
  [[ -s $file ]] || return 1
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]
}

prepare_host() {
  mkdir -p /var/log/libvirt/qemu /run/libvirt /var/lib/libvirt/qemu /var/cache/libvirt/qemu "$STATE"
  getent group kvm >/dev/null || groupadd --system kvm
  getent group libvirt >/dev/null || groupadd --system libvirt
  getent group libvirt-qemu >/dev/null || groupadd --system libvirt-qemu
  if ! getent passwd libvirt-qemu >/dev/null; then
    useradd --system --gid kvm --groups libvirt-qemu --no-create-home \
      --home-dir /var/lib/libvirt --shell /usr/sbin/nologin libvirt-qemu
  fi
}

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
    log "$URI answers already; nothing to do"
    return 0
  fi
  [[ $(id -u) == 0 ]] || { log "must run as root"; exit 1; }
  prepare_host
  start virtlogd
  start libvirtd
  local deadline=$((SECONDS + WAIT_SECONDS))
  until virsh -c "$URI" list >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "$URI did not answer within ${WAIT_SECONDS}s; last lines of /var/log/libvirt/libvirtd.log:"
      tail -n 20 /var/log/libvirt/libvirtd.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  log "$URI ready: $(virsh -c "$URI" version 2>/dev/null | sed -n 's/^Running hypervisor: //p')"
}

# stop <daemon>: stop it if this script started it and it still runs.
stop() {
  local daemon=$1 file=$STATE/$1.pid pid
  if ! pid_alive "$file" "$daemon"; then
    rm -f "$file"
    return 0
  fi
  pid=$(<"$file")
  kill -TERM "$pid"
  for _ in $(seq 1 60); do
    [[ -d /proc/$pid ]] || break
    sleep 0.25
  done
  if [[ -d /proc/$pid ]]; then
    log "$daemon (pid $pid) ignored SIGTERM for 15s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
  log "$daemon (pid $pid) stopped"
}

down() {
  stop libvirtd
  stop virtlogd
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
