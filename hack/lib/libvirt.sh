# Shared by hack/libvirtd.sh (the machine's libvirtd) and hack/hosts.sh (two
# libvirt hosts in namespaces): what a fresh Debian 12 machine without systemd
# lacks before libvirtd starts, and small process helpers. Source it; the caller
# defines `log`.

# pid_alive <pid file> <process name>: the pid in the file runs that program
# (a zombie does not count: a daemon that exited may wait a while for pid 1 to
# reap it).
pid_alive() {
  local file=$1 name=$2 pid stat
  [[ -s $file ]] || return 1
  pid=$(<"$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  # The state follows the command, which is in parentheses.
  stat=${stat##*) }
  [[ ${stat:0:1} != Z ]]
}

# stop_pid <pid file> <process name>: SIGTERM the process if the file names a
# running <process name>, SIGKILL after 15 s; remove the file.
stop_pid() {
  local file=$1 name=$2 pid
  if ! pid_alive "$file" "$name"; then
    rm -f "$file"
    return 0
  fi
  pid=$(<"$file")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 60); do
    [[ -d /proc/$pid ]] || break
    sleep 0.25
  done
  if [[ -d /proc/$pid ]]; then
    log "$name (pid $pid) ignored SIGTERM for 15s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
  log "$name (pid $pid) stopped"
}

# prepare_host: the directories, groups and user Debian's libvirt packages
# create through systemd-tmpfiles and postinst scripts, then prepare_kvm.
prepare_host() {
  mkdir -p /etc/libvirt /var/log/libvirt/qemu /run/libvirt /var/lib/libvirt/qemu /var/cache/libvirt/qemu
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
# Without that, libvirtd's QEMU capability probe (run as root) and its validity
# check (as libvirt-qemu) disagree about KVM, libvirtd re-probes QEMU every ~2 s
# and every define waits minutes behind the capability cache.
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

# wait_answering <uri> <seconds> <daemon log>: wait until `virsh list` answers
# on <uri>; after <seconds>, print the log's tail and fail.
wait_answering() {
  local uri=$1 seconds=$2 daemon_log=$3
  local deadline=$((SECONDS + seconds))
  until timeout 10 virsh -c "$uri" list >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "$uri did not answer within ${seconds}s; last lines of $daemon_log:"
      tail -n 20 "$daemon_log" >&2 || true
      return 1
    fi
    sleep 0.5
  done
}

# check_define <uri> <seconds> <daemon log>: define and undefine a tiny domain
# within <seconds>; a libvirtd stuck re-probing QEMU fails here instead of in
# the tests.
check_define() {
  local uri=$1 seconds=$2 daemon_log=$3
  local name=vmlet-define-check-$$ xml start=$SECONDS
  xml=$(mktemp)
  cat >"$xml" <<XML
<domain type='qemu'><name>$name</name><memory unit='MiB'>16</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='pc'>hvm</type></os></domain>
XML
  if ! timeout "$seconds" virsh -q -c "$uri" define "$xml" >/dev/null 2>&1; then
    rm -f "$xml"
    log "$uri: a domain define did not answer within ${seconds}s (libvirtd may be re-probing QEMU);"
    log "/dev/kvm: $(stat -c '%U:%G %a' /dev/kvm 2>/dev/null || echo absent). Last lines of $daemon_log:"
    tail -n 30 "$daemon_log" >&2 || true
    timeout 10 virsh -q -c "$uri" undefine "$name" >/dev/null 2>&1 || true
    return 1
  fi
  rm -f "$xml"
  timeout 30 virsh -q -c "$uri" undefine "$name" >/dev/null 2>&1 || true
  log "$uri: a define answered in $((SECONDS - start))s"
}
