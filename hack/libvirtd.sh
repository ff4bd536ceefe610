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

answers() { timeout 10 virsh -c "$URI" version >/dev/null 2>&1; }

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
  prepare_kvm
}

# prepare_kvm: give /dev/kvm the owner and mode Debian's udev rule gives it
# (root:kvm 0660), so that QEMU running as libvirt-qemu (group kvm) can use it.
prepare_kvm() {
  [[ -c /dev/kvm ]] || { log "no /dev/kvm: guests run under software emulation (TCG)"; return 0; }
  local now
  now=$(stat -c '%U:%G %a' /dev/kvm)
  if [[ $now != "root:kvm 660" ]]; then
    chown root:kvm /dev/kvm
    chmod 0660 /dev/kvm
    log "/dev/kvm was $now; now root:kvm 660 so that QEMU (user libvirt-qemu, group kvm) can use KVM"
  fi
}

# check_define: define and undefine a tiny domain within $DEFINE_WAIT seconds; a
# libvirtd stuck re-probing QEMU fails here instead of in the tests.
check_define() {
  local name=vmlet-define-check-$$ xml
  xml=$(mktemp)
  cat >"$xml" <<XML
<domain type='qemu'><name>$name</name><memory unit='MiB'>16</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='pc'>hvm</type></os></domain>
XML
  local start=$SECONDS
  if ! timeout "$DEFINE_WAIT" virsh -q -c "$URI" define "$xml" >/dev/null 2>&1; then
    rm -f "$xml"
    log "a domain define did not answer within ${DEFINE_WAIT}s (libvirtd may be re-probing QEMU);"
    log "/dev/kvm: $(stat -c '%U:%G %a' /dev/kvm 2>/dev/null || echo absent). Last lines of /var/log/libvirt/libvirtd.log:"
    tail -n 30 /var/log/libvirt/libvirtd.log >&2 || true
    timeout 10 virsh -q -c "$URI" undefine "$name" >/dev/null 2>&1 || true
    exit 1
  fi
  rm -f "$xml"
  timeout 30 virsh -q -c "$URI" undefine "$name" >/dev/null 2>&1 || true
  log "a define answered in $((SECONDS - start))s"
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
    log "$URI answers already"
    [[ $(id -u) == 0 ]] && prepare_kvm
    check_define
    return 0
  fi
  [[ $(id -u) == 0 ]] || { log "must run as root"; exit 1; }
  prepare_host
  start virtlogd
  start libvirtd
  local deadline=$((SECONDS + WAIT_SECONDS))
  until timeout 10 virsh -c "$URI" list >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "$URI did not answer within ${WAIT_SECONDS}s; last lines of /var/log/libvirt/libvirtd.log:"
      tail -n 20 /var/log/libvirt/libvirtd.log >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  check_define
  log "$URI ready: $(timeout 10 virsh -c "$URI" version 2>/dev/null | sed -n 's/^Running hypervisor: //p')"
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
